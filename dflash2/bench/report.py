"""The report of a bench run: per-prompt ratios and their spread, one row per method of each table,
results.json (rows and the load record), results.md and one figure per table."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import shlex
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dflash2.engines.vllm import refusal_reason
from dflash2.bench.config import HF_BASELINES, TARGET_STEPS, BenchConfig, cpu_description
from dflash2.bench.machine import commit, load_note
from dflash2.bench.stats import median_ratio, quartiles, ratios, tokens_per_s


def acceptance_histogram(lengths: list[int], block: int) -> list[float]:
    """Share of rounds that committed n tokens, n = 1 .. block (entry n - 1): the cards' histogram."""
    return [sum(n == m for n in lengths) / len(lengths) for m in range(1, block + 1)] if lengths else []


def summarize(runs: dict, dataset: str, block: int, setting_name: str, setting: dict,
              engine: dict | None = None) -> list[dict[str, Any]]:
    """One row per Method of a table: runs[method] = [(repetition, prompt, Run)]. `engine`: the vllm
    methods' VLLMResults (their τ, errors)."""
    engine = engine or {}
    # our AR: through the model's forward, else StaticTarget, else StaticTarget with bfloat16 products
    ar = min((m for m in runs if m.family == "ar"), key=lambda m: TARGET_STEPS.index(m.target_step), default=None)
    base = {(rep, p): r for rep, p, r in runs[ar]} if ar else {}
    ar_tps = tokens_per_s(runs[ar]) if ar and runs[ar] else None
    plain = {m: tokens_per_s(items) for m, items in runs.items() if m.plain and items}
    fastest = max(plain, key=plain.get, default=None)
    # the faster HF speculative baseline (by tokens/s over the whole set), for the rows of our loop
    hf = max((m for m in runs if m.family in HF_BASELINES), key=lambda m: tokens_per_s(runs[m]), default=None)
    best = {(rep, p): r for rep, p, r in runs[hf]} if hf else {}
    # greedy: each row's outputs against our plain decoding's on the same target step, run for run
    plains = {m.target_step: {(rep, p): r for rep, p, r in items} for m, items in runs.items() if m.family == "ar"}
    rows = []
    for method, items in runs.items():
        per_prompt = ratios(items, base)
        row = dict(method=method.name, dataset=dataset, block_size=block, setting=setting_name, **setting,
                   tokens_per_s=tokens_per_s(items), speedup=statistics.median(per_prompt) if per_prompt else None,
                   runs=len(items), new_tokens=sum(r.new_tokens for _, _, r in items))
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / ar_tps if ar_tps else None
        spread = quartiles(per_prompt)
        if spread is not None:
            row["speedup_q1"], row["speedup_q3"] = spread
        if fastest:
            row.update(fastest_ar=fastest.name, speedup_vs_fastest_ar=row["tokens_per_s"] / plain[fastest])
        if method in engine:
            result = engine[method]
            label = str(result.version) if hasattr(result, "version") else "vllm " + str(result.vllm_version)
            row.update(engine=label, error=result.error)
            if result.error:
                row.update(tokens_per_s=None, speedup=None, tokens_per_s_ratio=None, speedup_vs_fastest_ar=None)
            row["tau"] = 1.0 if method.family in ("vllm_ar", "llama_ar") and not result.error else result.tau
            if method.family.startswith("llama_dflash") and step_outputs(runs, "llama_ar", method.dtype):
                same = step_outputs(runs, "llama_ar", method.dtype)  # llama.cpp's own losslessness, run for run
                pairs = [(a, b) for rep, p, r in items if (rep, p) in same
                         for a, b in zip(r.outputs, same[rep, p].outputs)] if not setting.get("temperature") else []
                if pairs:
                    row["same_outputs_as_plain"] = sum(a == b for a, b in pairs) / len(pairs)
            if result.acceptance_by_position:
                row["acceptance_by_position"] = result.acceptance_by_position
            row["plain_decoding"] = method.plain
            rows.append(row)
            continue
        step_plain = plains.get(method.target_step) if method.drafts else None
        if step_plain:  # paired against our plain decoding through the same target step
            row["speedup_vs_step_plain"] = median_ratio(items, step_plain)
        same = step_plain if not setting.get("temperature") else None
        if same:
            pairs = [(a, b) for rep, p, r in items if (rep, p) in same
                     for a, b in zip(r.outputs, same[rep, p].outputs, strict=True)]
            if pairs:
                row["same_outputs_as_plain"] = sum(a == b for a, b in pairs) / len(pairs)
        if hf and method.drafts:
            row.update(best_hf_baseline=hf.name, speedup_vs_best_hf=median_ratio(items, best),
                       tokens_per_s_vs_best_hf=row["tokens_per_s"] / tokens_per_s(runs[hf]))
        lengths = [n for _, _, r in items if r.acceptance for n in r.acceptance]
        row["tau"] = sum(lengths) / len(lengths) if lengths else (1.0 if method.family in ("ar", "hf_generate") else None)
        if lengths:
            row["acceptance_by_position"] = [sum(n - 1 >= k for n in lengths) / len(lengths) for k in range(1, block)]
            row["acceptance_histogram"] = acceptance_histogram(lengths, block)
        chosen: Counter[int] = Counter()  # an adaptive row's widths, and the cost curve it used
        for _, _, r in items:
            chosen.update(r.widths or {})
        if chosen:
            total = sum(chosen.values())
            row["width_histogram"] = {("skip" if w < 0 else str(w)): n / total for w, n in sorted(chosen.items())}
            curve = next((r.cost for _, _, r in items if r.cost), None)
            if curve:
                row["cost_curve_ms"] = [[n, 1e3 * sec] for n, sec in curve]
            residuals = next((r.residuals for _, _, r in reversed(items) if r.residuals), None)
            if residuals:
                row["residual_ms"] = {kind: 1e3 * sec for kind, sec in residuals.items()}
        parts = [r.breakdown for _, _, r in items if r.breakdown]
        if parts and lengths:
            rounds = len(lengths)
            row["per_round_ms"] = {k: 1e3 * sum(b[k] for b in parts) / rounds for k in ("draft", "verify", "other")}
            row["prefill_ms"] = 1e3 * sum(b["prefill"] for b in parts) / len(parts)
        if method.drafts:
            row["drafter_dtype"] = method.dtype
            if method.draft_vocab:
                row["draft_vocab"] = method.draft_vocab
            row["compiled"] = method.compiled
        if method.ours:
            row["target_step"] = method.target_step
        row["plain_decoding"] = method.plain
        rows.append(row)
    taus = {m: r["tau"] for m, r in zip(runs, rows)}
    for method, row in zip(runs, rows):  # the selector's gain: τ over the same drafter's top-1 path
        top1 = dataclasses.replace(method, family="dflash2_argmax")
        if method.family in ("dflash2_walk", "dflash2_viterbi") and not (method.compiled or method.draft_vocab
                                                                         or method.draft_len) and top1 in taus:
            row["tau_gap_vs_top1"] = row["tau"] - taus[top1]
    return rows


