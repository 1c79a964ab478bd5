"""The methods of a table: what runs in each row (a `Method`), and the functions that run it.

Our loop at batch 1 (`make_methods`: AR, HF's generate / prompt lookup / assisted generation, and every
drafter variant), our batched loop with continuous batching (`make_batch_methods`), and vLLM in its
own interpreter (`run_engine`). Each returns or records a `Run` per prompt (or per set).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dflash2.decoding.batch import ar_generate_batch, spec_generate_batch
from dflash2.drafter.draft_vocab import load_counts, most_frequent
from dflash2.drafter.model import DFlash2Drafter
from dflash2.decoding.loop import ar_generate, spec_generate
from dflash2.bench.config import DTYPE_SUFFIX, DTYPES, LLAMA_METHODS, STEP_SUFFIX, VLLM_METHODS, BenchConfig
from dflash2.bench.prompts import PromptSet


@dataclass(frozen=True)
class Method:
    """One row of a table: which decoder runs, and the variant fields its name spells
    (`dflash2_tree15_V4096_compiled_bf16_static`: family dflash2_tree, 15 nodes, draft vocabulary 4096,
    compiled drafting round, bfloat16 drafter, StaticTarget step; `_static_bf16mm`: its bfloat16 products)."""

    family: str  # one of ALL_METHODS, VLLM_METHODS or LLAMA_METHODS
    dtype: str = "float32"  # the drafter's (our drafter rows), the engine's (vllm rows), the weights' (llama rows)
    compiled: bool = False  # the drafter's round through torch.compile (DFlash2Drafter.compile)
    draft_vocab: int | None = None  # the drafter's LM head over this many most frequent tokens
    draft_len: int | None = None  # propose only the first n positions of the block
    tree_nodes: int | None = None  # dflash2_tree, dflash2_goodput_tree: verify a token tree of (at most) this many nodes
    target_step: str = "hf"  # our loop: "hf" (the model's forward), "static" (StaticTarget) or "static_bf16mm"

    @property
    def name(self) -> str:
        if self.family in LLAMA_METHODS:  # its weights' type: llama_ar_bf16, llama_dflash2_gguf
            return f"{self.family}_{self.dtype}"
        trees = ("dflash2_tree", "dflash2_goodput_tree")
        name = f"{self.family}{self.tree_nodes}" if self.family in trees else self.family
        name += f"_L{self.draft_len}" if self.draft_len else ""
        name += f"_V{self.draft_vocab}" if self.draft_vocab else ""
        name += "_compiled" if self.compiled else ""
        return name + DTYPE_SUFFIX[self.dtype] + STEP_SUFFIX[self.target_step]

    @property
    def drafts(self) -> bool:
        """One of our drafters (dflash1, dflash2_*)."""
        return self.family.startswith("dflash")

    @property
    def ours(self) -> bool:
        """Our loop: AR or one of our drafters."""
        return self.family == "ar" or self.drafts

    @property
    def plain(self) -> bool:
        """Plain decoding: what speedup_vs_fastest_ar compares against."""
        return self.family in ("ar", "hf_generate", "vllm_ar", "llama_ar")

    @property
    def engine(self) -> bool:
        return self.family in VLLM_METHODS or self.family in LLAMA_METHODS


@dataclass
class Run:
    new_tokens: int
    seconds: float
    acceptance: list[int] | None = None  # tokens per round (spec methods)
    breakdown: dict[str, float] | None = None  # seconds: prefill, draft, verify, other
    outputs: list[list[int]] = field(default_factory=list)  # the generated ids of each row
    widths: dict[int, int] | None = None  # an adaptive row: row-rounds per verified width (-1: not drafted)
    cost: list[tuple[int, float]] | None = None  # and its policy's cost curve (tokens in a pass, seconds)
    residuals: dict[str, float] | None = None  # and its measured residuals after the run (plain, draft → seconds)

    def __add__(self, other: Run) -> Run:
        """Two turns of one conversation (or set) as one run: tokens, seconds and rounds add up."""
        acc = None if self.acceptance is None and other.acceptance is None else \
            (self.acceptance or []) + (other.acceptance or [])
        parts = None if not (self.breakdown and other.breakdown) else \
            {k: self.breakdown[k] + other.breakdown[k] for k in self.breakdown}
        widths = None if self.widths is None and other.widths is None else \
            dict(Counter(self.widths or {}) + Counter(other.widths or {}))
        return Run(self.new_tokens + other.new_tokens, self.seconds + other.seconds, acc, parts,
                   self.outputs + other.outputs, widths, self.cost or other.cost, other.residuals or self.residuals)


class _Policies:
    """dflash2_goodput's policies (and dflash2_goodput_tree's) at `rows` rows in flight: per target
    step, drafter and verification (path, or a tree of M nodes), the verify cost (profile_verify, or
    profile_verify_batch at more than one row), the drafting seconds (profile_draft) and the loop's own
    seconds per round (profile_loop) measured once,
    before the first timed run; per those and the sampling setting one GoodputPolicy (TreeGoodputPolicy),
    carried from prompt to prompt as a server's would be. Its acceptance statistics (Calibrator;
    NodeRates for trees) are `calibrators`' entry for the drafter, verification and setting (what is
    accepted at T = 1 is not what greedy accepts): the bench passes one dict to every table, so that a
    table at 8 or 32 rows starts from what the run has observed so far, as a server that has been
    running would."""

    def __init__(self, rows: int, padded: bool, calibrators: dict | None = None) -> None:
        self.rows, self.padded = rows, padded
        self.calibrators = {} if calibrators is None else calibrators
        self.costs: dict[tuple, Any] = {}
        self.policies: dict[tuple, Any] = {}

    def __call__(self, tgt, drafter, setting: dict, tree_nodes: int | None = None):
        from dflash2.policy.confidence import Calibrator, NodeRates
        from dflash2.policy.cost import profile_draft, profile_loop, profile_verify, profile_verify_batch
        from dflash2.policy.goodput import UNKNOWN_CONFIDENCE, GoodputPolicy, TreeGoodputPolicy
        from dflash2.targets.adapter import TargetAdapter

        key = (id(tgt), id(drafter), tree_nodes)
        positions = tree_nodes or drafter.block_size - 1  # the most tokens (nodes) a round verifies
        if key not in self.costs:
            step = tgt if isinstance(tgt, TargetAdapter) else TargetAdapter(tgt, drafter.target_layer_ids)
            sizes = tuple(range(positions + 1))  # 0: a plain step, what a skipped round costs
            cost = profile_verify(step, sizes=sizes) if self.rows == 1 else \
                profile_verify_batch(step, self.rows, sizes=sizes)
            verify = dict(verify="tree", tree_nodes=tree_nodes) if tree_nodes else {}
            self.costs[key] = (cost, profile_draft(drafter, step, self.rows, **verify),
                               profile_loop(drafter, step, self.rows, cost=cost))
        full = (*key, tuple(sorted(setting.items())))
        if full not in self.policies:
            cost, draft_s, loop_s = self.costs[key]
            common = dict(padded=self.padded, draft_s={self.rows: draft_s}, loop_s={self.rows: loop_s})
            stats = (id(drafter), tree_nodes, full[3])
            if tree_nodes:
                rates = self.calibrators.setdefault(stats, NodeRates(tree_nodes, UNKNOWN_CONFIDENCE))
                self.policies[full] = TreeGoodputPolicy(cost, positions, rates=rates, **common)
            else:
                calibrator = self.calibrators.setdefault(stats, Calibrator(positions))
                self.policies[full] = GoodputPolicy(cost, positions, calibrator=calibrator, **common)
        return self.policies[full]


def _static_targets(target, made: dict | None = None, compile: bool = True) -> Callable[[str, tuple[int, ...]], Any]:
    """(target step, target layers read) → the StaticTarget for them (compiled unless `compile` is false), made
    once and kept in `made` (the bench passes one dict for the whole run: every table's rows share the compiled
    graphs, whose warm-ups take minutes): "static_bf16mm" with bfloat16 products (linear_dtype)."""
    from dflash2.targets.static import StaticTarget

    made = {} if made is None else made

    def get(step: str, layers: tuple[int, ...]):
        if ("target", step, layers) not in made:
            made["target", step, layers] = StaticTarget(target, layers, compile=compile,
                                              linear_dtype="bfloat16" if step == "static_bf16mm" else None)
        return made["target", step, layers]
    return get


def _residuals(policy) -> dict[str, float] | None:
    """An adaptive row's measured residuals (its RoundTimer's) at the most rows measured, per kind."""
    if policy is None:
        return None
    return {kind: table[max(table)] for kind, table in policy.timer.residuals.items() if table}


def _chosen(policy, before: Counter | None) -> dict[int, int] | None:
    """The policy's row-rounds per width since `before` (a copy of policy.chosen taken before the run)."""
    return dict(policy.chosen - before) if before is not None else None


