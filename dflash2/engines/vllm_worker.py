"""Runs one vLLM offline job in the interpreter of a venv that has vLLM; imports nothing of dflash2.

    python dflash2/engines/vllm_worker.py JOB.json RESULT.json

JOB holds the target directory, an optional drafter directory (published DFlash format), token-id
prompts and sampling settings; RESULT gets the generated token ids, wall time after an untimed
warm-up, the engine's spec-decode counters, or the error with which vLLM refused the job.
`dflash2.engines.vllm` writes the job, starts this file and reads the result.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# Python puts this file's directory first on sys.path, and that directory holds dflash2's own
# engines/vllm.py: `import vllm` must find the venv's package, not that module.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def counters(llm) -> dict:
    """The engine's cumulative spec-decode counters (drafts, draft tokens, accepted, accepted per position)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = _add(out["accepted_per_position"], list(metric.values))
    return out


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=job["target"], tokenizer=job.get("tokenizer") or job["target"], dtype=job.get("dtype", "float32"),
                  seed=0, disable_log_stats=False, enforce_eager=bool(job.get("enforce_eager", False)),
                  max_model_len=int(job.get("max_model_len", 2048)))
    if job.get("drafter"):
        kwargs["speculative_config"] = {"method": job.get("method", "dflash"), "model": job["drafter"],
                                        "num_speculative_tokens": int(job["num_speculative_tokens"])}
    kwargs.update(job.get("llm_kwargs", {}))
    try:
        llm = LLM(**kwargs)
    except Exception as error:  # the engine refuses the job: report it, do not crash the caller
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    params = SamplingParams(temperature=float(job.get("temperature", 0.0)), top_k=int(job.get("top_k", 0)) or -1,
                            top_p=float(job.get("top_p", 1.0)), max_tokens=int(job["max_new_tokens"]),
                            ignore_eos=not job.get("stop_token_ids"), stop_token_ids=job.get("stop_token_ids") or None,
                            seed=int(job.get("seed", 0)))
    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    if job.get("warmup", True):  # compilation and first-call costs stay out of the timing
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = counters(llm)
    walls, outputs = [], []
    for _ in range(int(job.get("repetitions", 1))):
        if job.get("per_prompt"):  # one request at a time, each timed alone (batch 1)
            rep_walls, rep_outputs = [], []
            for prompt in prompts:
                start = time.perf_counter()
                rep_outputs += llm.generate([prompt], params, use_tqdm=False)
                rep_walls.append(time.perf_counter() - start)
        else:  # the whole set submitted at once; the engine batches up to max_num_seqs rows
            start = time.perf_counter()
            rep_outputs = llm.generate(prompts, params, use_tqdm=False)
            rep_walls = [time.perf_counter() - start]
        walls.append(rep_walls)
        outputs.append([list(o.outputs[0].token_ids) for o in rep_outputs])
    after = counters(llm)
    spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    spec["accepted_per_position"] = _add(after["accepted_per_position"], [-a for a in before["accepted_per_position"]])
    import vllm

    return {"outputs": outputs[0], "wall_s": sum(walls[0]), "walls": walls, "repetition_outputs": outputs,
            "spec_decode": spec, "vllm_version": vllm.__version__}


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main()
