"""Tiny float64 targets, stub drafters and the branch enumerator shared by the tests."""

from __future__ import annotations

import functools
import os
import shutil
from collections import defaultdict
from typing import Callable

import pytest
import torch
import transformers
from torch import Tensor

from dflash2 import Draft, RandomSource, TargetAdapter
from dflash2.targets.adapter import HYBRID_MIN_TRANSFORMERS, transformers_version

VOCAB = 48
# torch.compile's CPU backend builds C++: tests that compile need a compiler (CXX, or g++)
HAS_CXX_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is not None
MASK = VOCAB - 1


def _configs(vocab: int) -> dict[str, tuple[type, object]]:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=256)
    return {
        "qwen3": (transformers.Qwen3ForCausalLM,
                  transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=8)),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, num_key_value_heads=2)),
        # window shorter than prompt + generation, so the window actually bites
        "mistral_sliding": (transformers.MistralForCausalLM,
                            transformers.MistralConfig(**common, num_key_value_heads=2, head_dim=8, sliding_window=6)),
        "gpt2": (transformers.GPT2LMHeadModel,
                 transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=4, n_head=4, n_positions=256,
                                         bos_token_id=0, eos_token_id=1)),
        "gpt_neox": (transformers.GPTNeoXForCausalLM,
                     transformers.GPTNeoXConfig(**common, bos_token_id=0, eos_token_id=1)),
    }


def _more_configs(vocab: int) -> dict[str, tuple[type, object]]:
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    mixed = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return {
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM,
                      transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16,
                                                  num_experts=4, num_experts_per_tok=2)),
        # embedding scaling, sliding and global layers, final logit soft-capping
        "gemma3": (transformers.Gemma3ForCausalLM,
                   transformers.Gemma3TextConfig(**common, intermediate_size=48, sliding_window=5, layer_types=mixed,
                                                 final_logit_softcapping=30.0)),
        # attention sinks, sliding and full layers, MoE
        "gpt_oss": (transformers.GptOssForCausalLM,
                    transformers.GptOssConfig(**common, intermediate_size=32, num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=5, layer_types=mixed)),
        "llama_tied": (transformers.LlamaForCausalLM,
                       transformers.LlamaConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                                intermediate_size=48, tie_word_embeddings=True)),
    }


def _hybrid_configs(vocab: int) -> dict[str, tuple[type, object]]:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                  linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    return {
        "qwen3_5": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**common)),
        "qwen3_5_moe": (transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**common, **moe)),
        "qwen3_next": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(**common, **moe)),
    }


ARCHITECTURES = tuple(_configs(VOCAB))
MORE_ARCHITECTURES = tuple(_more_configs(VOCAB))
HYBRID_ARCHITECTURES = tuple(_hybrid_configs(VOCAB))
# Older releases are refused by TargetAdapter (HYBRID_MIN_TRANSFORMERS): tests/test_errors.py checks the refusal.
needs_hybrid_transformers = pytest.mark.skipif(
    transformers_version() < HYBRID_MIN_TRANSFORMERS,
    reason=f"hybrid targets need transformers >= {'.'.join(map(str, HYBRID_MIN_TRANSFORMERS))}, "
           f"this is {transformers.__version__}")
# Random tiny hybrids have recurrent states ~1e-4: too weak for a stale state to flip a greedy token.
# Scaling the linear-attention projections makes the recurrence matter (plain crop then diverges).
LINEAR_ATTENTION_SCALE = 20.0


@functools.lru_cache(maxsize=None)
def tiny_target(arch: str = "qwen3", vocab: int = VOCAB, seed: int = 0, scale: float = 1.0):
    """A random float64 HF causal LM; `scale` > 1 sharpens its distributions (more agreement). Cached, so
    shared by every test in the process: copy it before changing it (`.float()` is in place)."""
    cls, config = (_configs(vocab) | _more_configs(vocab) | _hybrid_configs(vocab))[arch]
    config._experts_implementation = "eager"  # HF's grouped-mm experts kernel has no float64
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64).eval()
    with torch.no_grad():
        if scale != 1.0:
            model.get_output_embeddings().weight.mul_(scale)
        if arch in HYBRID_ARCHITECTURES:
            for name, p in model.named_parameters():
                if ".linear_attn." in name and "proj" in name:
                    p.mul_(LINEAR_ATTENTION_SCALE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    SHARED_TARGETS.append(model)
    return model


SHARED_TARGETS: list = []  # every tiny_target made: tests/conftest.py checks after each test that none was cast


@functools.lru_cache(maxsize=None)
def tiny_drafter(arch: str = "qwen3", block_size: int = 4, *, seed: int = 0, vocab: int = VOCAB, target_seed: int = 0,
                 pairwise_std: float = 0.0, **fields):
    """A random DFlash2Drafter (its weights from `seed`) over tiny_target(arch, vocab, target_seed), with
    the config `fields`; pairwise_std > 0 draws the selector's projection P from N(0, std²), so the
    walk's choices depend on their predecessors. Cached: callers derive variants with `with_config`."""
    from dflash2 import DFlash2Drafter

    torch.manual_seed(seed)
    d = DFlash2Drafter.from_target(tiny_target(arch, vocab=vocab, seed=target_seed), block_size=block_size, **fields)
    if pairwise_std > 0:
        perturb_selector(d, pairwise_std)
    return d


def perturb_selector(d, std: float):
    """Draw the selector's pairwise term from N(0, std²) (the codebook selectors' projection P, DSpark's
    Markov projection W2; both start at zero), so that its choices depend on their predecessors.
    LiLiCorr's random init already does; argmax has none."""
    sel = d.candidate_selector
    if d.config.selector == "dspark":
        torch.nn.init.normal_(sel.markov_head.markov_w2.weight, std=std)
    elif hasattr(sel, "hidden_projection"):
        torch.nn.init.normal_(sel.hidden_projection.weight, std=std)
    return d


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_token_ids=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=list(stop_token_ids) if stop_token_ids else None, pad_token_id=MASK)
    return out[0].tolist()