def make_methods(cfg: BenchConfig, target, drafters: dict[str, DFlash2Drafter], ar_draft, block: int,
                 stops: list[int], calibrators: dict | None = None,
                 made: dict | None = None) -> dict[Method, Callable[[torch.Tensor, dict, int], Run]]:
    """Our loop's methods and HF's baselines at batch 1; `made`: the compiled StaticTargets and drafters
    of the run so far (reused; see `_static_targets`)."""
    static = _static_targets(target, made, cfg.compile_target)
    policy_for = _Policies(1, padded=False, calibrators=calibrators)

    def ours(drafter, step="hf", **verify):
        def run(ids, setting, seed):
            g = torch.Generator().manual_seed(seed)
            layers = () if drafter is None else tuple(drafter.target_layer_ids)
            tgt = target if step == "hf" else static(step, layers)
            kw = dict(verify)
            before = None
            if kw.get("policy") == "goodput":
                kw["policy"] = policy_for(tgt, drafter, setting,
                                          kw.get("tree_nodes") if kw.get("verify") == "tree" else None)
                before = Counter(kw["policy"].chosen)
            out = (ar_generate(tgt, ids, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, generator=g,
                               **setting) if drafter is None else
                   spec_generate(drafter, tgt, ids, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops,
                                 generator=g, **setting, **kw))
            other = out.total_s - out.prefill_s - out.draft_s - out.verify_s
            return Run(out.new_tokens.numel(), out.total_s, None if drafter is None else out.acceptance_lengths,
                       dict(prefill=out.prefill_s, draft=out.draft_s, verify=out.verify_s, other=other),
                       [out.new_tokens.tolist()], _chosen(kw.get("policy"), before),
                       None if before is None else list(kw["policy"].cost.points), _residuals(kw.get("policy")))
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

    methods: dict[Method, Callable] = {}
    if "hf" in cfg.target_steps:
        methods[Method("ar")] = ours(None)
    for step in cfg.target_steps:
        if step != "hf":
            methods[Method("ar", target_step=step)] = ours(None, step)
    methods |= {Method("hf_generate"): hf(), Method("hf_prompt_lookup"): hf(prompt_lookup_num_tokens=block - 1)}
    if ar_draft is not None:
        methods[Method("hf_assisted")] = hf(assistant_model=ar_draft)
    for method, drafter, verify in _drafter_variants(cfg, drafters, block, steps=cfg.target_steps, made=made):
        for step in cfg.target_steps:  # a compiled drafter: one per step (its own graphs for that step's target)
            d = drafter[step] if isinstance(drafter, dict) else drafter
            methods[dataclasses.replace(method, target_step=step)] = ours(d, step, **verify)
    return {m: fn for m, fn in methods.items() if m.family in cfg.methods}


def _drafter_variants(cfg: BenchConfig, drafters: dict[str, DFlash2Drafter], block: int, compiled: bool = True,
                      steps: list[str] | tuple[str, ...] = ("hf",), made: dict | None = None):
    """(Method, drafter at block size `block`, spec_generate's verify arguments) of every drafter
    method, in each of cfg.drafter_dtypes; with cfg.compile_drafters (and `compiled`) also the walk,
    tree and adaptive rows with a compiled drafting round, whose drafter is a dict: target step → a
    copy compiled for it. A compiled round keeps a graph per target it drafts for, and every call
    checks the guards of the graphs before its own, which one drafter shared by two target steps paid
    on every round (docs/architecture.md, "Performance choices"). The compiled copies are kept in `made`
    (across tables, as `_static_targets`)."""
    made = {} if made is None else made
    for dtype in cfg.drafter_dtypes:
        ds = {k: d.with_config(block_size=block).to(DTYPES[dtype]) for k, d in drafters.items()}
        if "dflash1" in ds:
            yield Method("dflash1", dtype), ds["dflash1"], {}
        if "dflash2" in ds:
            walk = ds["dflash2"]
            yield Method("dflash2_walk", dtype), walk, {}
            yield Method("dflash2_viterbi", dtype), walk.with_config(selector="viterbi"), {}
            yield Method("dflash2_argmax", dtype), walk.with_config(selector="argmax"), {}
            for m in cfg.tree_nodes:
                yield Method("dflash2_tree", dtype, tree_nodes=m), walk, dict(verify="tree", tree_nodes=m)
            yield Method("dflash2_goodput", dtype), walk, dict(policy="goodput")
            for m in cfg.tree_nodes:
                yield (Method("dflash2_goodput_tree", dtype, tree_nodes=m), walk,
                       dict(verify="tree", tree_nodes=m, policy="goodput"))
            for n in cfg.draft_lens:
                yield Method("dflash2_walk", dtype, draft_len=n), walk.with_config(draft_len=n), {}
            counts = _token_counts(cfg) if cfg.draft_vocabs else None
            smalls = {n: walk.with_draft_vocab(most_frequent(counts, n)) for n in cfg.draft_vocabs}
            for n, small in smalls.items():
                yield Method("dflash2_walk", dtype, draft_vocab=n), small, {}
                for m in cfg.tree_nodes:
                    yield Method("dflash2_tree", dtype, draft_vocab=n, tree_nodes=m), small, dict(verify="tree", tree_nodes=m)
            for n, d in ({None: walk, **smalls}.items() if compiled and cfg.compile_drafters else ()):
                key = ("drafter", dtype, block, n, tuple(steps))
                if key not in made:
                    made[key] = {step: copy.deepcopy(d) for step in steps}
                    for one in made[key].values():
                        one.compile(dynamic=True)  # each round one graph, compiled on its first calls (the warm-up)
                fast = made[key]
                yield Method("dflash2_walk", dtype, compiled=True, draft_vocab=n), fast, {}
                for m in cfg.tree_nodes:
                    yield (Method("dflash2_tree", dtype, compiled=True, draft_vocab=n, tree_nodes=m), fast,
                           dict(verify="tree", tree_nodes=m))
                if n is None:  # the adaptive rows with the compiled round
                    yield Method("dflash2_goodput", dtype, compiled=True), fast, dict(policy="goodput")
                    for m in cfg.tree_nodes:
                        yield (Method("dflash2_goodput_tree", dtype, compiled=True, tree_nodes=m), fast,
                               dict(verify="tree", tree_nodes=m, policy="goodput"))


def _token_counts(cfg: BenchConfig) -> torch.Tensor:
    from dflash2.embedded import token_counts

    return token_counts() if cfg.token_counts == "embedded" else load_counts(cfg.token_counts)


def make_batch_methods(cfg: BenchConfig, target, drafters: dict[str, DFlash2Drafter], block: int,
                       stops: list[int], concurrency: int,
                       calibrators: dict | None = None,
                       made: dict | None = None) -> dict[Method, Callable[[tuple, dict, int], Run]]:
    """Our loop's methods on a prompt set (ids [N, T], attention_mask [N, T]) served `concurrency` rows
    at a time; HF baselines have no batched speculative path and are left out."""
    static = _static_targets(target, made, cfg.compile_target)

    def step_for(step: str, drafter):
        return target if step == "hf" else static(step, () if drafter is None else tuple(drafter.target_layer_ids))

    policy_for = _Policies(concurrency, padded=True, calibrators=calibrators)

    def ours(drafter, step="hf", **verify):
        def run(batch, setting, seed):
            g = torch.Generator().manual_seed(seed)
            tgt = step_for(step, drafter)
            kw = dict(max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, generator=g, concurrency=concurrency,
                      **setting)
            before = None
            if verify.get("policy") == "goodput":
                kw["policy"] = policy_for(tgt, drafter, setting,
                                          verify.get("tree_nodes") if verify.get("verify") == "tree" else None)
                before = Counter(kw["policy"].chosen)
            extra = {k: v for k, v in verify.items() if k != "policy"}
            outs = ar_generate_batch(tgt, *batch, **kw) if drafter is None else \
                spec_generate_batch(drafter, tgt, *batch, **kw, **extra)
            o = outs[0]  # timings are the batch's
            rounds = [n for r in outs for n in r.acceptance_lengths]
            other = o.total_s - o.prefill_s - o.draft_s - o.verify_s
            return Run(sum(r.new_tokens.numel() for r in outs), o.total_s, None if drafter is None else rounds,
                       dict(prefill=o.prefill_s, draft=o.draft_s, verify=o.verify_s, other=other),
                       [r.new_tokens.tolist() for r in outs], _chosen(kw.get("policy"), before),
                       None if before is None else list(kw["policy"].cost.points), _residuals(kw.get("policy")))
        return run

    methods: dict[Method, Callable] = {}
    for step in cfg.target_steps:
        methods[Method("ar", target_step=step)] = ours(None, step)
    for method, drafter, verify in _drafter_variants(cfg, drafters, block, steps=cfg.target_steps, made=made):
        if method.family != "dflash2_argmax":  # no selector ablation in batches
            for step in cfg.target_steps:  # a compiled drafter: one per step (as at batch 1)
                d = drafter[step] if isinstance(drafter, dict) else drafter
                methods[dataclasses.replace(method, target_step=step)] = ours(d, step, **verify)
    return {m: fn for m, fn in methods.items() if m.family in cfg.methods}


