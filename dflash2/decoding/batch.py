"""Batched speculative decoding: N sequences at once, each accepting its own number of tokens.

    repeat while some row is alive or waiting:
        admit waiting prompts while fewer than `concurrency` rows are in flight (continuous batching):
            prefill them left-padded → each newcomer's first token (its anchor)
        each alive row drafts L_r tokens (a path, or with verify="tree" a tree of L_r nodes); a policy
            may cut each width, or skip drafting for a plain step
        one target pass over [R, W = 1 + max L_r], each row's block at its own positions
        verify each row on its own → row r keeps n_r + 1 of its W new cache slots
        rows that hit a stop token or their budget leave the batch (and the cache)

The target cache is one [R, heads, S, head_dim] tensor per layer; `valid` [R, S] marks the live slots
and `pos` [R, S] their positions, from which every pass builds its attention mask. Columns dead in
every row are dropped once they are a quarter of the slots. Per row this is exactly `spec_generate`:
the same round (dflash2/decoding/round.py), drafter calls, verifier and commit rule (tests/decoding/test_batch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash2.decoding.checks import (adapt_target, apply_policy, check_batch, check_concurrency, check_policy, check_stops,
                                     check_verify)
from dflash2.interfaces import BatchDrafter, Drafter, VerifyPolicy
from dflash2.decoding.loop import AutoregressiveDrafter, GenerationResult
from dflash2.decoding.rng import RandomSource, TorchRandom, categorical_rows
from dflash2.decoding.round import Backlog, decide, first_token, propose_rows, synchronizer
from dflash2.decoding.sampling import SamplingParams, greedy_token, process_logits
from dflash2.targets.adapter import TargetAdapter, cat_rows_left_padded
from dflash2.decoding.tree import TokenTree
from dflash2.decoding.verify import Draft


@dataclass
class _Rows:
    """Every row's text and state; `alive` lists the rows in flight, alive[i] being row i of the
    target cache, of `valid` [R, S] (live slots) and `pos` [R, S] (their positions)."""

    prompts: list[Tensor]
    tokens: list[list[int]]
    max_new_tokens: int
    lengths: list[list[int]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    features: list[Backlog] = field(default_factory=list)  # per row: target features not yet drafted from
    draft_caches: list[object] = field(default_factory=list)
    alive: list[int] = field(default_factory=list)
    cache: object = None
    valid: Tensor | None = None
    pos: Tensor | None = None

    def left(self, r: int) -> int:
        """Row r's remaining budget."""
        return self.max_new_tokens - (len(self.tokens[r]) - len(self.prompts[r]))


