"""The generation loop: speculative decoding with any drafter, and plain AR as a block-size-1 drafter.

    prefill the target on the prompt → first token (the anchor)
    repeat until the budget or a stop token:
        draft   = drafter.propose(context cache, anchor, new target features)       L ≤ B-1 tokens
        logits  = target.forward([anchor, draft])                                   [L+1, V]
        verdict = verify_block(draft, logits)                  accepted prefix + correction/bonus
        commit the accepted tokens and the next token; crop the target cache to the committed
        length; the verified positions' features become the drafter's new context

With verify="tree" the drafter proposes a token tree, the target scores every node in one pass under a
tree mask, `verify_tree` walks down it, and the cache keeps the anchor and the accepted path. With a
`policy` (dflash2.policy) the round first asks whether to draft at all, then cuts the draft to the
width the policy picks, through `SealedDrafts`, before the target pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from dflash2.decoding.checks import adapt_target, apply_policy, check_policy, check_prompt, check_stops, check_verify
from dflash2.interfaces import Drafter, VerifyPolicy
from dflash2.decoding.rng import RandomSource, TorchRandom
from dflash2.decoding.round import Backlog, decide, first_token, propose_rows, synchronizer
from dflash2.decoding.sampling import SamplingParams
from dflash2.decoding.tree import TokenTree
from dflash2.decoding.verify import Draft


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
                  tree_nodes: int = 15, policy: VerifyPolicy | None = None) -> GenerationResult:
    """Lossless speculative decoding of one sequence: greedy output equals the target's greedy output,
    sampled output has exactly the target's processed distribution (temperature → top-k → top-p).

    verify: "path" checks the selector's one path; "tree" checks a tree of at most `tree_nodes`
    draft nodes in one target pass (attention-only targets; the drafter needs `propose_tree`).

    target: an HF causal LM, or a TargetAdapter around one. input_ids: [1, T] or [T] long prompt.
    `rng` overrides `generator` (tests inject a source that enumerates every random branch).
    `on_commit(tokens, n_drafted)` is called as tokens are committed (streaming): the first
    `n_drafted` of them are accepted draft tokens, the rest come from the target itself.
    `policy`: how many of each round's drafted tokens (tree nodes) to verify (dflash2.policy);
    None verifies them all.
    """
    params = SamplingParams(temperature, top_k, top_p)
    tgt = adapt_target(drafter, target)
    prompt = check_prompt(input_ids, tgt, max_new_tokens)
    stops = check_stops(stop_token_ids, tgt.vocab_size)
    check_verify(verify, tree_nodes, drafter, tgt)
    check_policy(policy)
    rng = rng or TorchRandom(generator)
    sync = synchronizer(tgt.device)

    start = time.perf_counter()
    tokens = prompt[0].tolist()
    timings = dict(prefill_s=0.0, draft_s=0.0, verify_s=0.0)
    lengths: list[int] = []
    finish = "length"
    if max_new_tokens > 0:
        cache, draft_cache = tgt.new_cache(), drafter.new_cache()
        step = tgt.forward(prompt, cache, keep_logits=1)  # logits [1, 1, V] (the last position's), features [1, T, F]
        anchor = first_token(step.logits[0, -1], params, rng)
        tokens.append(anchor)
        pending = Backlog(step.features)  # target features the drafter has not read yet
        none = torch.zeros(0, dtype=torch.long, device=tgt.device)
        empty = Draft(none)  # a round the policy does not draft: a plain step (a path's, also when verifying trees)
        first = True  # no round has drafted yet
        if on_commit:
            on_commit([anchor], 0)
        sync()
        timings["prefill_s"] = time.perf_counter() - start
        finish = "stop" if anchor in stops else "length"
        while finish != "stop" and len(tokens) - prompt.shape[1] < max_new_tokens:
            budget = max_new_tokens - (len(tokens) - prompt.shape[1])
            t0 = time.perf_counter()
            depth = min(budget - 1, drafter.block_size - 1)  # the deepest draft that can commit
            skip = depth == 0 or (policy is not None and not policy.drafts(1))  # nothing to draft, or nothing pays
            if skip:  # a plain step
                draft = empty
            else:
                [drafted] = propose_rows(drafter, None, [draft_cache], [anchor], [pending.take()], tgt, params, rng,
                                         verify, tree_nodes, [depth])
            sync()
            t1 = time.perf_counter()
            if not skip:
                # the tokens to verify, a prefix of the draft (the first round's drafting also read the prompt)
                [draft] = apply_policy(policy, [drafted], None if first else t1 - t0)
                first = False
            if verify == "tree" and not skip:
                step = tgt.forward_tree(anchor, draft, cache)  # logits [1, M+1, V], M nodes
            else:
                block = torch.cat([torch.tensor([anchor], device=tgt.device), draft.tokens.to(tgt.device)])
                step = tgt.forward(block[None], cache)  # logits [1, L+1, V]
            outcome = decide(draft, step.logits[0], params, rng, budget, stops)
            if policy is not None and not skip:
                policy.observe(drafted, draft.tokens.shape[0], [i - 1 for i in outcome.kept[1:]])  # accepted ones
            tgt.keep(cache, step, outcome.kept)  # the anchor and the accepted drafts
            sync()
            timings["draft_s"] += t1 - t0
            timings["verify_s"] += time.perf_counter() - t1
            tokens += outcome.committed
            lengths.append(len(outcome.committed))
            if on_commit:
                on_commit(outcome.committed, outcome.drafted)
            anchor = outcome.committed[-1]
            if step.features is not None:  # the anchor's and the accepted tokens' features (a plain step's: all)
                pending.add(step.features if skip else step.features[:, outcome.kept])
            finish = "stop" if outcome.stopped else "length"
    sequences = torch.tensor([tokens], dtype=torch.long, device=prompt.device)
    return GenerationResult(sequences, prompt.shape[1], lengths, finish, total_s=time.perf_counter() - start,
                            **timings)


def ar_generate(target, input_ids: Tensor, **options) -> GenerationResult:
    """Plain autoregressive decoding: spec_generate with a drafter that drafts nothing (options: its
    max_new_tokens, temperature, top_k, top_p, stop_token_ids, generator, rng, on_commit)."""
    return spec_generate(AutoregressiveDrafter(), target, input_ids, **options)