def run_engine(cfg: BenchConfig, drafters: dict[str, DFlash2Drafter], prompter, prompts: PromptSet,
               block: int, conc: int, setting: dict, stops: list[int], runs: dict[str, list], rep: int,
               skip: frozenset = frozenset()):
    """Repetition `rep` of the vllm_* methods of one table (but those in `skip`: refused before),
    through dflash2.engines.vllm in cfg.vllm_python: adds to `runs` (per conversation at concurrency
    1, the whole set otherwise) and yields (Method, VLLMResult). The bench calls it after each
    repetition of its own rows, so that the engine's rows and ours take turns and a change of the
    machine's speed during a table touches both. Each call launches the engine afresh (its untimed
    warm-up first). A later turn of a conversation is one more engine call whose prompts hold this
    repetition's answers (the engine runs a whole turn's prompts per call)."""
    import tempfile

    from dflash2.engines.vllm import run_vllm

    exports = tempfile.TemporaryDirectory(prefix="dflash2-bench-drafters-")
    convs = prompts.conversations
    for method in (Method(m, d) for d in cfg.vllm_dtypes for m in VLLM_METHODS if m in cfg.methods):
        if method in skip:
            continue
        kind, export, dtype = method.family.removeprefix("vllm_"), None, method.dtype
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
            turn = run_vllm(cfg.vllm_python, resolve(cfg.target), [prompter.ids(prompts, convs[i], answers[i])
                                                                    for i in active],
                            max_new_tokens=cfg.max_new_tokens, drafter=export, num_speculative_tokens=block - 1,
                            tokenizer=resolve(cfg.tokenizer) if cfg.tokenizer else None, stop_token_ids=stops,
                            repetitions=1, per_prompt=conc == 1, llm_kwargs={"max_num_seqs": conc},
                            threads=torch.get_num_threads(), dtype=dtype, **setting)
            result = turn if result is None else merge_engine(result, turn)
            if turn.error:
                break
            for i, out in zip(active, turn.outputs):
                answers[i].append(prompter.text(out))
            for walls, outs in zip(turn.walls, turn.repetition_outputs):  # the one repetition
                if conc == 1:  # each request timed alone
                    items = [((rep, i), Run(len(out), wall)) for i, wall, out in zip(active, walls, outs)]
                else:  # the whole turn in one call
                    items = [((rep, 0), Run(sum(map(len, outs)), walls[0]))]
                for key, r in items:
                    per[key] = per[key] + r if key in per else r
        runs.setdefault(method, []).extend((r, p, run) for (r, p), run in sorted(per.items()))
        yield method, result
    exports.cleanup()


def merge_engine(a, b):
    """Two turns' or repetitions' VLLMResults as one: the spec-decode counters add up; the first error stays."""
    from dflash2.engines.vllm import add_counters

    return dataclasses.replace(a, spec_decode=add_counters(a.spec_decode, b.spec_decode), error=a.error or b.error,
                               log_tail=b.log_tail or a.log_tail,
                               vllm_version=a.vllm_version or b.vllm_version)


def resolve(path: str) -> str:
    """"embedded" or "embedded:NAME" → the embedded pair's directory; "smollm2" or a .gguf file → its
    dequantized directory (dflash2.targets.gguf); anything else as it is."""
    from dflash2.embedded import embedded_path
    from dflash2.targets.gguf import resolve_target

    if path.startswith("embedded"):
        return str(embedded_path(path.split(":", 1)[1] if ":" in path else "target"))
    return resolve_target(path)
