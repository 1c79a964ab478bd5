"""The demo CLI: runs end to end, and bad input gives one line on stderr and exit code 2."""

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash2.generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_runs_and_greedy_matches_ar():
    out = run_cli("--max-new-tokens", "12", "--compare-ar", "--color", "always")
    assert out.returncode == 0, out.stderr
    assert "greedy outputs identical: yes" in out.stdout
    assert "randomly initialised" in out.stderr  # it says what it runs on
    assert "12 tokens in 11 rounds" in out.stdout


def test_demo_sampling_with_config_and_block_size():
    out = run_cli("--config", "configs/dflash1.yaml", "--block-size", "4", "--max-new-tokens", "8",
                  "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--color", "never")
    assert out.returncode == 0, out.stderr
    assert "block size 4" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unrecognized arguments"),
    (["--top-p", "2"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--block-size", "0"], "--block-size"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--target", "/nonexistent", "--drafter", "/nonexistent"], "does not exist"),
    (["--target", "/nonexistent"], "go together"),
    (["--config", "/nonexistent.yaml"], "no such file"),
    (["--prompt", ""], "empty"),
])
def test_bad_input_one_line_exit_2(args, message):
    out = run_cli(*args, "--max-new-tokens", "2") if "--max-new-tokens" not in args else run_cli(*args)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr
