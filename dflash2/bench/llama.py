"""llama.cpp's rows of a table: `llama-server` on the target's weights (converted once by llama.cpp's own
script, or the target's own GGUF file) and with our drafters (exported in the published layout, then
converted), through `dflash2.engines.llama_cpp`.

Like vLLM's rows, they take a repetition after each of ours (`run_llama`, called once per repetition):
a server is started for its row, warmed up with one short untimed request, sent every conversation of
the set in turn (each turn's prompt holds the server's own earlier answers, as our loop's hold ours),
and stopped, so no idle server shares the cores with our rows. Batch 1 only (one slot). τ is the
server's: 1 + accepted / verification passes, from its /metrics counters (the module docstring of
dflash2.engines.llama_cpp says how it counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from dflash2.bench.config import LLAMA_METHODS, BenchConfig
from dflash2.bench.methods import Method, Run, resolve
from dflash2.bench.prompts import PromptSet



@dataclass
class LlamaResult:
    """What llama-server did over one repetition of a row: its counters, or the error it stopped with."""

    drafts: int = 0
    accepted: int = 0
    error: str | None = None
    version: str = "llama.cpp"

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    acceptance_by_position: tuple = ()  # llama-server counts no positions

    def __add__(self, other: "LlamaResult") -> "LlamaResult":
        return LlamaResult(self.drafts + other.drafts, self.accepted + other.accepted, self.error or other.error,
                           self.version)


def llama_methods(cfg: BenchConfig, drafters: dict) -> list[Method]:
    """The table's llama rows: plain decoding per weights type, and each of our drafters it has."""
    out = []
    for weights in cfg.llama_weights:
        for family in LLAMA_METHODS:
            kind = family.removeprefix("llama_")
            if family in cfg.methods and (kind == "ar" or kind in drafters):
                out.append(Method(family, weights))
    return out


def model_gguf(cfg: BenchConfig, weights: str) -> Path:
    """The target as a GGUF of `weights` (converted once, into the dflash2 cache's gguf/: each is the size of
    the model, so never into a results directory), or its own file ("gguf")."""
    from dflash2.engines.llama_cpp import convert_model
    from dflash2.targets.gguf import SMOLLM2, cache_dir, is_gguf, smollm2_gguf

    if weights == "gguf":
        return smollm2_gguf() if cfg.target == SMOLLM2 else Path(cfg.target)
    source = Path(resolve(cfg.target))
    stem = Path(cfg.target).stem if is_gguf(cfg.target) or cfg.target == SMOLLM2 else source.name
    where = cache_dir() / "gguf" / hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    where.mkdir(parents=True, exist_ok=True)
    return convert_model(cfg.llama_cpp, source, where / f"{stem}-{weights}.gguf", weights)


def drafter_gguf(cfg: BenchConfig, drafter, target, block: int, weights: str, where: Path) -> Path:
    """Our drafter at block size `block` as llama.cpp reads it: the published layout, then its converter
    (float32 weights, or the row's type where the converter writes it: bf16, f16)."""
    from dflash2.engines.llama_cpp import convert_drafter

    reference = where / f"reference_B{block}"
    if not reference.exists():
        drafter.with_config(block_size=block).float().save_pretrained(reference, format="reference", target=target)
    outtype = weights if weights in ("f32", "bf16", "f16") else "f32"
    return convert_drafter(cfg.llama_cpp, reference, resolve(cfg.target), where / f"drafter_B{block}_{outtype}.gguf",
                           outtype)


def run_llama(cfg: BenchConfig, drafters: dict, target, prompter, prompts: PromptSet, block: int, conc: int,
              setting: dict, runs: dict, rep: int, skip: frozenset = frozenset(),
              exports: dict | None = None) -> Iterator[tuple[Method, LlamaResult]]:
    """Repetition `rep` of the llama rows of one table (but those in `skip`: refused before): adds to
    `runs` per conversation and yields (Method, LlamaResult). `exports`: the converted drafters of the
    run so far (a dict the bench keeps; their temporary directory lives as long as it)."""
    from dflash2.engines.llama_cpp import LlamaServer

    if not cfg.llama_cpp or conc != 1:
        return
    exports = {} if exports is None else exports
    where = exports.setdefault("dir", tempfile.TemporaryDirectory(prefix="dflash2-bench-llama-"))
    convs = prompts.conversations
    for method in llama_methods(cfg, drafters):
        if method in skip:
            continue
        kind, result = method.family.removeprefix("llama_"), LlamaResult()
        try:
            model = model_gguf(cfg, method.dtype)
            drafter = None
            if kind != "ar":
                key = (kind, block, method.dtype)
                if key not in exports:
                    exports[key] = drafter_gguf(cfg, drafters[kind], target, block, method.dtype,
                                                Path(where.name) / kind)
                drafter = exports[key]
            with LlamaServer(cfg.llama_cpp, model, drafter=drafter, draft_max=block - 1,
                             threads=torch.get_num_threads()) as server:
                server.complete(prompter.ids(prompts, convs[0], [])[:16], 4)  # untimed: first-call costs
                for p, conv in enumerate(convs):
                    answers: list[str] = []
                    total = None
                    for _ in conv.turns:
                        out = server.complete(prompter.ids(prompts, conv, answers), cfg.max_new_tokens,
                                              seed=cfg.seed + 1000 * rep + p, **setting)
                        answers.append(prompter.text(out.tokens))
                        result = result + LlamaResult(out.drafts, out.accepted)
                        run = Run(len(out.tokens), out.seconds, outputs=[out.tokens])
                        total = run if total is None else total + run
                    runs.setdefault(method, []).append((rep, p, total))
        except (OSError, RuntimeError, TimeoutError, ValueError) as error:
            result = dataclasses.replace(result, error=f"{type(error).__name__}: {str(error).splitlines()[0]}")
        yield method, result

