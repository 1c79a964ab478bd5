"""The demo CLI: runs end to end, and bad input gives one line on stderr and exit code 2."""

import re
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The demo CLI; the embedded toy pair by its explicit flag unless a pair is named (nothing is fetched)."""
    toy = [] if {"--target", "--config", "--toy", "--drafter"} & set(args) else ["--toy"]
    return subprocess.run([sys.executable, "-m", "dflash2.generate", *toy, *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_runs_and_greedy_matches_ar():
    from dflash2 import embedded

    out = run_cli("--max-new-tokens", "12", "--compare-ar", "--color", "always")
    assert out.returncode == 0, out.stderr
    assert "greedy outputs identical: yes" in out.stdout
    # it says what it runs on: the embedded pair when shipped, else a random pair
    assert ("randomly initialised" in out.stderr) != embedded.available("dflash2")
    n, rounds = map(int, re.search(r"(\d+) tokens in (\d+) rounds", out.stdout).groups())
    assert 1 <= n <= 12 and rounds <= max(n - 1, 0)


def test_demo_tree_verification_matches_ar():
    out = run_cli("--max-new-tokens", "16", "--verify", "tree", "--tree-nodes", "24", "--compare-ar")
    assert out.returncode == 0, out.stderr
    assert "greedy outputs identical: yes" in out.stdout


def test_demo_with_a_bfloat16_drafter_matches_ar():
    out = run_cli("--max-new-tokens", "16", "--drafter-dtype", "bfloat16", "--compare-ar")
    assert out.returncode == 0, out.stderr
    assert "greedy outputs identical: yes" in out.stdout


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
    (["--verify", "tree", "--tree-nodes", "0"], "--tree-nodes"),
    (["--verify", "forest"], "invalid choice"),
    (["--target", "/nonexistent", "--drafter", "/nonexistent"], "--target /nonexistent: no such directory"),
    (["--target", "z-lab/some-target", "--drafter", "./missing"], "--drafter ./missing: no such directory"),
    (["--target", "missing.gguf", "--drafter", "."], "--target missing.gguf: no such directory (and not a hub id"),
    (["--block-size", "100"], "trained with blocks of 16"),
    (["--prompt", "x" * 100_000], "exceeds the target's 2048 positions"),
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
    assert len(out.stdout) < 1000  # a rejected prompt is not echoed


def test_a_named_target_passes_the_checks_without_loading_it():
    """`--target smollm2` (the train CLI prints it for a run on SmolLM2) is a name, not a directory: the dry run
    accepts it and fetches nothing."""
    out = run_cli("--target", "smollm2", "--drafter", "dflash2/embedded/dflash2", "--dry-run")
    assert out.returncode == 0 and "--target smollm2" in out.stdout, out.stderr


def test_bad_input_is_rejected_before_any_weights_load():
    for args in (["--prompt", ""], ["--target", "/nonexistent", "--drafter", "/nonexistent"]):
        out = run_cli(*args)
        assert out.returncode == 2 and "Loading" not in out.stderr and out.stdout == ""


def test_chat_on_the_embedded_pair_and_the_stats_line():
    out = run_cli("--chat", "--prompt", "Reverse a list.", "--max-new-tokens", "6", "--verify", "tree",
                  "--tree-nodes", "7")
    assert out.returncode == 0, out.stderr
    assert re.search(r"τ = [\d.]+, [\d.]+ tokens/s; block size 16, verify tree \(7 nodes\)", out.stdout)
    assert "Loading weights" not in out.stderr  # not a terminal: no progress bars


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
                     "<think></think>{% endif %}{% endif %}")


def test_chat_template_and_thinking_switch():
    import argparse

    from transformers import AutoTokenizer

    from dflash2.generate import _text_codec

    tok = AutoTokenizer.from_pretrained("dflash2/embedded/tokenizer")
    tok.chat_template = THINKING_TEMPLATE
    render = lambda **flags: tok.decode(_text_codec(tok, argparse.Namespace(chat=True, **flags))("hi")[0])
    assert render(thinking=None) == "<|user|>hi\n<|assistant|>"
    assert render(thinking=False) == "<|user|>hi\n<|assistant|><think></think>"
    assert render(thinking=True) == "<|user|>hi\n<|assistant|>"


def test_thinking_needs_chat():
    out = run_cli("--no-thinking", "--max-new-tokens", "2")
    assert out.returncode == 2 and "need --chat" in out.stderr


def test_embedded_pair_fits_the_40_mb_budget():
    """Tokenizer, target, both drafters and the AR draft model ship in the wheel: under 40 MB together."""
    from pathlib import Path

    from dflash2 import embedded

    root = Path(embedded.__file__).parent
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in {".json", ".safetensors", ".txt"}]
    assert {p.relative_to(root).parts[0] for p in files} >= {"tokenizer", "target", "dflash2", "dflash1", "ar_draft"}
    assert sum(p.stat().st_size for p in files) < 40e6


def test_the_default_is_the_real_pair_and_offline_it_says_so_and_runs_the_toy(monkeypatch, capsys, tmp_path):
    """Where the SmolLM2 drafter is installed, no flags run the real pair; where its target cannot be fetched
    the demo says why in one line and runs the toy (the fetch is replaced here: nothing is downloaded)."""
    from dflash2 import embedded, generate

    monkeypatch.setattr(embedded, "smollm2_drafter", lambda: tmp_path)
    def offline(name):
        raise ValueError("cannot fetch the SmolLM2 target: no network")
    monkeypatch.setattr(generate.gguf, "resolve_target", offline)
    assert generate.main(["--max-new-tokens", "4", "--color", "never"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == ["note: cannot fetch the SmolLM2 target: no network; running the embedded toy pair instead (--toy)"]
    assert generate.main(["--dry-run"]) == 0 and "the real pair (SmolLM2" in capsys.readouterr().out
    assert generate.main(["--toy", "--dry-run"]) == 0 and "the embedded pair" in capsys.readouterr().out
    assert generate.main(["--toy", "--target", "smollm2", "--drafter", "x"]) == 2

