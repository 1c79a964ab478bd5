"""The generation loop: speculative decoding with any drafter, and plain AR as a block-size-1 drafter.

    prefill the target on the prompt → first token (the anchor)
    repeat until the budget or a stop token:
        draft   = drafter.propose(context cache, anchor, new target features)       L ≤ B-1 tokens
        logits  = target.forward([anchor, draft])                                   [L+1, V]
        verdict = verify_block(draft, logits)                  accepted prefix + correction/bonus
        commit the accepted tokens and the next token; crop the target cache to the committed
        length; the verified positions' features become the drafter's new context

With verify="tree" the drafter proposes a token tree (the best nodes of its B×K lattice), the
target scores every node in one pass with a tree attention mask, `verify_tree` walks down it, and
the cache keeps the anchor and the accepted path's entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from .rng import RandomSource, TorchRandom
from .sampling import SamplingParams, greedy_token, process_logits
from .target import TargetAdapter
from .tree import TokenTree, verify_tree
from .verify import Draft, Verdict, commit, verify_block


class Drafter(Protocol):
    """What spec_generate needs from a drafter (DFlash2Drafter, AutoregressiveDrafter, test stubs)."""

    @property
    def block_size(self) -> int: ...

    @property
    def target_layer_ids(self) -> tuple[int, ...]: ...

    def new_cache(self) -> object: ...

    def propose(self, cache: object, anchor: int, new_features: Tensor | None, target: TargetAdapter,
                temperature: float, rng: RandomSource) -> Draft: ...


class AutoregressiveDrafter:
    """Block size 1: drafts nothing, so every round commits exactly the target's own token."""

    block_size = 1
    target_layer_ids: tuple[int, ...] = ()

    def new_cache(self) -> None:
        return None

    def propose(self, cache, anchor, new_features, target, temperature, rng) -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long, device=target.device))

    def propose_tree(self, cache, anchor, new_features, target, max_nodes, max_depth) -> TokenTree:
        return TokenTree.empty(target.device)


