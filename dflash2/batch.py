"""Batched speculative decoding: N sequences at once, each accepting its own number of tokens.

    repeat while some row is alive or waiting:
        if fewer than `concurrency` rows are in flight: prefill the next waiting prompts (left-padded)
            → each newcomer's first token (its anchor); they join the batch (continuous batching)
        each alive row r drafts L_r tokens, or with verify="tree" a token tree of L_r nodes (one
        drafter pass for all rows over their shared ContextBatch when the drafter has
        `new_context_batch`; otherwise each row from its own drafter cache)
        one target pass over [R, W = 1 + max L_r]: row r's block sits at its own positions (a tree's
        nodes at the anchor's position + depth, each seeing its ancestors)
        verify each row on its own → row r keeps n_r + 1 of its W new cache slots (a tree: the
        anchor and the accepted path's slots, which need not be adjacent)
        rows that hit a stop token or their budget leave the batch (and the cache)

The target cache is one [R, heads, S, head_dim] tensor per layer. Rows keep different numbers of
tokens, so a slot may be live in one row and dead in another: `valid` [R, S] records which slots are
live and `pos` [R, S] their positions; every pass gets a custom attention mask built from them
(causal by position, sliding windows by position). Columns dead in every row are dropped once they
are a quarter of the slots (compacting copies the whole cache, so it is not done every round). Per row this is exactly `spec_generate`: the
same drafter calls, the same verifier, the same commit rule (tests/test_batch.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .loop import (AutoregressiveDrafter, Drafter, GenerationResult, _adapt, _check_prompt, _check_stops,
                   _check_verify, _choose, _synchronizer)
from .rng import RandomSource, TorchRandom
from .sampling import SamplingParams
from .target import TargetAdapter, cat_rows_left_padded
from .tree import TokenTree, verify_tree
from .verify import Verdict, commit, verify_block


def spec_generate_batch(drafter: Drafter, target, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                        max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        stop_token_ids=None, generator: torch.Generator | None = None,
                        rng: RandomSource | None = None, concurrency: int | None = None, verify: str = "path",
                        tree_nodes: int = 32) -> list[GenerationResult]:
    """Lossless speculative decoding of N left-padded prompts input_ids [N, T] (attention_mask [N, T],
    1 for real tokens; None means no padding). Returns one GenerationResult per row, its sequences
    [1, T_r + n_r] without padding; the timings are those of the whole batch.

    concurrency: at most this many rows in flight (None: all N). When a row finishes, the next waiting
    prompt is prefilled and joins the running batch (continuous batching, as serving engines run).
    verify: "path" or "tree" (each row verifies a token tree of at most `tree_nodes` nodes), as in
    `spec_generate`."""
    params = SamplingParams(temperature, top_k, top_p)
    tgt = _adapt(drafter, target)
    _check_verify(verify, tree_nodes, drafter, tgt)
    if tgt.hybrid:
        raise ValueError("batched decoding needs an attention-only target: padded and ragged rows would leak into "
                         "linear_attention's recurrent state; decode the rows one at a time with spec_generate")
    prompts = _check_batch(input_ids, attention_mask, tgt, max_new_tokens)
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValueError(f"concurrency must be a positive int or None, got {concurrency!r}")
    stops = _check_stops(stop_token_ids, tgt.vocab_size)
    rng = rng or TorchRandom(generator)
    sync = _synchronizer(tgt.device)
    N, B = len(prompts), drafter.block_size
    limit = concurrency or N
    left = lambda r: max_new_tokens - (len(tokens[r]) - len(prompts[r]))  # noqa: E731  row r's remaining budget

    start = time.perf_counter()
    tokens = [p.tolist() for p in prompts]
    lengths: list[list[int]] = [[] for _ in range(N)]
    finish = ["length"] * N
    timings = dict(prefill_s=0.0, draft_s=0.0, verify_s=0.0)
    anchors, new_features, draft_caches = [0] * N, [None] * N, [None] * N
    # a drafter that drafts every row in one pass keeps the rows' context in one ContextBatch, whose
    # rows follow `alive` (as the target cache's do); others keep one cache per row
    batched = callable(getattr(drafter, "new_context_batch", None))
    context = drafter.new_context_batch() if batched else None
    waiting = list(range(N)) if max_new_tokens > 0 else []  # rows not yet admitted, in order
    alive: list[int] = []  # rows in flight; alive[i] is row i of the target cache, valid and pos
    cache, valid, pos = None, None, None  # the running batch: target cache, live slots [R, S], positions [R, S]
    while waiting or alive:
        t0 = time.perf_counter()
        if waiting and len(alive) < limit:  # admit newcomers: prefill them and join the batch
            newcomers, waiting = waiting[: limit - len(alive)], waiting[limit - len(alive):]
            new_cache, new_valid, new_pos, logits, features = _prefill(tgt, [prompts[r] for r in newcomers])
            joined = []
            for i, r in enumerate(newcomers):
                anchors[r], new_features[r] = _choose(logits[i], params, rng), features[i]
                draft_caches[r] = None if batched else drafter.new_cache()
                tokens[r].append(anchors[r])
                if anchors[r] in stops:
                    finish[r] = "stop"
                elif max_new_tokens > 1:
                    joined.append(i)
            rows = torch.tensor(joined, dtype=torch.long)
            tgt.select_rows(new_cache, rows)
            if alive:
                tgt.append_rows(cache, new_cache)
                valid = cat_rows_left_padded(valid, new_valid[rows], slot_dim=1)  # as append_rows pads the cache
                pos = cat_rows_left_padded(pos, new_pos[rows], slot_dim=1)
            else:
                cache, valid, pos = new_cache, new_valid[rows], new_pos[rows]
            alive += [newcomers[i] for i in joined]
            if batched:
                context.add_rows(len(joined))
            sync()
            timings["prefill_s"] += time.perf_counter() - t0
            continue  # admit again if some newcomers finished at once
        ids, feats = [anchors[r] for r in alive], [new_features[r] for r in alive]
        depths = [min(left(r) - 1, B - 1) for r in alive]
        if verify == "tree":  # a token tree per row: [anchor, nodes] in one pass, ancestors visible
            if batched:
                drafts = drafter.propose_tree_batch(context, ids, feats, tgt, tree_nodes, depths)
            else:
                drafts = [drafter.propose_tree(draft_caches[r], a, f, tgt, tree_nodes, d)
                          for r, a, f, d in zip(alive, ids, feats, depths)]
            trees = drafts
        else:  # a path per row: a chain
            if batched:  # every row in one drafter pass
                drafts = drafter.propose_batch(context, ids, feats, tgt, params.temperature, rng)
            else:  # each row drafts from its own context, exactly as spec_generate does
                drafts = [drafter.propose(draft_caches[r], a, f, tgt, params.temperature, rng)
                          for r, a, f in zip(alive, ids, feats)]
            drafts = [d.truncate(depth) for d, depth in zip(drafts, depths)]
            trees = [TokenTree.chain(d.tokens.cpu()) for d in drafts]
        sync()
        t1 = time.perf_counter()
        W = 1 + max(t.tokens.shape[0] for t in trees)
        R, S = len(alive), valid.shape[1]
        block = torch.zeros(R, W, dtype=torch.long)
        depth = torch.arange(W).repeat(R, 1)  # [R, W] below the anchor (padding slots: their index)
        seen = torch.zeros(R, W, W, dtype=torch.bool)  # [R, W, W] the block slots each query sees
        for i, (r, t) in enumerate(zip(alive, trees)):
            n = t.tokens.shape[0] + 1
            block[i, :n] = torch.cat([torch.tensor([anchors[r]]), t.tokens.cpu()])
            depth[i, :n], seen[i, :n, :n] = t.block()
        q_pos = torch.tensor([len(tokens[r]) - 1 for r in alive])[:, None] + depth  # anchor at its position
        allowed = torch.cat([valid[:, None, :].expand(R, W, S), seen], dim=2)  # padding queries see the context only
        step = tgt.forward_masked(block, q_pos, torch.cat([pos, q_pos], dim=1), allowed, cache)  # [R, W, V]
        kept = torch.zeros(R, W, dtype=torch.bool)
        for i, (r, d, t) in enumerate(zip(alive, drafts, trees)):
            logits = step.logits[i, : t.tokens.shape[0] + 1]
            if verify == "tree":
                found = verify_tree(t, logits, params, rng)
                drafted, verdict = t.tokens[found.path].tolist(), Verdict(len(found.path), found.next_token)
                rows = [0, *(node + 1 for node in found.path)]  # the anchor and the accepted path
            else:
                verdict = verify_block(d, logits, params, rng)
                drafted, rows = d.tokens.tolist(), list(range(verdict.num_accepted + 1))
            committed, stopped = commit(drafted, verdict, left(r), stops)
            tokens[r] += committed
            lengths[r].append(len(committed))
            kept[i, rows] = True
            anchors[r] = committed[-1]
            new_features[r] = None if step.features is None else step.features[i: i + 1, rows]
            if stopped:
                finish[r] = "stop"
        # each row's kept slots move to the front of the block (in order) and the block is cropped after
        # the longest row's: the cache grows by max_r(n_r + 1) slots a round, not W (a path: a crop only)
        order = torch.argsort((~kept).long(), dim=1, stable=True)[:, : int(kept.sum(1).max())]  # [R, n]
        tgt.keep_block(cache, S, order)
        valid, pos = torch.cat([valid, kept.gather(1, order)], dim=1), torch.cat([pos, q_pos.gather(1, order)], dim=1)
        still = [i for i, r in enumerate(alive) if finish[r] != "stop" and left(r) > 0]
        if len(still) < R:  # finished rows leave the batch (and the cache)
            rows = torch.tensor(still, dtype=torch.long)
            tgt.select_rows(cache, rows)
            valid, pos, alive = valid[rows], pos[rows], [alive[i] for i in still]
            if batched:
                context.select_rows(still)
        used = valid.any(0)  # [S + W] slots live in some row
        if alive and 4 * int((~used).sum()) > used.numel():  # compact once a quarter of the slots are dead
            columns = used.nonzero()[:, 0]
            tgt.keep_slots(cache, columns)
            valid, pos = valid[:, columns], pos[:, columns]
        sync()
        timings["draft_s"] += t1 - t0
        timings["verify_s"] += time.perf_counter() - t1
    total = time.perf_counter() - start
    device = input_ids.device
    return [GenerationResult(torch.tensor([tokens[r]], dtype=torch.long, device=device), len(prompts[r]), lengths[r],
                             finish[r], total_s=total, **timings) for r in range(N)]


def _prefill(tgt: TargetAdapter, prompts: list[Tensor]):
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


def ar_generate_batch(target, input_ids: Tensor, attention_mask: Tensor | None = None, *, max_new_tokens: int,
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_token_ids=None,
                      generator: torch.Generator | None = None, rng: RandomSource | None = None,
                      concurrency: int | None = None) -> list[GenerationResult]:
    """Batched plain AR decoding: the same loop with a drafter that drafts nothing."""
    return spec_generate_batch(AutoregressiveDrafter(), target, input_ids, attention_mask,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               stop_token_ids=stop_token_ids, generator=generator, rng=rng, concurrency=concurrency)


def _check_batch(input_ids, attention_mask, tgt: TargetAdapter, max_new_tokens) -> list[Tensor]:
    """The rows' prompts without padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a torch.LongTensor of shape [N, T]")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids holds no rows")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids {list(input_ids.shape)}")
    mask = attention_mask.bool().cpu()
    if (mask[:, 1:].long() < mask[:, :-1].long()).any():
        raise ValueError("attention_mask must be left padding: zeros, then ones, in every row")
    if not mask[:, -1].all():
        raise ValueError("every row needs at least one prompt token")
    # each row's own prompt checks: dtype, vocabulary, budget, maximum positions
    return [_check_prompt(row[m], tgt, max_new_tokens)[0] for row, m in zip(input_ids.cpu(), mask)]
