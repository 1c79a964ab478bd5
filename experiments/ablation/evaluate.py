"""The selector ablation's table: every variant trained by experiments/ablation/train.sh, decoded on the
embedded target at batch 1.

    python experiments/ablation/evaluate.py [--drafters experiments/ablation/drafters] [--prompts 20]
                                            [--out docs/results/ablation]

Variants: DFlash-1, DFlash-2 walk, DFlash-2 Viterbi (the walk's weights, selector switched), DSpark,
LiLiCorr on the DFlash-1 backbone (conv none), LiLiCorr on the DFlash-2 backbone (two_tap). For each,
on HumanEval and the held-out stdlib prompts, 128 new tokens, verify="path":

* τ greedy (and that every output equals plain decoding's, token for token), acceptance by position
  (the share of rounds that accepted at least k draft tokens);
* τ at T = 1, top-k 20, top-p 0.95 (seeded per prompt);
* draft ms per round and tokens/s, greedy, on StaticTarget (the fused target step) with eager drafters;
  plain decoding on the same StaticTarget is the baseline row. Rows take turns per prompt (every
  variant runs on prompt i before any runs on prompt i+1), so a drift of the machine touches all.
* for a drafter with a confidence head (DSpark's): predicted against observed acceptance per draft
  position (the calibration plot).

Writes OUT/table.json (with the load record), OUT/table.md, OUT/acceptance.png, OUT/calibration.png.
Time it only on a quiet machine (../shared/tools/quiet), nothing else running.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, StaticTarget, ar_generate, spec_generate  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.policy.confidence import Calibrator  # noqa: E402
from dflash2.embedded import load_embedded  # noqa: E402
from experiments.embedded.eval_humaneval import acceptance_curve  # noqa: E402 (P(round accepts >= k drafts))

VARIANTS = {  # row name → (trained drafter directory, selector at decoding time or None: as trained)
    "DFlash-1": ("dflash1", None),
    "DFlash-2 walk": ("dflash2", None),
    "DFlash-2 Viterbi": ("dflash2", "viterbi"),
    "DSpark": ("dspark", None),
    "LiLiCorr (DFlash-1 backbone)": ("lilicorr_v1", None),
    "LiLiCorr (DFlash-2 backbone)": ("lilicorr_v2", None),
}
SUITES = ("humaneval", "stdlib_heldout")
SAMPLING = dict(temperature=1.0, top_k=20, top_p=0.95)


class Recording:
    """A drafter that records each round's Draft.confidence (the declared Drafter interface, delegated)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.rounds = drafter, []
        self.block_size, self.target_layer_ids = drafter.block_size, drafter.target_layer_ids

    def new_cache(self):
        return self.drafter.new_cache()

    def propose(self, cache, anchor, new_features, target, temperature, rng):
        draft = self.drafter.propose(cache, anchor, new_features, target, temperature, rng)
        self.rounds.append(draft.confidence)
        return draft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default=str(ROOT / "experiments" / "ablation" / "drafters"))
    p.add_argument("--prompts", type=int, default=20, help="per suite")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "ablation"))
    args = p.parse_args()
    drafters_dir, out = Path(args.drafters), Path(args.out)
    missing = sorted({d for d, _ in VARIANTS.values() if not (drafters_dir / d / "config.json").is_file()})
    variants = {name: v for name, v in VARIANTS.items() if v[0] not in missing}
    if not variants:
        raise SystemExit(f"error: no trained drafter in {drafters_dir}: bash experiments/ablation/train.sh first")
    if missing:
        print(f"not trained yet, left out: {missing} (bash experiments/ablation/train.sh {' '.join(missing)})")
    torch.manual_seed(0)
    tok, model, _ = load_embedded("dflash2")
    drafters = {}
    for name, (directory, selector) in variants.items():
        d = DFlash2Drafter.from_pretrained(drafters_dir / directory, dtype=torch.float32)
        drafters[name] = d.with_selector(selector) if selector else d
    layers = {d.target_layer_ids for d in drafters.values()}
    if len(layers) != 1:
        raise SystemExit(f"error: the variants read different target layers {layers}: train them from one config")
    target = StaticTarget(model, layers.pop())
    plain = StaticTarget(model)  # plain decoding reads no layers
    stops = [tok.eos_token_id]
    B = next(iter(drafters.values())).block_size

    monitor = LoadMonitor()
    results: dict = {suite: {name: dict(lengths=[], sampled=[], draft_s=0.0, rounds=0, tokens=0, total_s=0.0,
                                        identical=0) for name in ["plain decoding", *drafters]} for suite in SUITES}
    calibrators = {name: Calibrator(B - 1) for name in drafters}
    for ids in [tok("def f(x):\n    return x\n", return_tensors="pt").input_ids]:  # warm-up: kernels, caches
        ar_generate(plain, ids, max_new_tokens=8)
        for d in drafters.values():
            spec_generate(d, target, ids, max_new_tokens=8)
    for suite in SUITES:
        prompts = load_prompts(suite, args.prompts)[0]
        for i, text in enumerate(prompts):
            ids = tok(text, return_tensors="pt").input_ids
            ref = ar_generate(plain, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            row = results[suite]["plain decoding"]
            row["tokens"] += ref.new_tokens.numel()
            row["total_s"] += ref.total_s
            for name, drafter in drafters.items():
                row = results[suite][name]
                rec = Recording(drafter)
                out_g = spec_generate(rec, target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                row["identical"] += torch.equal(out_g.sequences, ref.sequences)
                row["lengths"] += out_g.acceptance_lengths
                row["draft_s"] += out_g.draft_s
                row["rounds"] += out_g.num_rounds
                row["tokens"] += out_g.new_tokens.numel()
                row["total_s"] += out_g.total_s
                # Every round but the last verified its whole draft (verify="path") and accepted length - 1 of it;
                # the last may have been cut by the budget or a stop token, so what it verified is not known here.
                for confidence, length in zip(rec.rounds[:-1], out_g.acceptance_lengths[:-1]):
                    if confidence is not None:
                        calibrators[name].observe(confidence, confidence.shape[0], length - 1)
                g = torch.Generator().manual_seed(1000 + i)
                out_s = spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                                      generator=g, **SAMPLING)
                row["sampled"] += out_s.acceptance_lengths
            print(f"[{suite} {i + 1}/{len(prompts)}] " + ", ".join(
                f"{n}: τ {sum(r['lengths']) / max(1, len(r['lengths'])):.2f}" for n, r in results[suite].items()
                if n != "plain decoding"), flush=True)
    load = monitor.record()

    table = {}
    for suite in SUITES:
        base = results[suite]["plain decoding"]
        plain_tps = base["tokens"] / base["total_s"]
        table[suite] = {"plain decoding": dict(tokens_per_s=plain_tps)}
        for name in drafters:
            r = results[suite][name]
            table[suite][name] = dict(
                tau_greedy=sum(r["lengths"]) / len(r["lengths"]),
                tau_sampled=sum(r["sampled"]) / len(r["sampled"]),
                acceptance_by_position=acceptance_curve(r["lengths"], B),
                draft_ms_per_round=1000 * r["draft_s"] / r["rounds"],
                tokens_per_s=r["tokens"] / r["total_s"],
                speedup=r["tokens"] / r["total_s"] / plain_tps,
                identical=f"{r['identical']}/{args.prompts}")
    calibration = {name: c.table() for name, c in calibrators.items() if c.seen.sum() > 0}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = dict(command="python " + " ".join(sys.argv), date=str(datetime.datetime.now().replace(microsecond=0)),
                commit=commit, machine=platform.platform(), threads=torch.get_num_threads(), load=load,
                not_trained=missing, prompts_per_suite=args.prompts, max_new_tokens=args.max_new_tokens,
                sampling=SAMPLING,
                drafters=str(drafters_dir.resolve().relative_to(ROOT) if drafters_dir.resolve().is_relative_to(ROOT)
                             else drafters_dir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(dict(meta=meta, table=table, calibration=calibration), indent=1) + "\n")
    md = markdown(table, meta)
    (out / "table.md").write_text(md)
    print(md)
    plot(table, calibration, out, B)
    return 0


def markdown(table: dict, meta: dict) -> str:
    lines = [f"Embedded pair, batch 1, {meta['max_new_tokens']} new tokens, {meta['prompts_per_suite']} prompts per "
             f"suite; commit {meta['commit']}; load: other CPU {meta['load']['other_cpu']}, load average "
             f"{meta['load']['load_before']} before."
             + (f" Not trained yet, so not in the table: {', '.join(meta['not_trained'])}." if meta["not_trained"] else ""),
             ""]
    for suite, rows in table.items():
        plain = rows["plain decoding"]["tokens_per_s"]
        lines += [f"**{suite}** (plain decoding on StaticTarget: {plain:.0f} tok/s)", "",
                  "| variant | τ greedy | τ T=1 | accepted ≥1 / ≥4 / ≥8 | draft ms/round | tok/s | × plain | = plain |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            if name == "plain decoding":
                continue
            a = r["acceptance_by_position"]
            lines.append(f"| {name} | {r['tau_greedy']:.2f} | {r['tau_sampled']:.2f} | {a[0]:.2f} / {a[3]:.2f} / "
                         f"{a[7]:.2f} | {r['draft_ms_per_round']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['speedup']:.2f} | {r['identical']} |")
        lines.append("")
    return "\n".join(lines)


def plot(table: dict, calibration: dict, out: Path, B: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plots")
        return
    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), sharey=True)
    for ax, (suite, rows) in zip(axes, table.items()):
        for name, r in rows.items():
            if name != "plain decoding":
                ax.plot(range(1, B), r["acceptance_by_position"], marker=".", label=name)
        ax.set(title=f"{suite}: greedy acceptance by position", xlabel="draft position k",
               ylabel="share of rounds accepting ≥ k")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    for name, rows in calibration.items():
        fig, ax = plt.subplots(figsize=(5, 5))
        positions = sorted({r["position"] for r in rows})
        cmap = plt.get_cmap("viridis")
        for t in positions:
            pts = [r for r in rows if r["position"] == t and r["count"] >= 5]
            if pts:
                ax.scatter([r["predicted"] for r in pts], [r["observed"] for r in pts],
                           s=[4 + r["count"] ** 0.5 * 2 for r in pts], color=cmap(t / max(1, B - 2)),
                           label=f"position {t + 1}" if t in (0, B // 2, B - 2) else None)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted c_t (confidence head)",
               ylabel="observed acceptance given the tokens before",
               title=f"{name}: calibration (bins of ≥ 5 tokens)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "calibration.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
