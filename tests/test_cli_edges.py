"""What a fresh clone tripped on: malformed YAML in every CLI, bench runs that wrote into the committed
results, a long bench that kept nothing when stopped, offline hub errors that named no model, the end
of a training run that did not say where the drafter is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD = "conv: two_tap\nselector: [walk\n  bad: : :\n"  # the file: an unclosed flow sequence


def run(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("cli", ["dflash2.generate", "dflash2.train", "dflash2.bench"])
def test_a_malformed_yaml_config_is_one_error_line_with_file_line_and_column(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    out = run(cli, "--config", str(bad))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert f"--config {bad}" in errors[0] and "line 3, column 6" in errors[0] and "expected ',' or ']'" in errors[0]
    assert out.stderr.strip() == errors[0]  # nothing else printed before it (no "note:" about a random pair)


def test_a_malformed_override_names_itself():
    from dflash2.overrides import load_yaml_with_overrides

    with pytest.raises(ValueError, match=r"override 'steps=\[1': not valid YAML: line 1, column 3"):
        load_yaml_with_overrides(None, ["steps=[1"])
    with pytest.raises(ValueError, match="expected a mapping of config fields, got list"):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write("- a\n- b\n")
            f.flush()
            load_yaml_with_overrides(f.name, [])


def test_no_bench_config_writes_into_the_tracked_tree_by_default():
    from dflash2.bench.cli import default_out
    from dflash2.overrides import load_yaml_with_overrides

    configs = sorted((ROOT / "configs" / "bench").glob("*.yaml"))
    assert len(configs) >= 10
    for config in configs:
        assert "out" not in load_yaml_with_overrides(config, []), f"{config.name} sets out:"
        out = default_out(config, quick=False)
        assert out == f"runs/bench/{config.stem}"
        ignored = subprocess.run(["git", "check-ignore", "-q", out + "/results.json"], cwd=ROOT)
        assert ignored.returncode == 0, f"{out} is not ignored by git"
    from dflash2.bench import BenchConfig

    assert BenchConfig().out == "runs/bench/default"


def test_the_dry_run_says_where_a_bench_would_write():
    out = run("dflash2.bench", "--config", "configs/bench/headline.yaml", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "a run would write runs/bench/headline" in out.stdout
    out = run("dflash2.bench", "--config", "configs/bench/headline.yaml", "out=docs/results/bench_headline", "--dry-run")
    assert "a run would write docs/results/bench_headline" in out.stdout


def test_an_interrupted_bench_keeps_its_finished_tables(tmp_path, monkeypatch):
    import dflash2.bench.run as bench_run
    from dflash2.bench import BenchConfig

    calls = {"n": 0}
    summarize = bench_run.summarize

    def stop_in_the_second_table(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return summarize(*args, **kwargs)

    monkeypatch.setattr(bench_run, "summarize", stop_in_the_second_table)
    cfg = BenchConfig(quick=True, num_prompts=1, max_new_tokens=6, block_sizes=[4], repetitions=1, concurrency=[1],
                      datasets=["stdlib_heldout"], methods=["ar", "dflash2_walk"], target="tiny random models",
                      out=str(tmp_path / "bench"))
    with pytest.raises(KeyboardInterrupt):
        bench_run.run_bench(cfg)
    data = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert data["meta"]["partial"].startswith("1 of 2 tables")
    assert {r["setting"] for r in data["rows"]} == {"greedy"} and {r["method"] for r in data["rows"]} == {"ar", "dflash2_walk"}
    assert "**Partial: 1 of 2 tables" in (tmp_path / "bench" / "results.md").read_text()


def test_bench_progress_names_the_table_and_the_row_off_a_terminal(tmp_path):
    out = run("dflash2.bench", "--quick", "methods=[ar,dflash2_walk]", "concurrency=[1]", "datasets=[stdlib_heldout]",
              "settings=[greedy]", f"out={tmp_path / 'q'}")
    assert out.returncode == 0, out.stderr
    assert "table 1/1: stdlib_heldout B=8 c=1 greedy" in out.stderr
    assert "warm-up dflash2_walk (first calls compile)" in out.stderr and "done" in out.stderr
    assert (tmp_path / "q" / "results.md").read_text().startswith("Command: `python -m dflash2.bench --quick")


def test_the_recorded_command_is_the_invocation(monkeypatch):
    from dflash2.bench.report import invocation

    monkeypatch.setattr(sys, "argv", [str(ROOT / "experiments/serve/bench_server_vllm.py"), "--prompts", "8"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    monkeypatch.chdir(ROOT)
    assert invocation() == "python experiments/serve/bench_server_vllm.py --prompts 8"


def test_offline_hub_ids_are_named_with_why(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = run("dflash2.generate", "--target", "nobody/target", "--drafter", "nobody/drafter", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("error: nobody/drafter: not a local directory, and offline (HF_HUB_OFFLINE is set): "
                                  "it is not in the local Hugging Face cache")
    out = run("dflash2.train", "target=nobody/target", f"out={tmp_path / 'run'}", "steps=1", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: nobody/target: not a local directory, and offline" in out.stderr


def test_hub_failure_reads_the_wrapped_error():
    from dflash2.decoding.checks import hub_failure

    try:
        try:
            raise ConnectionError("Name or service not known")
        except ConnectionError as inner:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files") from inner
    except OSError as error:
        message = hub_failure("org/model", error)
    assert message.startswith("org/model: not a local directory, and offline")
    assert "no such repository" in hub_failure("org/model", OSError("org/model is not a local folder and is not a valid "
                                                                    "model identifier listed on the hub"))


def test_a_chat_trained_drafter_with_a_raw_prompt_is_warned_about(tmp_path):
    from dflash2.generate import chat_training_data

    (tmp_path / "train_config.json").write_text(json.dumps({"data": {"dataset": "chats.jsonl"}}))
    assert chat_training_data(str(tmp_path)) == "chats.jsonl"
    (tmp_path / "train_config.json").write_text(json.dumps({"data": {"dataset": None}}))
    assert chat_training_data(str(tmp_path)) is None
    assert chat_training_data(str(tmp_path / "missing")) is None
    import shutil

    from dflash2.embedded import embedded_path

    drafter = tmp_path / "chat_drafter"
    shutil.copytree(embedded_path("dflash2"), drafter)
    (drafter / "train_config.json").write_text(json.dumps({"data": {"dataset": "experiments/embedded/chat_sample.jsonl"}}))
    args = ("dflash2.generate", "--target", str(embedded_path("target")), "--drafter", str(drafter), "--max-new-tokens", "4")
    out = run(*args)
    assert out.returncode == 0 and "trained on chat conversations" in out.stderr and "Add --chat" in out.stderr
    out = run(*args, "--chat")
    assert out.returncode == 0 and "trained on chat conversations" not in out.stderr


@pytest.mark.parametrize("chat", [False, True])
def test_a_finished_training_run_says_where_the_drafter_is_and_how_to_use_it(chat, tmp_path, capsys):
    from dflash2.train.cli import main
    from tests.helpers import MASK, tiny_target

    if chat:  # a chat .jsonl through the embedded target's chat template
        pytest.importorskip("datasets")
        from dflash2.embedded import embedded_path

        target, mask = embedded_path("target"), 1
        data = [f"data.dataset={ROOT / 'experiments/embedded/chat_sample.jsonl'}", "data.max_conversations=2",
                "data.max_length=96", "data.shard_size=2"]
    else:
        target, mask = tmp_path / "target", MASK
        tiny_target("qwen3").save_pretrained(target)
        data = ["data.num_sequences=4", "data.prompt_tokens=4"]
    args = [f"target={target}", f"out={tmp_path / 'run'}", "steps=2", "batch_size=2", "ckpt_every=2",
            "drafter.block_size=4", "drafter.num_layers=1", f"drafter.mask_token_id={mask}", "data.new_tokens=8", *data]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    final = tmp_path / "run" / "final"
    request = ' --chat --prompt "Write a Python function that reverses a string."' if chat else ""
    assert lines[-2:] == [f"drafter: {final}", f"use it: python -m dflash2.generate --target {target} --drafter {final}"
                                              + request]
    early = [a if not a.startswith("out=") else f"out={tmp_path / 'early'}" for a in args]
    assert main(early + ["--stop-after", "1"]) == 0  # stopped before the end: no drafter yet, and it says so
    assert "the run stopped before step 2: the same command resumes it" in capsys.readouterr().out
