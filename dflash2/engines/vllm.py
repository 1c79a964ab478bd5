"""vLLM as a peer: run a target (and a published-format drafter) through vLLM's offline API.

vLLM lives in its own virtual environment (its pinned torch and transformers differ from ours), so
dflash2 never imports it: `run_vllm` writes a job file and starts `vllm_worker.py` with that venv's
interpreter, which needs nothing of dflash2. The benchmark, training-data regeneration and the
published-tables runs all go through this one helper.

    result = run_vllm("/path/to/vllm-venv/bin/python", target_dir, prompts, max_new_tokens=128,
                      drafter="/path/to/exported_drafter", num_speculative_tokens=15)
    result.error or (result.outputs, result.tau, result.acceptance_by_position)

Setting up the venv: docs/checkpoints.md ("Serving with vLLM").
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class VLLMResult:
    """What vLLM did with one job: outputs (generated token ids per prompt, prompt excluded, of the
    first repetition), wall seconds of its timed generate calls, every repetition's wall times
    (`walls[rep]`: one per prompt with per_prompt, else one for the set) and outputs, the
    spec-decode counters over all repetitions, or the error it refused with."""

    outputs: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    walls: list[list[float]] = field(default_factory=list)
    repetition_outputs: list[list[list[int]]] = field(default_factory=list)
    spec_decode: dict[str, Any] = field(default_factory=dict)
    vllm_version: str | None = None
    error: str | None = None
    log_tail: str = ""

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.wall_s if self.wall_s else 0.0

    @property
    def tau(self) -> float | None:
        """Committed tokens per verification round: 1 + accepted / drafts (None without drafts)."""
        drafts = self.spec_decode.get("drafts", 0)
        return 1 + self.spec_decode["accepted"] / drafts if drafts else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of rounds whose draft position i was accepted."""
        drafts = self.spec_decode.get("drafts", 0)
        return [a / drafts for a in self.spec_decode.get("accepted_per_position", [])] if drafts else []


def add_counters(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two sets of spec-decode counters (drafts, accepted, accepted_per_position, ...) as one: numbers
    add, per-position lists add element by element; None (no counters) leaves the other as it is."""
    if a is None or b is None:
        return b if a is None else a
    out: dict[str, Any] = {}
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, list) or isinstance(y, list):
            x, y = x or [], y or []
            out[key] = [p + q for p, q in zip(x, y)] + (x[len(y):] if len(x) > len(y) else y[len(x):])
        else:
            out[key] = (x or 0) + (y or 0)
    return out


def refusal_reason(error: str) -> str:
    """The line of an engine error that says why, one line for a table (pydantic wraps vLLM's
    reason in several lines and a `[type=...]` tail)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    reason = next((x for x in lines if x.startswith("Value error")), lines[0] if lines else error)
    return reason.split(" [type=")[0].replace("|", "/")[:160]


def run_vllm(python: str | Path, target: str | Path, prompts: list[list[int]], *, max_new_tokens: int,
             drafter: str | Path | None = None, num_speculative_tokens: int = 15, temperature: float = 0.0,
             dtype: str = "float32", enforce_eager: bool = False, max_model_len: int = 2048,
             tokenizer: str | Path | None = None, llm_kwargs: dict[str, Any] | None = None,
             threads: int | None = None, timeout_s: float = 1800, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids: list[int] | None = None, repetitions: int = 1, per_prompt: bool = False,
             seed: int = 0, warmup: bool = True) -> VLLMResult:
    """Generate up to `max_new_tokens` per prompt with vLLM in the interpreter `python` (EOS ignored
    unless `stop_token_ids` are given), `repetitions` times after an untimed warm-up; per_prompt
    submits one request at a time and times each (batch 1). Never raises for what vLLM does: a
    refusal or crash comes back as `error`. `seed` seeds the engine's sampling; warmup=False skips the
    warm-up (a regeneration, not a timing)."""
    python = Path(python)
    if not python.is_file():
        raise FileNotFoundError(f"no Python interpreter at {python} (the vllm_python of a venv with vLLM)")
    local = lambda p: str(Path(p).resolve()) if Path(p).exists() else str(p)  # noqa: E731  (hub ids stay as they are)
    job = dict(target=local(target), tokenizer=local(tokenizer) if tokenizer else None, prompts=prompts,
               max_new_tokens=max_new_tokens, drafter=local(drafter) if drafter else None,
               num_speculative_tokens=num_speculative_tokens, temperature=temperature, dtype=dtype,
               enforce_eager=enforce_eager, max_model_len=max_model_len, llm_kwargs=llm_kwargs or {}, top_k=top_k,
               top_p=top_p, stop_token_ids=stop_token_ids or [], repetitions=repetitions, per_prompt=per_prompt,
               seed=seed, warmup=warmup)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="dflash2-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            proc = subprocess.run([str(python), str(WORKER), str(job_path), str(result_path)], env=env,
                                  capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired as error:
            return VLLMResult(error=f"vLLM did not finish within {timeout_s:.0f} s", log_tail=str(error.stderr)[-4000:])
        log = (proc.stdout + proc.stderr)[-8000:]
        if not result_path.is_file():
            return VLLMResult(error=f"the vLLM worker exited with {proc.returncode} and no result", log_tail=log)
        data = json.loads(result_path.read_text())
    if "error" in data:
        return VLLMResult(error=data["error"], log_tail=data.get("traceback", "") + log[-2000:])
    return VLLMResult(outputs=data["outputs"], wall_s=data["wall_s"], walls=data["walls"],
                      repetition_outputs=data["repetition_outputs"], spec_decode=data["spec_decode"],
                      vllm_version=data.get("vllm_version"), log_tail=log)


__all__ = ["VLLMResult", "add_counters", "refusal_reason", "run_vllm", "WORKER"]