def step_outputs(runs: dict, family: str, dtype: str) -> dict:
    """(repetition, prompt) → Run of the row `family` at `dtype` in this table ({} without it)."""
    return next(({(rep, p): r for rep, p, r in items} for m, items in runs.items()
                 if m.family == family and m.dtype == dtype), {})


def fastest_plain(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_fastest_ar again over the whole run once servers ran: the fastest plain decoding of the
    same (dataset, concurrency, setting), at the row's block size or a server's (block-free) one."""
    served = lambda r: r.get("engine", "").startswith("server") and r["block_size"] is None  # a server without a drafter
    plain = [r for r in rows if r.get("tokens_per_s") and (r.get("plain_decoding") or served(r))]
    for r in rows:
        peers = [x for x in plain if (x["dataset"], x["concurrency"], x["setting"]) ==
                 (r["dataset"], r["concurrency"], r["setting"]) and x["block_size"] in (r["block_size"], None)]
        if peers and r.get("tokens_per_s") is not None:
            fastest = max(peers, key=lambda x: x["tokens_per_s"])
            r.update(fastest_ar=fastest["method"], speedup_vs_fastest_ar=r["tokens_per_s"] / fastest["tokens_per_s"])


def write_outputs(cfg: BenchConfig, rows: list[dict[str, Any]], sources: dict[str, str],
                  load: dict[str, Any] | None = None, partial: tuple[int, int] | None = None) -> None:
    """results.json, results.md and the plots of `rows`; `partial` (done, total): written after each finished
    table, so the files say how many of the run's tables they hold."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    load = load or {}
    meta = dict(command=invocation(), date=str(now.date()),
                finished=now.strftime("%H:%M UTC"), commit=commit(), machine=platform.platform(),
                cpu=cpu_description(), torch_threads=torch.get_num_threads(), config=dataclasses.asdict(cfg),
                sources=sources, **load)
    if partial is not None and partial[0] < partial[1]:
        meta["partial"] = f"{partial[0]} of {partial[1]} tables (the run was stopped or is still going)"
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    at = f" at {meta['commit']}" if meta["commit"] else ""
    busy = [t for t in load.get("tables", []) if t.get("busy")]
    lines = [f"Command: `{meta['command']}`{at}, finished {meta['date']} {meta['finished']}, {meta['machine']}, "
             f"{meta['cpu']}.", "", *([f"**Partial: {meta['partial']}.**", ""] if "partial" in meta else []),
             load_note(load) if load else "Load: not recorded.", "",
             *[f"**Busy: {'servers ' + ', '.join(t['servers']) + ', ' if t.get('servers') else ''}{t['dataset']}, "
               f"B={t.get('block_size') or '—'}, concurrency {t['concurrency']}, {t['setting']}: other "
               f"processes used {t['other_cpu']:.2f} CPU s per s.**" for t in busy], *([""] if busy else []),
             *[f"- {name}: {src}" for name, src in sources.items()], "",
             "speedup: median of per-prompt tokens/s ratios against our AR (`ar`, else `ar_static`), measured back "
             "to back (at more than one row, per repetition: the whole prompt set; in brackets: "
             "their first and third quartiles); a server's row (B — for one without a drafter): against the "
             "server without a drafter; ratio: total "
             "tokens/s against our AR's; vs fastest plain: total tokens/s against the fastest plain decoding of the "
             "table (ours, HF generate, vLLM or a server's); = plain: greedy, the share of outputs identical to our "
             "plain decoding's of the same prompt through the same target step.", "",
             "| dataset | B | concurrency | setting | method | τ | tokens/s | speedup | ratio | vs fastest plain "
             "| vs faster HF spec. | = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec=".2f", unit="×": "—" if v is None else f"{v:{spec}}{unit}"  # noqa: E731
    for r in rows:
        hf = (f"{r['speedup_vs_best_hf']:.2f}× ({r['tokens_per_s_vs_best_hf']:.2f}× by totals)"
              if r.get("speedup_vs_best_hf") is not None else "—")
        fastest = (f"{r['speedup_vs_fastest_ar']:.2f}× ({r['fastest_ar']})"
                   if r.get("speedup_vs_fastest_ar") is not None else "—")
        tps = fmt(r["tokens_per_s"], ".1f", "") if not r.get("error") else f"refused: {refusal_reason(r['error'])}"
        spread = (f" ({r['speedup_q1']:.2f}–{r['speedup_q3']:.2f})" if r.get("speedup_q1") is not None
                  and r.get("speedup") is not None else "")
        lines.append(f"| {r['dataset']} | {r['block_size'] or '—'} | {r['concurrency']} | {r['setting']} | {r['method']} | "
                     f"{fmt(r['tau'], '.2f', '')} | {tps} | {fmt(r['speedup'])}{spread} | "
                     f"{fmt(r.get('tokens_per_s_ratio'))} | {fastest} | {hf} | "
                     f"{fmt(r.get('same_outputs_as_plain'), '.0%', '')} |")
    adaptive = [r for r in rows if r.get("width_histogram")]
    if adaptive:
        lines += ["", "What the adaptive rows chose: the share of row-rounds verified at each width (skip: rounds "
                  "it did not draft, a plain step), and the cost curve its policy used (tokens in a target pass → "
                  "ms, measured at warm-up on this machine), and the residuals it measured by the end of the run: "
                  "what a plain step and a drafting round took beyond that model, in ms.", "",
                  "| concurrency | setting | method | widths (share of row-rounds) | cost curve | residual: plain, drafting |",
                  "|---|---|---|---|---|---|"]
        for r in adaptive:
            widths = ", ".join(f"{w} {share:.0%}" for w, share in r["width_histogram"].items() if share >= 0.005)
            curve = ", ".join(f"{n} → {ms:.1f}" for n, ms in r.get("cost_curve_ms", []))
            res = r.get("residual_ms", {})
            residual = ", ".join(fmt(res.get(kind), "+.1f", "") for kind in ("plain", "draft"))
            lines.append(f"| {r['concurrency']} | {r['setting']} | {r['method']} | {widths} | {curve} | {residual} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out)
    _plot_acceptance(rows, out)


def invocation() -> str:
    """The command line of this process as a user would type it: `python -m MODULE ...` for a module run
    with -m, `python SCRIPT ...` for a script (an experiment that calls run_bench)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = f"python -m {spec.name.removesuffix('.__main__')}"
    else:
        script = Path(sys.argv[0]).resolve()
        try:
            script = script.relative_to(Path.cwd())
        except ValueError:
            pass
        head = f"python {script}"
    return " ".join([head, shlex.join(sys.argv[1:])]).strip()


def _pyplot():
    """matplotlib.pyplot on the file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot(rows, out: Path) -> list[Path]:
    """One figure per table (dataset, B, concurrency, setting): each method's speedup over our AR (median of
    per-prompt ratios: the bar, with its value) and the quartiles of those ratios (the whiskers), every
    figure on the same axis from 0. Without matplotlib: no figures, said in one line."""
    plt = _pyplot()
    if plt is None:
        print("note: matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []

    # a server's rows (its plain decoding has no block size) make a figure of their own
    key = lambda r: (r["dataset"], "server" if str(r.get("engine", "")).startswith("server") else  # noqa: E731
                     str(r["block_size"]), r["concurrency"], r["setting"])
    plotted = [r for r in rows if r.get("speedup") is not None]
    top = max([r.get("speedup_q3") or r["speedup"] for r in plotted] + [1.0]) * 1.15
    paths = []
    for group in sorted({key(r) for r in plotted}):
        sel = [r for r in plotted if key(r) == group]
        fig, ax = plt.subplots(figsize=(6.4, 0.32 * len(sel) + 1.2))
        y = list(range(len(sel)))
        med = [r["speedup"] for r in sel]
        lo = [r["speedup"] - r.get("speedup_q1", r["speedup"]) for r in sel]
        hi = [r.get("speedup_q3", r["speedup"]) - r["speedup"] for r in sel]
        ax.barh(y, med, xerr=[lo, hi], color=["tab:green" if m >= 1 else "tab:grey" for m in med], capsize=2)
        for i, m in enumerate(med):
            ax.text(m + 0.02 * top, i, f"{m:.2f}×", va="center", fontsize=7)
        ax.set_yticks(y, [r["method"] for r in sel], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xlim(0, top)
        dataset, block, conc, setting = group
        server = block == "server"
        ax.set_title(f"{dataset}, {'servers' if server else 'B=' + block}, concurrency {conc}, {setting}", fontsize=9)
        ax.set_xlabel(f"speedup over {'the server without a drafter' if server else 'our AR'} (median of "
                      "per-prompt ratios; whiskers: quartiles)", fontsize=8)
        paths.append(_save(plt, fig, out / f"speedup_{dataset}_{'server' if server else 'B' + block}_c{conc}_{setting}.png"))
    return paths


def _plot_acceptance(rows, out: Path) -> list[Path]:
    """One figure per table with drafting rows: for each, the share of rounds whose draft is accepted up to
    position k and past it (acceptance_by_position), against k. Without matplotlib: nothing."""
    plt = _pyplot()
    if plt is None:
        return []

    key = lambda r: (r["dataset"], str(r["block_size"]), r["concurrency"], r["setting"])  # noqa: E731
    drafted = [r for r in rows if r.get("acceptance_by_position")]
    paths = []
    for group in sorted({key(r) for r in drafted}):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for r in (r for r in drafted if key(r) == group):
            shares = r["acceptance_by_position"]
            label = r["method"] + (f" (τ {r['tau']:.2f})" if r.get("tau") else "")
            ax.plot(range(1, len(shares) + 1), shares, marker=".", label=label)
        dataset, block, conc, setting = group
        ax.set_title(f"{dataset}, B={block}, concurrency {conc}, {setting}", fontsize=9)
        ax.set_xlabel("draft position k", fontsize=8)
        ax.set_ylabel("rounds accepting k or more drafts", fontsize=8)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out / f"acceptance_{dataset}_B{block}_c{conc}_{setting}.png"))
    return paths

