"""Why sampled DFlash-2 decoding commits few tokens per round on the embedded pair, and what would help.

    python experiments/embedded/sampling_analysis.py [--prompts 20] [--max-new-tokens 128] [--repetitions 2]

Issue 32, item 3. At T = 1 (top-k 20, top-p 0.95) the walk commits far fewer tokens per round than greedy.
A sampled round accepts draft token d at position t with probability min(1, p̃_t(d) / q_t(d)), so the
expected acceptance at t, given the tokens before it, is α_t = Σ_x min(p̃_t(x), q_t(x)): it depends only
on how well the walk's q (softmax of its lattice scores over the K candidates) matches the target's p̃.

Part 1 (acceptance): every sampled round of the walk is decoded for real; at each drafted position the
script reads p̃_t from the target's verify pass and computes α_t for the walk's own q and for other q's
over the same K candidates (sharper or flatter q, q cut to its top-p nucleus, a one-hot q on its most
likely candidate, and the ceiling: p̃'s mass on the K candidates, the best any q over them can do). The
alternatives are read at the walk's own prefix: for t > 1 they say what a round would accept given the
walk's earlier tokens, not what a whole round with that q would commit.

Part 2 (rounds): the decodes themselves (StaticTarget compiled, as the bench's batch-1 rows), interleaved,
`--repetitions` times: plain decoding, the walk at T = 0 and at T = 1, the walk drafting with q at a draft
temperature of 0.5 (verification reads that q, so the output is still exactly the target's), the argmax
path at T = 1 (a one-hot q) and tree15 at T = 1; τ, tokens per second against plain decoding, and the
round's drafting and verify milliseconds.

Writes docs/results/sampling_analysis.{json,md} and prints the tables. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dflash2.decoding.round as round_mod  # noqa: E402
from dflash2 import load_embedded, spec_generate  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.decoding.loop import ar_generate  # noqa: E402
from dflash2.decoding.sampling import SamplingParams, process_logits  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

SAMPLING = dict(temperature=1.0, top_k=20, top_p=0.95)  # the bench's sampling setting
POSITIONS = 15  # B - 1 at the shipped block size


def q_variants(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The walk's q [L, K] (one row per drafted position) → other q's over the same candidates."""
    def power(e: float) -> torch.Tensor:  # q ∝ q^e: draft temperature 1/e
        w = q.clamp_min(1e-300) ** e
        return w / w.sum(-1, keepdim=True)

    order = q.argsort(-1, descending=True)
    sorted_q = q.gather(-1, order)
    keep_sorted = (sorted_q.cumsum(-1) - sorted_q) < 0.95  # the smallest nucleus holding 0.95 of q
    nucleus = torch.zeros_like(q).scatter(-1, order, keep_sorted.to(q.dtype)) * q
    return {"walk q (T = 1)": q, "q at draft T = 0.7": power(1 / 0.7), "q at draft T = 0.5": power(2.0),
            "q at draft T = 1.5": power(1 / 1.5), "q's top-p 0.95 nucleus": nucleus / nucleus.sum(-1, keepdim=True),
            "one-hot on q's top candidate": torch.zeros_like(q).scatter(-1, order[:, :1], 1.0)}


class AcceptanceRecorder:
    """Wraps round.verify_block: for each stochastic draft, α_t of every q variant at each drafted position."""

    def __init__(self, params: SamplingParams) -> None:
        self.params, self.rows = params, []  # rows: per round {variant: [α_t for t < L]}
        self.inner = round_mod.verify_block

    def __call__(self, draft, logits, params, rng):
        if draft.q_probs is not None and draft.tokens.shape[0]:
            L = draft.tokens.shape[0]
            p = process_logits(logits[:L].double(), self.params)  # p̃_t [L, V] at the drafted positions
            on_cands = p.gather(-1, draft.q_ids.to(p.device))  # [L, K]
            q = draft.q_probs.double().to(p.device)
            row = {name: torch.minimum(on_cands, v).sum(-1).tolist() for name, v in q_variants(q).items()}
            row["ceiling: p̃'s mass on the K candidates"] = on_cands.sum(-1).tolist()
            self.rows.append(row)
        return self.inner(draft, logits, params, rng)


