"""Batched speculative decoding: N sequences at once, each accepting its own number of tokens.

    prefill the target on the left-padded prompts → each row's first token (its anchor)
    repeat while some row is alive:
        each alive row r drafts L_r tokens (its own drafter cache; one drafter pass for all rows
        when the drafter has `propose_batch`)
        one target pass over [R, W = 1 + max L_r]: row r's block sits at its own positions
        verify each row on its own → row r keeps n_r + 1 of its W new cache slots
        rows that hit a stop token or their budget leave the batch (and the cache)

The target cache is one [R, heads, S, head_dim] tensor per layer. Rows keep different numbers of
tokens, so a slot may be live in one row and dead in another: `valid` [R, S] records which slots are
live and `pos` [R, S] their positions; every pass gets a custom attention mask built from them
(causal by position, sliding windows by position). Columns dead in every row are dropped after each
round, so the waste is bounded by one block per row. Per row this is exactly `spec_generate`: the
same drafter calls, the same verifier, the same commit rule (tests/test_batch.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .loop import (AutoregressiveDrafter, Drafter, GenerationResult, _check_pair, _check_prompt, _check_stops,
                   _choose, _synchronizer)
from .rng import RandomSource, TorchRandom
from .sampling import SamplingParams
from .target import TargetAdapter
from .verify import commit, verify_block


def spec_generate_batch(drafter: Drafter, target, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                        max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        stop_token_ids=None, generator: torch.Generator | None = None,
                        rng: RandomSource | None = None) -> list[GenerationResult]:
    """Lossless speculative decoding of N left-padded prompts input_ids [N, T] (attention_mask [N, T],
    1 for real tokens; None means no padding). Returns one GenerationResult per row, its sequences
    [1, T_r + n_r] without padding; the timings are those of the whole batch."""
    params = SamplingParams(temperature, top_k, top_p)
    tgt = target if isinstance(target, TargetAdapter) else TargetAdapter(target, drafter.target_layer_ids)
    if tgt.layer_ids != tuple(drafter.target_layer_ids):
        raise ValueError(f"the target adapter reads layers {tgt.layer_ids}, the drafter wants {drafter.target_layer_ids}")
    if tgt.hybrid:
        raise ValueError("batched decoding needs an attention-only target: padded and ragged rows would leak into "
                         "linear_attention's recurrent state; decode the rows one at a time with spec_generate")
    _check_pair(drafter, tgt)
    prompts = _check_batch(input_ids, attention_mask, tgt, max_new_tokens)
    stops = _check_stops(stop_token_ids, tgt.vocab_size)
    rng = rng or TorchRandom(generator)
    sync = _synchronizer(tgt.device)
    N, B = len(prompts), drafter.block_size
    left = lambda r: max_new_tokens - (len(tokens[r]) - len(prompts[r]))  # noqa: E731  row r's remaining budget

    start = time.perf_counter()
    tokens = [p.tolist() for p in prompts]
    lengths: list[list[int]] = [[] for _ in range(N)]
    finish = ["length"] * N
    timings = dict(prefill_s=0.0, draft_s=0.0, verify_s=0.0)
    if max_new_tokens > 0:
        # left-padded prefill: slot j of row r holds position j - pad_r
        T = max(len(p) for p in prompts)
        ids = torch.zeros(N, T, dtype=torch.long)
        valid = torch.zeros(N, T, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, T - len(p):], valid[r, T - len(p):] = p.cpu(), True
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)  # [N, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        cache = tgt.new_cache()
        step = tgt.forward_masked(ids, pos, pos, valid[:, None, :] & causal, cache)  # logits [N, T, V]
        anchors = [_choose(step.logits[r, -1], params, rng) for r in range(N)]
        new_features = [None if step.features is None else step.features[r: r + 1, valid[r]] for r in range(N)]
        draft_caches = [drafter.new_cache() for _ in range(N)]
        for r in range(N):
            tokens[r].append(anchors[r])
            finish[r] = "stop" if anchors[r] in stops else "length"
        alive = [r for r in range(N) if finish[r] != "stop" and max_new_tokens > 1]
        keep_rows = torch.tensor(alive, dtype=torch.long)
        tgt.select_rows(cache, keep_rows)
        valid, pos = valid[keep_rows], pos[keep_rows]
        sync()
        timings["prefill_s"] = time.perf_counter() - start
        while alive:
            t0 = time.perf_counter()
            args = ([draft_caches[r] for r in alive], [anchors[r] for r in alive], [new_features[r] for r in alive])
            if callable(getattr(drafter, "propose_batch", None)):  # every row in one drafter pass
                drafts = drafter.propose_batch(*args, tgt, params.temperature, rng)
            else:  # each row drafts from its own context, exactly as spec_generate does
                drafts = [drafter.propose(c, a, f, tgt, params.temperature, rng) for c, a, f in zip(*args)]
            drafts = [d.truncate(min(left(r) - 1, B - 1)) for r, d in zip(alive, drafts)]
            sync()
            t1 = time.perf_counter()
            W = 1 + max(d.tokens.shape[0] for d in drafts)
            R, S = len(alive), valid.shape[1]
            block = torch.zeros(R, W, dtype=torch.long)
            live = torch.zeros(R, W, dtype=torch.bool)  # [R, W] real (not padding) block slots
            for i, (r, d) in enumerate(zip(alive, drafts)):
                block[i, : d.tokens.shape[0] + 1] = torch.cat([torch.tensor([anchors[r]]), d.tokens.cpu()])
                live[i, : d.tokens.shape[0] + 1] = True
            q_pos = torch.tensor([len(tokens[r]) - 1 for r in alive])[:, None] + torch.arange(W)  # anchor at its position
            allowed = torch.cat([valid[:, None, :].expand(R, W, S),
                                 live[:, None, :] & torch.ones(W, W, dtype=torch.bool).tril()], dim=2)
            step = tgt.forward_masked(block, q_pos, torch.cat([pos, q_pos], dim=1), allowed, cache)  # [R, W, V]
            kept = torch.zeros(R, W, dtype=torch.bool)
            for i, (r, d) in enumerate(zip(alive, drafts)):
                L = d.tokens.shape[0]
                verdict = verify_block(d, step.logits[i, : L + 1], params, rng)
                committed, stopped = commit(d.tokens.tolist(), verdict, left(r), stops)
                tokens[r] += committed
                lengths[r].append(len(committed))
                kept[i, : verdict.num_accepted + 1] = True  # the anchor and the accepted drafts
                anchors[r] = committed[-1]
                new_features[r] = None if step.features is None else step.features[i: i + 1, : verdict.num_accepted + 1]
                if stopped:
                    finish[r] = "stop"
            valid, pos = torch.cat([valid, kept], dim=1), torch.cat([pos, q_pos], dim=1)
            columns = valid.any(0).nonzero()[:, 0]  # drop slots dead in every row
            still = [i for i, r in enumerate(alive) if finish[r] != "stop" and left(r) > 0]
            rows = torch.tensor(still, dtype=torch.long)
            tgt.keep_slots(cache, columns)
            tgt.select_rows(cache, rows)
            valid, pos = valid[rows][:, columns], pos[rows][:, columns]
            alive = [alive[i] for i in still]
            sync()
            timings["draft_s"] += t1 - t0
            timings["verify_s"] += time.perf_counter() - t1
    total = time.perf_counter() - start
    device = input_ids.device
    return [GenerationResult(torch.tensor([tokens[r]], dtype=torch.long, device=device), len(prompts[r]), lengths[r],
                             finish[r], total_s=total, **timings) for r in range(N)]


def ar_generate_batch(target, input_ids: Tensor, attention_mask: Tensor | None = None, *, max_new_tokens: int,
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_token_ids=None,
                      generator: torch.Generator | None = None, rng: RandomSource | None = None
                      ) -> list[GenerationResult]:
    """Batched plain AR decoding: the same loop with a drafter that drafts nothing."""
    return spec_generate_batch(AutoregressiveDrafter(), target, input_ids, attention_mask,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               stop_token_ids=stop_token_ids, generator=generator, rng=rng)


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