def spec_generate_batch(drafter: Drafter, target, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                        max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        stop_token_ids=None, generator: torch.Generator | None = None,
                        rng: RandomSource | None = None, concurrency: int | None = None, verify: str = "path",
                        tree_nodes: int = 15, policy: VerifyPolicy | None = None) -> list[GenerationResult]:
    """Lossless speculative decoding of N left-padded prompts input_ids [N, T] (attention_mask [N, T],
    1 for real tokens; None means no padding). Returns one GenerationResult per row, its sequences
    [1, T_r + n_r] without padding; the timings are those of the whole batch.

    concurrency: at most this many rows in flight (None: all N). When a row finishes, the next waiting
    prompt is prefilled and joins the running batch (continuous batching, as serving engines run).
    verify: "path" or "tree" (each row verifies a token tree of at most `tree_nodes` nodes), and
    `policy` (how many drafted tokens of each row to verify), as in `spec_generate`."""
    params = SamplingParams(temperature, top_k, top_p)
    tgt = adapt_target(drafter, target)
    check_verify(verify, tree_nodes, drafter, tgt)
    check_policy(policy)
    if tgt.hybrid:
        raise ValueError("batched decoding needs an attention-only target: padded and ragged rows would leak into "
                         "linear_attention's recurrent state; decode the rows one at a time with spec_generate")
    prompts = check_batch(input_ids, attention_mask, tgt, max_new_tokens)
    check_concurrency(concurrency)
    stops = check_stops(stop_token_ids, tgt.vocab_size)
    rng = rng or TorchRandom(generator)
    sync = synchronizer(tgt.device)
    N = len(prompts)
    rows = _Rows(prompts, [p.tolist() for p in prompts], max_new_tokens, [[] for _ in range(N)], ["length"] * N,
                 [0] * N, [Backlog() for _ in range(N)], [None] * N)
    # a BatchDrafter drafts every row in one pass over the rows' shared context, whose rows follow
    # `alive` (as the target cache's do); another drafter keeps one cache per row
    context = drafter.new_context_batch() if isinstance(drafter, BatchDrafter) else None
    waiting = list(range(N)) if max_new_tokens > 0 else []  # rows not yet admitted, in order
    timings = dict(prefill_s=0.0, draft_s=0.0, verify_s=0.0)
    empty = Draft(torch.zeros(0, dtype=torch.long, device=tgt.device))  # a row's draft in a round not drafted
    start = time.perf_counter()
    while waiting or rows.alive:
        t0 = time.perf_counter()
        if waiting and len(rows.alive) < (concurrency or N):  # prefill newcomers; they join the batch
            count = (concurrency or N) - len(rows.alive)
            _admit(rows, waiting[:count], drafter, tgt, context, params, rng, stops)
            waiting = waiting[count:]
            sync()
            timings["prefill_s"] += time.perf_counter() - t0
            continue  # admit again if some newcomers finished at once
        alive = rows.alive
        depths = [min(rows.left(r) - 1, drafter.block_size - 1) for r in alive]
        # nothing to draft (plain decoding; every row's last token), or nothing pays: a plain step for every row
        skip = max(depths) == 0 or (policy is not None and not policy.drafts(len(alive)))
        if skip:
            drafts = [empty] * len(alive)
        else:
            drafted = propose_rows(drafter, context, [rows.draft_caches[r] for r in alive],
                                   [rows.anchors[r] for r in alive], [rows.features[r].take() for r in alive], tgt,
                                   params, rng, verify, tree_nodes, depths)
        sync()
        t1 = time.perf_counter()
        if not skip:
            drafts = apply_policy(policy, drafted, t1 - t0)  # each row's tokens to verify: a prefix of its draft
        kept = _verify_and_commit(rows, drafts, tgt, params, rng, stops)
        if policy is not None and not skip:
            for full, d, k in zip(drafted, drafts, kept):
                policy.observe(full, d.tokens.shape[0], k)
        _retire(rows, tgt, context)
        sync()
        timings["draft_s"] += t1 - t0
        timings["verify_s"] += time.perf_counter() - t1
    total = time.perf_counter() - start
    device = input_ids.device
    return [GenerationResult(torch.tensor([rows.tokens[r]], dtype=torch.long, device=device), len(prompts[r]),
                             rows.lengths[r], rows.finish[r], total_s=total, **timings) for r in range(N)]


PREFILL_PADDING = 1.25  # a prefill group's padded tokens at most this many times its prompts' tokens


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """The newcomers (their prompts' lengths) in groups prefilled together, left-padded to each group's
    longest: longest first, a group taking the next prompt while its padded size (rows × longest)
    stays within `padding` times its tokens; each group's indices ascending (newcomers of one group keep
    their order, and the cache its rows: nothing to move). One padded pass over prompts of mixed lengths
    spent up to half its work on padding (docs/architecture.md, "Performance choices")."""
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= padding * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return [sorted(g) for g in groups]


def _admit(rows: _Rows, newcomers: list[int], drafter: Drafter, tgt: TargetAdapter, context,
           params: SamplingParams, rng: RandomSource, stops: frozenset[int]) -> None:
    """Prefill the newcomers (left-padded, one pass), choose each one's first token, and append the
    rows that go on to the running batch: target cache, valid, pos, alive and the drafter context."""
    new_cache, new_valid, new_pos, logits, features, at = _prefill_grouped(tgt, [rows.prompts[r] for r in newcomers])
    joined = []
    for i, r in enumerate(newcomers):  # newcomer i is row at[i] of the prefilled cache
        rows.anchors[r], rows.features[r] = first_token(logits[at[i]], params, rng), Backlog(features[at[i]])
        rows.draft_caches[r] = None if context is not None else drafter.new_cache()
        rows.tokens[r].append(rows.anchors[r])
        if rows.anchors[r] in stops:
            rows.finish[r] = "stop"
        elif rows.max_new_tokens > 1:
            joined.append(i)
    keep = torch.tensor([at[i] for i in joined], dtype=torch.long)  # in the newcomers' order
    tgt.select_rows(new_cache, keep)
    if rows.alive:
        tgt.append_rows(rows.cache, new_cache)
        rows.valid = cat_rows_left_padded(rows.valid, new_valid[keep], slot_dim=1)  # as append_rows pads the cache
        rows.pos = cat_rows_left_padded(rows.pos, new_pos[keep], slot_dim=1)
    else:
        rows.cache, rows.valid, rows.pos = new_cache, new_valid[keep], new_pos[keep]
    rows.alive += [newcomers[i] for i in joined]
    if context is not None:
        context.add_rows(len(joined))


