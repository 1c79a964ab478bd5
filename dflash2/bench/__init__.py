"""`python -m dflash2.bench [--config configs/bench/<file>.yaml] [key=value ...] [--quick]`

Runs every method on every prompt, interleaved in one process over several repetitions, in the
table's order on even repetitions and the reverse on odd ones (ABBA: so that slow drifts of the
machine, and a row's place after another, hit all methods alike), and writes `results.json`, `results.md` and PNG plots
to `out`. Methods:

    ar               dflash2.ar_generate (our loop, block size 1)
    hf_generate      target.generate(do_sample=...)                  (our AR is no straw man)
    hf_prompt_lookup target.generate(prompt_lookup_num_tokens=B-1)
    hf_assisted      target.generate(assistant_model=<small AR draft>)
    dflash1          spec_generate with the DFlash-1 drafter
    dflash2_walk     spec_generate with the DFlash-2 drafter, published greedy walk
    dflash2_viterbi  the same weights with the exact Viterbi selector
    dflash2_argmax   the same weights with the selector ablated (top-1 per position); the walk and
                     Viterbi rows then carry `tau_gap_vs_top1`, their τ minus this row's
    dflash2_tree     the walk drafter's lattice verified as a token tree (verify="tree"), one row per
                     size in `tree_nodes` (method names dflash2_tree<M>)
    dflash2_goodput  the walk drafter with GoodputPolicy (dflash2.policy): each round verifies the
                     widths that maximise expected tokens per second under the verify cost measured
                     once on this machine (profile_verify for the row's target step at batch 1,
                     profile_verify_batch's padded pass at the row's concurrency), or skips the draft
                     when a plain step pays more; its rows carry `width_histogram` (share of
                     row-rounds per verified width, "skip" for rounds not drafted) and `cost_curve_ms`
                     (the curve it used), also tabled under results.md's main table
    dflash2_goodput_tree<M>
                     the same with token trees (TreeGoodputPolicy): each round verifies the first n
                     nodes of the walk drafter's best-first tree of M nodes, n from each node index's
                     observed acceptance rate, or skips the draft; one row per size in `tree_nodes`
    dflash2_walk_L<n> with `draft_lens: [n, ...]`: the walk drafter still runs its whole block but
                     proposes only the first n positions (drafter config `draft_len`), so the target
                     verifies n + 1 tokens per row instead of B
    dflash2_walk_V<n>, dflash2_tree<M>_V<n>
                     with `draft_vocabs: [n, ...]`: the walk and tree rows again with the drafter's LM
                     head over the n most frequent tokens of `token_counts` (a safetensors file of
                     `dflash2.drafter.draft_vocab.save_counts`, or "embedded": the embedded target's corpus)
    ..._compiled     with `compile_drafters: true`: the walk, tree and adaptive rows (and the _V<n> rows) again
                     with each drafting round through torch.compile as one graph (DFlash2Drafter.compile,
                     dynamic shapes), at every concurrency; `target_steps` chooses the target's step

With `target_steps: [hf, static]` every method of our loop also runs with the target's step through
`StaticTarget` (the model's layers written out over a preallocated cache: rows end in `_static`;
torch.compile'd in each table's untimed warm-up run: every pass but a one-token prompt's prefill);
"hf" is the model's own forward (TargetAdapter). `static_bf16mm` is the same
step with bfloat16 matrix products (StaticTarget(linear_dtype="bfloat16"); rows end in
`_static_bf16mm`): another arithmetic than the model's, so its rows are judged against plain decoding
through the same step (the `= plain` column: greedy outputs identical to it).

With `drafter_dtypes: [float32, bfloat16]` every drafter method also runs with its drafters cast to
bfloat16 (names end in `_bf16`; rows carry `drafter_dtype`). The target stays float32 throughout, so
the committed tokens are the same; a half-precision drafter only moves fewer bytes (fast on CPUs with
native bfloat16, such as AVX512-BF16; far slower matmuls without it: docs/architecture.md, "Performance choices").
`auto` is bfloat16 on a CPU with native bfloat16 matmuls (or on CUDA), float32 otherwise. The
machine's CPU (vector extension, native bfloat16 or not) is written next to every table.

Before the timed repetitions every batch-1 method runs once untimed on the first prompt (compilation
and first-call costs). Speedup is the median over (prompt, repetition) of tokens/s(method) /
tokens/s(ar) measured back to back. Rows of our drafters also compare with the faster of HF prompt
lookup and HF assisted generation (faster by tokens/s over the set): `speedup_vs_best_hf` is the
median of the same pairwise ratios against it, `tokens_per_s_vs_best_hf` the ratio of the totals.
With `concurrency: [1, 8, 32]` the methods of our loop (ar, dflash1, dflash2_*) also serve the whole
prompt set with that many rows in flight (spec_generate_batch / ar_generate_batch with continuous
batching: a finished row's place goes to the next prompt, as in a serving engine); tokens/s is then
the set's total over its wall time and speedup is against batched AR at the same concurrency.
With `vllm_python: VENV/bin/python` (a venv with vLLM, docs/checkpoints.md) the table also gets the
engine a user would pick instead, run through `dflash2.engines.vllm` in that interpreter, on the same
prompts in the same invocation: another process, launched after each repetition of our methods for one
repetition of its own, so that the engine's rows and ours take turns (this VM's speed drifts by more
than the differences measured):

    vllm_ar          vLLM plain decoding
    vllm_dflash1     vLLM with our DFlash-1 drafter exported in the reference format
    vllm_dflash2     the same with DFlash 2 (where the engine runs it; a refusal is a row saying so)

with the engine's τ from its spec-decode counters, once per dtype of `vllm_dtypes` (float32, as our
target, and/or bfloat16: rows end in `_bf16`). At concurrency 1 each request runs alone and is
timed alone; at concurrency c the set is submitted at once with `max_num_seqs=c`.
With `llama_cpp: DIR` (a llama.cpp build, docs/engines.md) the tables at concurrency 1 also get
llama.cpp's rows the same way (dflash2/bench/llama.py), once per type of `llama_weights` (bf16, f16,
f32, q8_0: the target converted by llama.cpp's own script; gguf: the target's own file):
`llama_ar_<type>` (llama-server's plain decoding) and `llama_dflash1_<type>`, `llama_dflash2_<type>`
(with our drafter in the published layout, converted), τ from its counters.
Every row has three ratios: `speedup` (median of per-prompt tokens/s ratios against our AR, as
above), `tokens_per_s_ratio` (total tokens/s against our AR's) and `speedup_vs_fastest_ar` (total
tokens/s against the fastest plain decoding of the table: ours, HF generate or vLLM's).

Timings are only results on a quiet machine. Every table records the 1-minute load average before
and after, the threads, and `other_cpu`: CPU seconds that other processes used while it ran, per
second of wall time (from /proc/stat, minus this process and its children); `busy` is true when
other_cpu > 0.1, and a busy table says so in bold at its top.
Datasets (dflash2/bench/prompts.py): the raw completion sets `humaneval` and `stdlib_heldout`, and the
model cards' suites `gsm8k`, `math500`, `humaneval-instruct`, `mbpp`, `mt-bench`, `alpaca` in z-lab/dflash's
benchmark format, through the target's chat template (`chat_template`, `enable_thinking`), read from the
hub through `datasets` or from local `{"turns": [...]}` files (`dataset_files.gsm8k=PATH`). A conversation
of several turns runs turn by turn, each prompt holding the method's own earlier answers; its tokens and
seconds add up. Rows of drafter methods carry `acceptance_histogram` (share of rounds committing 1 .. B
tokens) beside `acceptance_by_position`.
With `servers` (dflash2/bench/server.py) the same suites also go to OpenAI-compatible endpoints (SGLang,
`vllm serve`; launched and stopped by the bench when given a `launch` command), after our own rows.
`--quick` runs tiny random models for a smoke test (what CI runs).

The package, by role:

    config.py    BenchConfig (every key), sampling settings, dtypes, the CPU's capabilities
    prompts.py   the prompt sets and the model cards' suites
    methods.py   Method (one row: family, dtype, compiled, draft vocabulary, draft length, tree nodes,
                 target step) and the functions that run each, ours, HF's and vLLM's
    run.py       models, chat template, conversations turn by turn, the interleaved tables
    server.py    server mode: OpenAI-compatible endpoints, launched and stopped here
    machine.py   the load record (is the machine quiet?) and the commit measured
    report.py    ratios, rows, results.json / results.md / figures
    cli.py       the command line
"""

from dflash2.bench.cli import main
from dflash2.bench.config import BenchConfig
from dflash2.bench.methods import Method, Run
from dflash2.bench.run import run_bench

__all__ = ["BenchConfig", "Method", "Run", "main", "run_bench"]