class _CastLinear(torch.nn.Module):
    """An nn.Linear whose product runs in `dtype`, as autocast runs it: input, weight and bias cast to it,
    the output cast back to the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear, self.dtype = linear, dtype

    @property
    def weight(self) -> Tensor:  # the float weight, as a drafter sharing the target's LM head reads it
        return self.linear.weight

    @property
    def bias(self) -> Tensor | None:
        return self.linear.bias

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.linear.bias is None else self.linear.bias.to(self.dtype)
        return torch.nn.functional.linear(x.to(self.dtype), self.linear.weight.to(self.dtype), bias).to(x.dtype)


def with_linears_in(model, dtype: torch.dtype):
    """A copy of the HF model whose every nn.Linear (the LM head's included) computes in `dtype`: what
    StaticTarget(linear_dtype=dtype) must equal."""
    import copy

    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, _CastLinear(child, dtype))
    return model


def exact_ar_distribution(model, prompt: list[int], n: int, prob_fn: Callable[[Tensor], Tensor],
                          stops: frozenset[int] = frozenset()) -> dict[tuple[int, ...], float]:
    """Exact distribution of the next n tokens (shorter if a stop token ends it), by brute force."""
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: list[int], prob: float) -> None:
        if len(seq) - len(prompt) == n or (len(seq) > len(prompt) and seq[-1] in stops):
            out[tuple(seq[len(prompt):])] = out.get(tuple(seq[len(prompt):]), 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        for tok, p in enumerate(prob_fn(logits).tolist()):
            if p > 0:
                walk(seq + [tok], prob * p)

    walk(list(prompt), 1.0)
    return out


# -- branch enumeration ---------------------------------------------------------------------------
class ScriptedSource:
    """A RandomSource that follows a script of choices and records the ones past its end."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.pos, self.prob = script, 0, 1.0
        self.arities: list[int] = []  # arity of each decision taken past the script

    def _choose(self, options: list[tuple[object, float]]):
        if self.pos < len(self.script):
            idx = self.script[self.pos]
        else:
            idx = 0
            self.arities.append(len(options))
        self.pos += 1
        value, p = options[idx]
        self.prob *= p
        return value

    def categorical(self, probs: Tensor) -> int:
        return self._choose([(i, p) for i, p in enumerate(probs.tolist()) if p > 0])

    def bernoulli(self, p: float) -> bool:
        return self._choose([(v, q) for v, q in ((True, p), (False, 1.0 - p)) if q > 0])


def enumerate_outcomes(program: Callable[[RandomSource], object]) -> tuple[dict[object, float], int]:
    """Run `program` once per branch of its random decisions; exact outcome distribution, #branches."""
    dist: dict[object, float] = defaultdict(float)
    stack, branches = [[]], 0
    while stack:
        script = stack.pop()
        source = ScriptedSource(script)
        dist[program(source)] += source.prob
        branches += 1
        taken = script + [0] * len(source.arities)
        for depth, arity in enumerate(source.arities, start=len(script)):
            stack.extend(taken[:depth] + [j] for j in range(1, arity))
    return dict(dist), branches


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# -- stub drafters (the Drafter protocol of dflash2.decoding.loop) -------------------------------------------
class StubDrafter:
    """Drafts with a function (anchor, position) → list of L tokens; deterministic path.

    It reads one target layer only to count context positions: the anchor's absolute position is the
    number of feature rows received so far.
    """

    def __init__(self, block_size: int, propose_fn: Callable[[int, int], list[int]]) -> None:
        self.block_size, self.fn = block_size, propose_fn
        self.target_layer_ids: tuple[int, ...] = (0,)

    def new_cache(self) -> dict:
        return {"position": 0}

    def propose(self, cache, anchor, new_features, target: TargetAdapter, temperature, rng) -> Draft:
        cache["position"] += new_features.shape[1]
        tokens = self.fn(anchor, cache["position"])[: self.block_size - 1]
        return Draft(torch.tensor(tokens, dtype=torch.long))


def constant_drafter(block_size: int, token: int) -> StubDrafter:
    return StubDrafter(block_size, lambda anchor, pos: [token] * (block_size - 1))


def eos_spammer(block_size: int, eos: int) -> StubDrafter:
    return constant_drafter(block_size, eos)


def random_drafter(block_size: int, vocab: int, seed: int) -> StubDrafter:
    g = torch.Generator().manual_seed(seed)
    return StubDrafter(block_size, lambda anchor, pos: torch.randint(0, vocab, (block_size - 1,), generator=g).tolist())


def oracle_drafter(block_size: int, reference: list[int], corrupt_every: int = 0) -> StubDrafter:
    """Copies the target's greedy continuation `reference` (full sequence); with corrupt_every = m,
    every m-th drafted token is replaced, so acceptance is partial."""

    def fn(anchor: int, pos: int) -> list[int]:
        out = []
        for j in range(1, block_size):
            i = pos + j  # the anchor sits at index `pos` of the full sequence
            tok = reference[i] if i < len(reference) else 0
            if corrupt_every and (i % corrupt_every == 0):
                tok = (tok + 1) % VOCAB
            out.append(tok)
        return out

    return StubDrafter(block_size, fn)


class TreeStubDrafter(StubDrafter):
    """Drafts token trees with a function (anchor, position) → list of paths (merged by prefix); its
    `propose` path is the first of them."""

    def __init__(self, block_size: int, paths_fn: Callable[[int, int], list[list[int]]]) -> None:
        super().__init__(block_size, lambda anchor, pos: paths_fn(anchor, pos)[0])
        self.paths_fn = paths_fn

    def propose_tree(self, cache, anchor, new_features, target: TargetAdapter, max_nodes: int, max_depth: int):
        from dflash2.decoding.tree import TokenTree

        cache["position"] += new_features.shape[1]
        depth = min(max_depth, self.block_size - 1)
        paths = [p[:depth] for p in self.paths_fn(anchor, cache["position"])]
        tree = TokenTree.from_paths([p for p in paths if p])  # nodes come after their parents:
        return TokenTree(tree.tokens[:max_nodes], tree.parents[:max_nodes])  # any prefix is a tree


def oracle_tree_drafter(block_size: int, reference: list[int], width: int, corrupt_every: int, seed: int):
    """`width` branches over the target's greedy continuation, nested so the tree outlives its first
    path: with C the drafted positions p where p % corrupt_every == 0, branch b is wrong (a random
    other token) at C[b], C[b+1], ... and right before. Branch 0 fails at C[0]; the tree carries on
    through branch 1 and fails only at C[width-1]."""
    g = torch.Generator().manual_seed(seed)

    def fn(anchor: int, pos: int) -> list[list[int]]:
        truth = [reference[pos + j] if pos + j < len(reference) else 0 for j in range(1, block_size)]
        wrong = [j for j in range(len(truth)) if corrupt_every and (pos + 1 + j) % corrupt_every == 0]
        paths = []
        for b in range(width):
            path = list(truth)
            for j in wrong[b:]:
                path[j] = (truth[j] + int(torch.randint(1, VOCAB, (1,), generator=g))) % VOCAB
            paths.append(path)
        return paths
    return TreeStubDrafter(block_size, fn)


# -- random checkpoints in the published format ----------------------------------------------------
def random_reference_tensors(*, v2: bool, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                             intermediate: int, n_features: int, vocab: int, taps: int = 2, group: int = 16,
                             rank: int = 8, seed: int = 0, scale: float = 0.2, base_offset: float = 0.0,
                             codebook_scale: float = 1.0, codebook_suffix: str = "", target_hidden: int | None = None,
                             own_modules: bool = False) -> dict[str, Tensor]:
    """Random float64 tensors under the published DFlash / DFlash 2 names and shapes (written from the
    published list, not through dflash2's mapping): norms 1 + N(0, scale²), everything else N(0, scale²);
    conv base kernels shifted by `base_offset`, codebooks scaled by `codebook_scale`. `target_hidden`:
    the target's width (fc reads n_features × it; default `hidden`); `own_modules`: the drafter ships its
    own `embed_tokens` and `lm_head` ([vocab, hidden], N(0, 1))."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) * scale  # noqa: E731
    H = hidden
    t = {"norm.weight": 1 + r(H), "fc.weight": r(H, n_features * (target_hidden or H)), "hidden_norm.weight": 1 + r(H)}
    if own_modules:
        t |= {"embed_tokens.weight": r(vocab, H) / scale, "lm_head.weight": r(vocab, H) / scale}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": r(heads * head_dim, H), p + "self_attn.k_proj.weight": r(kv_heads * head_dim, H),
              p + "self_attn.v_proj.weight": r(kv_heads * head_dim, H), p + "self_attn.o_proj.weight": r(H, heads * head_dim),
              p + "self_attn.q_norm.weight": 1 + r(head_dim), p + "self_attn.k_norm.weight": 1 + r(head_dim),
              p + "mlp.gate_proj.weight": r(intermediate, H), p + "mlp.up_proj.weight": r(intermediate, H),
              p + "mlp.down_proj.weight": r(H, intermediate),
              p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H)}
        if v2:
            for conv in ("attention_conv", "mlp_conv"):
                t[p + conv + ".base_kernel"] = base_offset + r(2, taps, H)
                t[p + conv + ".kernel_projection.weight"] = r(2 * taps * H // group, H)
    if v2:
        t["candidate_selector.predecessor_codebook" + codebook_suffix] = r(vocab, rank) * codebook_scale
        t["candidate_selector.successor_codebook" + codebook_suffix] = r(vocab, rank) * codebook_scale
        t["candidate_selector.hidden_projection.weight"] = r(rank, H)
    return t


def random_selector_tensors(method: str, cfg: dict, seed: int = 0, scale: float = 0.3) -> dict[str, Tensor]:
    """Random float64 tensors of DSpark's or LiLiCorr's heads under vLLM 0.32's names and shapes (its
    `Qwen3DSparkModel` / `LiLiCorrHead` parameter lists, written out here, not through dflash2's mapping),
    for a reference config.json dict `cfg`."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) * scale  # noqa: E731
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    if method == "dspark":
        rank = cfg["markov_rank"]
        t = {"markov_head.markov_w1.weight": r(V, rank) * 4, "markov_head.markov_w2.weight": r(V, rank) * 4}
        if cfg.get("enable_confidence_head"):
            width = H + (rank if cfg.get("confidence_head_with_markov") else 0)
            t |= {"confidence_head.proj.weight": r(1, width), "confidence_head.proj.bias": r(1)}
        return t
    d = cfg["dflash_config"]
    h, K, B = d["lilicorr_hidden_size"] or H, d["lilicorr_candidate_topk"], d["block_size"]
    heads, inner, factor = d["lilicorr_num_heads"], int(h * d["lilicorr_mlp_ratio"]), d["lilicorr_factor_dim"]
    linear = lambda name, n_in, n_out: {f"lilicorr.{name}.weight": r(n_out, n_in), f"lilicorr.{name}.bias": r(n_out)}  # noqa: E731
    t = {"lilicorr.slot_embedding": r(1, 1, B - 1, 1, h), "lilicorr.rank_embedding": r(1, 1, 1, K, h),
         "lilicorr.relative_slot_bias": r(heads, 2 * B - 1) * 3, "lilicorr.same_slot_bias": r(heads) * 3,
         "lilicorr.feature_norm.weight": 1 + r(5), "lilicorr.feature_norm.bias": r(5),
         "lilicorr.output_norm.weight": 1 + r(h), "lilicorr.anchor_norm.weight": 1 + r(h)}
    if h != H:
        t |= linear("token_proj", H, h)
    for name, n_in, n_out in (("pass_hidden_proj", H, h), ("feature_mlp.up_proj", 5, h), ("feature_mlp.down_proj", h, h),
                              ("context_proj", H, h), ("factor_input_proj", 3 * h, h), ("out_head", h, factor),
                              ("in_head", h, factor), ("anchor_out_head", h, factor)):
        t |= linear(name, n_in, n_out)
    for i in range(d["lilicorr_num_layers"]):
        p = f"layers.{i}."
        t |= {f"lilicorr.{p}attn_norm.weight": 1 + r(h), f"lilicorr.{p}mlp_norm.weight": 1 + r(h),
              f"lilicorr.{p}attn.in_proj_weight": r(3 * h, h), f"lilicorr.{p}attn.in_proj_bias": r(3 * h)}
        t |= linear(p + "attn.out_proj", h, h) | linear(p + "mlp.up_proj", h, inner) | linear(p + "mlp.down_proj", inner, h)
    return t


class DraftEvery:
    """A verification policy that drafts every n-th round (verifying all of it) and skips the others:
    those rounds are a batch's plain steps for every row."""

    def __init__(self, n: int) -> None:
        self.n, self.round = n, 0

    def drafts(self, rows: int) -> bool:
        self.round += 1
        return self.round % self.n == 0

    def widths(self, drafts, draft_s):
        return list(drafts.lengths)

    def observe(self, draft, verified, accepted) -> None:
        pass