class DraftTemperature:
    """A drafter whose sampled q is softmax(scores / (T × factor)); verification reads that q, so the
    output distribution is still exactly the target's (only acceptance changes)."""

    def __init__(self, drafter, factor: float) -> None:
        self.drafter, self.factor = drafter, factor

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, cache, anchor, new_features, target, temperature, rng):
        return self.drafter.propose(cache, anchor, new_features, target, temperature * self.factor, rng)


def summarize_acceptance(rows: list[dict]) -> list[dict]:
    """Per q variant: mean α at positions 1, 2, 4, 8 and the expected tokens a round commits,
    1 + Σ_t Π_{s<=t} α_s, averaged over rounds (at the walk's prefix)."""
    out = []
    for name in rows[0]:
        per_pos = [[r[name][t] for r in rows if len(r[name]) > t] for t in range(POSITIONS)]
        expected = [1 + sum(torch.tensor(r[name]).cumprod(0).tolist()) for r in rows]
        out.append(dict(q=name, **{f"alpha_{t + 1}": sum(v) / len(v) for t, v in enumerate(per_pos) if v and t in (0, 1, 3, 7)},
                        expected_commit=sum(expected) / len(expected)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "sampling_analysis"))
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.repetitions < 1:
        ap.error("--prompts, --max-new-tokens and --repetitions must be positive")

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    tokenizer, target, drafter = load_embedded("dflash2")
    drafter = drafter.with_config(block_size=POSITIONS + 1)
    texts, source = load_prompts("humaneval", args.prompts)
    prompts = [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts]
    stops = [tokenizer.eos_token_id]
    plain_target = StaticTarget(target, (), compile=True)  # as the bench's batch-1 _static rows
    spec_target = StaticTarget(target, tuple(drafter.target_layer_ids), compile=True)
    params = SamplingParams(**SAMPLING)
    load_before = os.getloadavg()[0]

    # part 1: acceptance of the walk's q and of the alternatives, over real sampled rounds
    recorder = AcceptanceRecorder(params)
    round_mod.verify_block = recorder
    try:
        for i, ids in enumerate(prompts):
            spec_generate(drafter, spec_target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                          generator=torch.Generator().manual_seed(i), **SAMPLING)
    finally:
        round_mod.verify_block = recorder.inner
    acceptance = summarize_acceptance(recorder.rows)

    # part 2: the rounds themselves, interleaved (after one untimed decode of each: compiles, first calls)
    methods = {
        "plain decoding (T = 1)": lambda ids, g: ar_generate(plain_target, ids, generator=g, **common, **SAMPLING),
        "walk, greedy": lambda ids, g: spec_generate(drafter, spec_target, ids, generator=g, **common),
        "walk, T = 1": lambda ids, g: spec_generate(drafter, spec_target, ids, generator=g, **common, **SAMPLING),
        "walk, T = 1, q at draft T = 0.5": lambda ids, g: spec_generate(DraftTemperature(drafter, 0.5), spec_target, ids,
                                                                         generator=g, **common, **SAMPLING),
        "argmax path, T = 1": lambda ids, g: spec_generate(argmax, spec_target, ids, generator=g, **common, **SAMPLING),
        "tree15, T = 1": lambda ids, g: spec_generate(drafter, spec_target, ids, generator=g, verify="tree",
                                                      tree_nodes=15, **common, **SAMPLING),
    }
    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    argmax = drafter.with_config(selector="argmax")
    totals = {m: dict(tokens=0, seconds=0.0, rounds=0, committed=0, draft_s=0.0, verify_s=0.0) for m in methods}
    for run in methods.values():
        run(prompts[0], torch.Generator().manual_seed(0))
    for rep in range(args.repetitions):
        for i, ids in enumerate(prompts):
            for name, run in methods.items():
                out = run(ids, torch.Generator().manual_seed(1000 * rep + i))
                t = totals[name]
                t["tokens"] += out.new_tokens.numel()
                t["seconds"] += out.total_s - out.prefill_s
                t["rounds"] += out.num_rounds
                t["committed"] += sum(out.acceptance_lengths)
                t["draft_s"] += out.draft_s
                t["verify_s"] += out.verify_s
        print(f"repetition {rep + 1}/{args.repetitions} done", file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]
    plain = totals["plain decoding (T = 1)"]
    plain_rate = plain["tokens"] / plain["seconds"]
    rounds = [dict(method=m, tau=t["committed"] / max(t["rounds"], 1), tokens_per_s=t["tokens"] / t["seconds"],
                   vs_plain=t["tokens"] / t["seconds"] / plain_rate, draft_ms=1e3 * t["draft_s"] / max(t["rounds"], 1),
                   verify_ms=1e3 * t["verify_s"] / max(t["rounds"], 1)) for m, t in totals.items()]
    for r in rounds:  # the τ a round of this cost needs to tie plain decoding
        r["break_even_tau"] = (r["draft_ms"] + r["verify_ms"]) / 1e3 * plain_rate

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    meta = dict(command="python experiments/embedded/sampling_analysis.py " + " ".join(argv or sys.argv[1:]),
                commit=commit + ("+changes" if dirty else ""), finished=datetime.datetime.now(datetime.UTC).strftime(
                    "%Y-%m-%d %H:%M UTC"), machine=platform.platform(), threads=torch.get_num_threads(),
                load_before=load_before, load_after=load_after, prompts=f"humaneval, first {len(prompts)} ({source})",
                max_new_tokens=args.max_new_tokens, repetitions=args.repetitions, sampling=SAMPLING,
                sampled_rounds=len(recorder.rows))
    lines = markdown(meta, acceptance, rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, acceptance=acceptance, rounds=rounds), indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def markdown(meta: dict, acceptance: list[dict], rounds: list[dict]) -> list[str]:
    return [
        f"Command: `{meta['command'].strip()}` at {meta['commit']}, finished {meta['finished']}, {meta['machine']}, "
        f"{meta['threads']} threads; load average {meta['load_before']:.2f} before, {meta['load_after']:.2f} after. "
        f"Prompts: {meta['prompts']}, {meta['max_new_tokens']} new tokens, T = 1, top-k 20, top-p 0.95.",
        "",
        f"Acceptance of each q over the walk's K candidates, at the walk's own prefix ({meta['sampled_rounds']} "
        "sampled rounds): α_t = Σ min(p̃_t, q_t), the chance that position t is accepted given the tokens before it; "
        "the expected tokens a round commits, 1 + Σ_t Π_{s<=t} α_s.",
        "",
        "| q | α_1 | α_2 | α_4 | α_8 | expected tokens per round |",
        "|---|---|---|---|---|---|",
        *[f"| {a['q']} | {a.get('alpha_1', 0):.3f} | {a.get('alpha_2', 0):.3f} | {a.get('alpha_4', 0):.3f} | "
          f"{a.get('alpha_8', 0):.3f} | {a['expected_commit']:.2f} |" for a in acceptance],
        "",
        f"The decodes, interleaved, {meta['repetitions']} repetitions (tokens per second without the prefill; "
        "break-even τ: the tokens a round of that cost must commit to tie plain decoding).",
        "",
        "| method | τ | tokens/s | vs plain | draft ms/round | verify ms/round | break-even τ |",
        "|---|---|---|---|---|---|---|",
        *[f"| {r['method']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}× | {r['draft_ms']:.1f} | "
          f"{r['verify_ms']:.1f} | {r['break_even_tau']:.2f} |" for r in rounds],
    ]


if __name__ == "__main__":
    sys.exit(main())