@dataclass(frozen=True)
class GenerationResult:
    """The one result type of spec_generate and ar_generate.

    sequences:          [1, T + n] long, prompt then the n new tokens.
    acceptance_lengths: tokens committed by each drafting round (bonus included, 1..B); the first
                        new token comes from the prefill and belongs to no round, so
                        n == 1 + sum(acceptance_lengths) whenever n > 0. All 1 for AR.
    finish_reason:      "stop" (a stop token was produced), "length" (budget reached).
    *_s:                wall-clock seconds of prefill, drafting, target verification, and in total.
    """

    sequences: Tensor
    prompt_length: int
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def new_tokens(self) -> Tensor:
        return self.sequences[0, self.prompt_length:]

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length τ (tokens committed per round, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens.numel() / self.total_s if self.total_s > 0 else 0.0


def spec_generate(drafter: Drafter, target, input_ids: Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, stop_token_ids=None,
                  generator: torch.Generator | None = None, rng: RandomSource | None = None,
                  on_commit: Callable[[list[int], int], None] | None = None, verify: str = "path",
                  tree_nodes: int = 32) -> GenerationResult:
    """Lossless speculative decoding of one sequence: greedy output equals the target's greedy output,
    sampled output has exactly the target's processed distribution (temperature → top-k → top-p).

    verify: "path" checks the selector's one path; "tree" checks a tree of at most `tree_nodes`
    draft nodes in one target pass (attention-only targets; the drafter needs `propose_tree`).

    target: an HF causal LM, or a TargetAdapter around one. input_ids: [1, T] or [T] long prompt.
    `rng` overrides `generator` (tests inject a source that enumerates every random branch).
    `on_commit(tokens, n_drafted)` is called as tokens are committed (streaming): the first
    `n_drafted` of them are accepted draft tokens, the rest come from the target itself.
    """
    params = SamplingParams(temperature, top_k, top_p)
    tgt = _adapt(drafter, target)
    prompt = _check_prompt(input_ids, tgt, max_new_tokens)
    stops = _check_stops(stop_token_ids, tgt.vocab_size)
    _check_verify(verify, tree_nodes, drafter, tgt)
    rng = rng or TorchRandom(generator)
    sync = _synchronizer(tgt.device)

    start = time.perf_counter()
    tokens = prompt[0].tolist()
    timings = dict(prefill_s=0.0, draft_s=0.0, verify_s=0.0)
    lengths: list[int] = []
    finish = "length"
    if max_new_tokens > 0:
        cache, draft_cache = tgt.new_cache(), drafter.new_cache()
        step = tgt.forward(prompt, cache, keep_logits=1)  # logits [1, 1, V] (the last position's), features [1, T, F]
        anchor = _choose(step.logits[0, -1], params, rng)
        tokens.append(anchor)
        new_features = step.features
        if on_commit:
            on_commit([anchor], 0)
        sync()
        timings["prefill_s"] = time.perf_counter() - start
        finish = "stop" if anchor in stops else "length"
        while finish != "stop" and len(tokens) - prompt.shape[1] < max_new_tokens:
            budget = max_new_tokens - (len(tokens) - prompt.shape[1])
            depth = min(budget - 1, drafter.block_size - 1)
            t0 = time.perf_counter()
            if verify == "tree":
                tree = drafter.propose_tree(draft_cache, anchor, new_features, tgt, tree_nodes, depth)
                sync()
                t1 = time.perf_counter()
                step = tgt.forward_tree(anchor, tree, cache)  # logits [1, M+1, V]
                found = verify_tree(tree, step.logits[0], params, rng)
                drafted, verdict = tree.tokens[found.path].tolist(), Verdict(len(found.path), found.next_token)
                rows = [0, *(node + 1 for node in found.path)]  # the anchor and the accepted path
            else:
                draft = drafter.propose(draft_cache, anchor, new_features, tgt, params.temperature, rng)
                draft = draft.truncate(depth)
                sync()
                t1 = time.perf_counter()
                block = torch.cat([torch.tensor([anchor], device=tgt.device), draft.tokens.to(tgt.device)])
                step = tgt.forward(block[None], cache)  # logits [1, L+1, V]
                verdict = verify_block(draft, step.logits[0], params, rng)
                drafted, rows = draft.tokens.tolist(), list(range(verdict.num_accepted + 1))
            committed, stopped = commit(drafted, verdict, budget, stops)
            tgt.keep(cache, step, rows)  # the anchor and the accepted drafts
            sync()
            timings["draft_s"] += t1 - t0
            timings["verify_s"] += time.perf_counter() - t1
            tokens += committed
            lengths.append(len(committed))
            if on_commit:
                on_commit(committed, min(verdict.num_accepted, len(committed)))
            anchor = committed[-1]
            new_features = None if step.features is None else step.features[:, rows]
            finish = "stop" if stopped else "length"
    sequences = torch.tensor([tokens], dtype=torch.long, device=prompt.device)
    return GenerationResult(sequences, prompt.shape[1], lengths, finish, total_s=time.perf_counter() - start,
                            **timings)


def ar_generate(target, input_ids: Tensor, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, stop_token_ids=None, generator: torch.Generator | None = None,
                rng: RandomSource | None = None,
                on_commit: Callable[[list[int], int], None] | None = None) -> GenerationResult:
    """Plain autoregressive decoding: the same loop with a drafter that drafts nothing."""
    return spec_generate(AutoregressiveDrafter(), target, input_ids, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
                         generator=generator, rng=rng, on_commit=on_commit)


def _choose(logits: Tensor, params: SamplingParams, rng: RandomSource) -> int:
    """One token from logits [V]: the AR step, shared with nothing else but the same p̃ as verify."""
    if params.greedy:
        return int(greedy_token(logits).item())
    return rng.categorical(process_logits(logits, params))


def _adapt(drafter: Drafter, target) -> TargetAdapter:
    """The target behind a TargetAdapter that reads the drafter's layers, once the pair is checked."""
    if not all(hasattr(drafter, name) for name in ("propose", "new_cache", "target_layer_ids")):
        swapped = " (are drafter and target swapped? the drafter comes first)" if hasattr(target, "propose") else ""
        raise TypeError(f"drafter must be a Drafter (propose, new_cache, target_layer_ids), "
                        f"got {type(drafter).__name__}{swapped}")
    tgt = target if isinstance(target, TargetAdapter) else TargetAdapter(target, drafter.target_layer_ids)
    if tgt.layer_ids != tuple(drafter.target_layer_ids):
        raise ValueError(f"the target adapter reads layers {tgt.layer_ids}, the drafter wants {drafter.target_layer_ids}")
    _check_pair(drafter, tgt)
    return tgt


def _check_pair(drafter: Drafter, tgt: TargetAdapter) -> None:
    if not isinstance(drafter.block_size, int) or drafter.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {drafter.block_size!r}")
    config = getattr(drafter, "config", None)
    if config is None:
        return
    for name, theirs in (("hidden_size", tgt.hidden_size), ("vocab_size", tgt.vocab_size),
                         ("num_target_layers", tgt.num_layers)):
        ours = getattr(config, name)
        if ours != theirs:
            raise ValueError(f"drafter and target do not fit: drafter {name} = {ours}, target {name} = {theirs}")


def _check_prompt(input_ids, tgt: TargetAdapter, max_new_tokens) -> Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must have dtype torch.long, got {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T] (batch 1), got {list(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= tgt.vocab_size:
        raise ValueError(f"input_ids hold token ids outside the target vocabulary [0, {tgt.vocab_size})")
    limit = tgt.max_positions
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"target's {limit} positions (the maximum positions of its config)")
    return input_ids.to(tgt.device)


def _check_verify(verify: str, tree_nodes: int, drafter: Drafter, tgt: TargetAdapter) -> None:
    if verify not in ("path", "tree"):
        raise ValueError(f"verify must be 'path' or 'tree', got {verify!r}")
    if verify == "path":
        return
    if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
        raise ValueError(f"tree_nodes must be an integer >= 1, got {tree_nodes!r}")
    if not callable(getattr(drafter, "propose_tree", None)):
        raise ValueError(f"verify='tree' needs a drafter with propose_tree; {type(drafter).__name__} has none")
    if tgt.hybrid:
        raise ValueError("verify='tree' needs an attention-only target: this one has linear_attention layers, whose "
                         "single recurrent state cannot follow several branches; use verify='path'")


def _check_stops(stop_token_ids, vocab_size: int) -> frozenset[int]:
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    stops = frozenset(int(t) for t in stop_token_ids)
    bad = sorted(t for t in stops if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return stops


def _synchronizer(device: torch.device):
    """Timing on CUDA needs a sync at each boundary; on CPU it is a no-op."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
