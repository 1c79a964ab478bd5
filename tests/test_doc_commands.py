"""Every command printed in the README and the docs runs as written (issue: a documented `Command:`
failed with 'unrecognized arguments'). A full run is too long for the suite, so each is checked as far
as it can be without running it:

    python -m dflash2.{generate,train,bench} ARGS   main(ARGS + ["--dry-run"]): argparse, the config file,
    torchrun ... -m dflash2.train ARGS               the overrides and every check that needs no model
    python -m dflash2.OTHER                          the module exists
    python experiments/X.py ARGS                     the script's own argparse parser accepts ARGS (the
                                                     script runs up to parse_args and stops there)
    bash experiments/X.sh ARGS                       the script exists and `bash -n` parses it

A vLLM interpreter path (a venv this machine may not have) is replaced by a stand-in file. Commands
of other programs (pip, venv, sglang, pytest itself) are not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import runpy
import shlex
import subprocess
import sys

import pytest

from tests.doc_commands import ROOT, VLLM_PYTHONS, all_commands

OURS = ("dflash2.generate", "dflash2.train", "dflash2.bench")
COMMANDS = all_commands()


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's parser has accepted its arguments."""


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-venv") / "python"
    path.write_text("#!/bin/sh\n")
    return str(path)


def _argv(command: str, vllm_python: str) -> list[str]:
    for spelled in VLLM_PYTHONS:
        command = command.replace(spelled, vllm_python)
    return shlex.split(os.path.expandvars(command))


def _run_main(module: str, args: list[str]) -> tuple[int, str]:
    main = importlib.import_module(module if module != "dflash2.train" else "dflash2.train.cli").main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args if "--help" in args else [*args, "--dry-run"])
        except SystemExit as stop:  # --help, or argparse's refusal
            code = stop.code or 0
    return code, err.getvalue()


def _run_script_parser(script: str, args: list[str]) -> tuple[int, str]:
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        original(self, argv, namespace)
        raise _Parsed

    err, saved = io.StringIO(), sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            argparse.ArgumentParser.parse_args = parse_and_stop
            runpy.run_path(script, run_name="__main__")
        return 1, "the script ran past its arguments without argparse: not checked as a dry run"
    except _Parsed:
        return 0, ""
    except SystemExit as stop:
        return stop.code or 0, err.getvalue()
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved


def check(command: str, vllm_python: str) -> tuple[int, str]:
    argv = _argv(command, vllm_python)
    if argv[0] == "torchrun":  # torchrun's own flags, then -m MODULE ARGS as python would take them
        argv = ["python", *argv[argv.index("-m"):]]
    if argv[0] == "bash":
        script = ROOT / argv[1]
        if not script.is_file():
            return 1, f"no such script: {argv[1]}"
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        return parsed.returncode, parsed.stderr
    if argv[1] == "-m":
        module, args = argv[2], argv[3:]
        if module in OURS:
            return _run_main(module, args)
        if module.startswith("dflash2"):
            return (0, "") if importlib.util.find_spec(module) is not None else (1, f"no module {module}")
        raise AssertionError("other programs are filtered out before")
    script = ROOT / argv[1]
    if not script.is_file():
        return 1, f"no such script: {argv[1]}"
    if "argparse" not in script.read_text():
        compile(script.read_text(), str(script), "exec")  # takes no arguments: it parses, and that is all
        return (0, "") if len(argv) == 2 else (1, f"{argv[1]} takes no arguments")
    return _run_script_parser(str(script), argv[2:])


CHECKED = sorted(c for c in COMMANDS if not any(f" -m {m}" in f" {c}" for m in ("pytest", "venv", "pip", "sglang", "vllm")))


def test_the_docs_print_commands_to_check():
    # the extraction finds the commands the README is built around (a broken extractor would pass vacuously)
    for expected in ("python -m dflash2.generate", "python -m dflash2.train --config configs/train/embedded_chat.yaml",
                     "python -m dflash2.train --nproc-per-node 2 --config configs/embedded_dflash2.yaml",
                     "torchrun --nproc-per-node 8 -m dflash2.train --config configs/train/qwen3_8b_b16.yaml"):
        assert expected in CHECKED
    assert len(CHECKED) >= 40


@pytest.mark.parametrize("command", CHECKED)
def test_a_documented_command_runs_as_written(command, vllm_python, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, err = check(command, vllm_python)
    assert code == 0, f"{command!r} (in {', '.join(sorted(set(COMMANDS[command])))}) fails: {err.strip()[-800:]}"


@pytest.mark.parametrize("command, message", [
    ("python -m dflash2.bench --vllm-python /work/vllm-venv/bin/python --prompts 8", "unrecognized arguments"),
    ("python -m dflash2.train --config configs/train/embedded_chat.yaml stepz=5", "unknown config keys"),
    ("python experiments/serve/bench_server_vllm.py --vllm-python VENV/bin/python --prompt-count 8", "unrecognized"),
    ("python -m dflash2.corpus", "no module"),
    ("bash experiments/no_such.sh", "no such script"),
])
def test_the_check_catches_a_command_that_would_fail(command, message, vllm_python, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, err = check(command, vllm_python)
    assert code != 0 and message in err


def test_every_experiment_is_listed():
    """Every script under experiments/ is named in experiments/README.md or in its own folder's README
    (a helper another script imports counts as part of it, if that script names it)."""
    experiments = ROOT / "experiments"
    unlisted = []
    for script in sorted([*experiments.rglob("*.py"), *experiments.rglob("*.sh")]):
        relative = script.relative_to(experiments)
        readmes = [experiments / "README.md", script.parent / "README.md"]
        text = " ".join(r.read_text() for r in readmes if r.is_file())
        siblings = " ".join(s.read_text() for s in script.parent.glob("*.py") if s != script)
        if str(relative) not in text and script.name not in text and script.stem not in siblings:
            unlisted.append(str(relative))
    assert unlisted == []