def _verify_and_commit(rows: _Rows, drafts: list, tgt: TargetAdapter, params: SamplingParams, rng: RandomSource,
                       stops: frozenset[int]) -> list[list[int]]:
    """One target pass over [R, W = 1 + max nodes]: row r's block at its own positions (a path is a
    chain; a tree's nodes at the anchor's position + depth, each seeing its ancestors); each row's
    Outcome; every row's kept slots appended to the cache, which grows by max_r(n_r + 1) slots.
    Returns each row's accepted draft tokens (a path: 0..a-1) or nodes (a tree: its accepted path)."""
    if all(d.tokens.shape[0] == 0 for d in drafts):
        return _plain_step(rows, tgt, params, rng, stops)
    alive = rows.alive
    trees = [d if isinstance(d, TokenTree) else TokenTree.chain(d.tokens.cpu()) for d in drafts]
    W = 1 + max(t.tokens.shape[0] for t in trees)
    R, S = len(alive), rows.valid.shape[1]
    block = torch.zeros(R, W, dtype=torch.long)
    depth = torch.arange(W).repeat(R, 1)  # [R, W] below the anchor (padding slots: their index)
    seen = torch.zeros(R, W, W, dtype=torch.bool)  # [R, W, W] the block slots each query sees
    for i, (r, t) in enumerate(zip(alive, trees)):
        n = t.tokens.shape[0] + 1
        block[i, :n] = torch.cat([torch.tensor([rows.anchors[r]]), t.tokens.cpu()])
        depth[i, :n], seen[i, :n, :n] = t.block()
    q_pos = torch.tensor([len(rows.tokens[r]) - 1 for r in alive])[:, None] + depth  # anchor at its position
    allowed = torch.cat([rows.valid[:, None, :].expand(R, W, S), seen], dim=2)  # padding queries see the context only
    step = tgt.forward_masked(block, q_pos, torch.cat([rows.pos, q_pos], dim=1), allowed, rows.cache)  # [R, W, V]
    kept = torch.zeros(R, W, dtype=torch.bool)
    accepted = []
    for i, (r, d, t) in enumerate(zip(alive, drafts, trees)):
        outcome = decide(d, step.logits[i, : t.tokens.shape[0] + 1], params, rng, rows.left(r), stops)
        accepted.append([slot - 1 for slot in outcome.kept[1:]])  # block slot s holds draft node s - 1
        rows.tokens[r] += outcome.committed
        rows.lengths[r].append(len(outcome.committed))
        kept[i, outcome.kept] = True
        rows.anchors[r] = outcome.committed[-1]
        if step.features is not None:  # the anchor's and the accepted tokens', after those the drafter has not read
            rows.features[r].add(step.features[i: i + 1, outcome.kept])
        if outcome.stopped:
            rows.finish[r] = "stop"
    # each row's kept slots move to the front of the block (in order) and the block is cropped after
    # the longest row's (a path: a crop only)
    order = torch.argsort((~kept).long(), dim=1, stable=True)[:, : int(kept.sum(1).max())]  # [R, n]
    tgt.keep_block(rows.cache, S, order)
    rows.valid = torch.cat([rows.valid, kept.gather(1, order)], dim=1)
    rows.pos = torch.cat([rows.pos, q_pos.gather(1, order)], dim=1)
    return accepted


def _plain_step(rows: _Rows, tgt: TargetAdapter, params: SamplingParams, rng: RandomSource,
                stops: frozenset[int]) -> list[list[int]]:
    """_verify_and_commit when every draft is empty (plain decoding, or a round the policy did not
    draft): one pass over every row's anchor [R, 1] and each row's next token, drawn as `decide` draws
    it for an empty draft (the argmax; or one draw from p̃, row by row), without its per-row block
    bookkeeping. Every row keeps its anchor's slot."""
    alive = rows.alive
    R, S = len(alive), rows.valid.shape[1]
    anchors = torch.tensor([rows.anchors[r] for r in alive])[:, None]  # [R, 1]
    q_pos = torch.tensor([len(rows.tokens[r]) - 1 for r in alive])[:, None]  # [R, 1]
    allowed = torch.cat([rows.valid[:, None, :], torch.ones(R, 1, 1, dtype=torch.bool)], dim=2)  # [R, 1, S + 1]
    step = tgt.forward_masked(anchors, q_pos, torch.cat([rows.pos, q_pos], dim=1), allowed, rows.cache)  # [R, 1, V]
    if params.greedy:
        chosen = greedy_token(step.logits[:, 0]).tolist()
    else:
        probs = process_logits(step.logits[:, 0], params)  # [R, V]
        chosen = categorical_rows(rng, probs)  # one draw per row, in row order
    for i, (r, token) in enumerate(zip(alive, chosen)):
        rows.tokens[r].append(token)
        rows.lengths[r].append(1)
        rows.anchors[r] = token
        if step.features is not None:
            rows.features[r].add(step.features, i)  # row i, cut out when a draft reads it
        if token in stops:
            rows.finish[r] = "stop"
    tgt.keep_block(rows.cache, S, torch.zeros(R, 1, dtype=torch.long))
    rows.valid = torch.cat([rows.valid, torch.ones(R, 1, dtype=torch.bool)], dim=1)
    rows.pos = torch.cat([rows.pos, q_pos], dim=1)
    return [[] for _ in alive]


def _retire(rows: _Rows, tgt: TargetAdapter, context) -> None:
    """Finished rows leave the batch (and the cache); slots dead in every row are dropped once they
    are a quarter of all (compacting copies the whole cache, so not every round)."""
    still = [i for i, r in enumerate(rows.alive) if rows.finish[r] != "stop" and rows.left(r) > 0]
    if len(still) < len(rows.alive):
        keep = torch.tensor(still, dtype=torch.long)
        tgt.select_rows(rows.cache, keep)
        rows.valid, rows.pos, rows.alive = rows.valid[keep], rows.pos[keep], [rows.alive[i] for i in still]
        if context is not None:
            context.select_rows(still)
    used = rows.valid.any(0)  # [S] slots live in some row
    if rows.alive and 4 * int((~used).sum()) > used.numel():
        columns = used.nonzero()[:, 0]
        tgt.keep_slots(rows.cache, columns)
        rows.valid, rows.pos = rows.valid[:, columns], rows.pos[:, columns]


def _prefill_grouped(tgt: TargetAdapter, prompts: list[Tensor]):
    """prefill_rows in `prefill_groups`, their caches joined (group after group) → as prefill_rows, and at[i]:
    the row of prompt i (a dict)."""
    groups = prefill_groups([len(p) for p in prompts])
    cache, valid, pos, logits, features = prefill_rows(tgt, [prompts[i] for i in groups[0]])
    for group in groups[1:]:
        c, v, p, lg, f = prefill_rows(tgt, [prompts[i] for i in group])
        tgt.append_rows(cache, c)
        valid, pos = cat_rows_left_padded(valid, v, slot_dim=1), cat_rows_left_padded(pos, p, slot_dim=1)
        logits, features = torch.cat([logits, lg]), features + f
    order = [i for group in groups for i in group]  # the prompt in each row
    at = {i: row for row, i in enumerate(order)}
    return cache, valid, pos, logits, features, at


def prefill_rows(tgt: TargetAdapter, prompts: list[Tensor]):
    """Left-padded prefill of n prompts in a new cache → cache, valid [n, T] (live slots), pos [n, T]
    (slot j of row r holds position j - pad_r), last logits [n, V], features per row ([1, T_r, F] or None)."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):], valid[r, T - len(p):] = p.cpu(), True
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    cache = tgt.new_cache()
    step = tgt.forward_masked(ids, pos, pos, valid[:, None, :] & torch.ones(T, T, dtype=torch.bool).tril(), cache,
                              keep_logits=1)  # left padding: column T-1 is every row's last prompt token
    features = [None if step.features is None else step.features[r: r + 1, valid[r]] for r in range(len(prompts))]
    return cache, valid, pos, step.logits[:, -1], features


def left_pad(prompts, pad: int = 0) -> tuple[Tensor, Tensor]:
    """Prompts of different lengths (lists of ids, or [T] / [1, T] tensors) → input_ids [N, T] and
    attention_mask [N, T], left-padded with `pad`: what spec_generate_batch takes."""
    rows = [p.reshape(-1).tolist() if isinstance(p, Tensor) else list(p) for p in prompts]
    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def ar_generate_batch(target, input_ids: Tensor, attention_mask: Tensor | None = None,
                      **options) -> list[GenerationResult]:
    """Batched plain AR decoding: spec_generate_batch with a drafter that drafts nothing (options: its
    max_new_tokens, temperature, top_k, top_p, stop_token_ids, generator, rng, concurrency)."""
    return spec_generate_batch(AutoregressiveDrafter(), target, input_ids, attention_mask, **options)
