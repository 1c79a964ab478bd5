"""A drafting round as one call (one graph when compiled): at batch 1 (`draft_round`, what `propose` and
`propose_tree` run) and for a batch of rows (`draft_round_batch`). `DraftingRounds` is a mixin of
`DFlash2Drafter`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2.compile import allow_recompiles, announce_compiling, compile_own, gemm_choice, inductor_gemm
from dflash2.drafter.backbone import ContextBatch, ContextCache
from dflash2.drafter.heads import Candidates, RoundContext
from dflash2.layers import as_rows
from dflash2.targets.adapter import TargetAdapter


class RoundScores(NamedTuple):
    """One drafting round. At batch 1 (`DFlash2Drafter.draft_round`): the grown context K/V (per layer
    [1, kv, C, hd]), the L draft positions' hidden states [L, H], their top-K candidates (ids, U
    [L, K]) and the selector's lattice scores (first [K], steps [L-1, K, K]; None when not asked); for a
    selector that reads the round's context, that context (a RoundContext). For R rows
    (`draft_round_batch`): keys and values None (the context stays in the ContextBatch), and every other
    field with a leading row dimension (hidden [R, L, H], candidates [R, L, K], first [R, K], steps
    [R, L-1, K, K])."""

    keys: list[Tensor]
    values: list[Tensor]
    hidden: Tensor
    cands: Candidates | None
    first: Tensor | None
    steps: Tensor | None
    context: RoundContext | None = None
ARCHITECTURE = "DFlash2Drafter"


class DraftingRounds:
    # -- one drafting round at batch 1 (propose, propose_tree): one call, one graph when compiled ------
    def compile(self, *args: Any, gemm: str = "auto", **kwargs: Any) -> None:
        """torch.compile the batch-1 drafting round in place (`draft_round`'s tensor work, `_round`):
        context projection, block pass, LM head, top-K and the lattice's scores run as one graph, one
        call per round. Arguments go to torch.compile; `dynamic=True` suits decoding, where the
        context grows every round. (`backbone.compile` compiles the block pass and the projection
        separately: two calls per round, and the batched path's passes.) `gemm` (dflash2.compile.gemm_choice):
        "inductor" (the default on CPU) freezes the drafter's weights, and the target's LM head it reads,
        into the graphs as constants: the graphs do not see later changes to them (compile after loading
        or training, and compile a copy per target)."""
        if args:
            raise TypeError("DFlash2Drafter.compile takes torch.compile's options as keywords")
        devices = {p.device for p in self.parameters()}
        gemm = gemm_choice(gemm, devices)  # (checked before anything changes)
        allow_recompiles(64)  # a graph per shape that specialises
        for device in devices:  # the rotary table as a decode finds it (a graph
            self.backbone.rotary.inverse_frequencies(device)     # traced before it is filled is traced again after)
        self._round = compile_own(self._round, **kwargs)
        self._round_batch = compile_own(self._round_batch, **kwargs)
        self._warmed, self._gemm = set(), gemm

    @property
    def warmed(self) -> frozenset | None:
        """The kinds of round compiled so far (None: not compiled): False and True for batch 1's rounds
        without and with the lattice (`warm_up`), ("batch", lattice) for the batched ones."""
        return None if self._warmed is None else frozenset(self._warmed)

    def warm_up(self, target: TargetAdapter, like: Tensor, lattice: bool) -> None:
        """Compile the round's graphs before the first real round, on scratch caches, so that no
        compilation lands inside a timed decode: a first round (no context yet) over several features
        and over one, later rounds over several and over one, after a context of one (a one-token
        prompt) too. Sizes 0 and 1 of the context and of the features compile apart; the sizes between
        are dynamic. like: features as the rounds will read them (their width, dtype and device).
        Nothing to do when not compiled (`compile`); the first round warms up by itself."""
        if self._warmed is None:
            return
        self._warmed.add(lattice)
        done = announce_compiling("the drafter's round")
        features = lambda n: torch.zeros(1, n, like.shape[-1], dtype=like.dtype, device=like.device)  # noqa: E731
        with inductor_gemm(self._gemm):
            for sizes in ((3, 2, 1), (1, 1), (1, 2)):  # the features each round reads, from an empty context on
                scratch = self.new_cache()
                for n in sizes:
                    self.draft_round(scratch, 0, features(n), target, lattice)
        done()

    def _warm_up_batch(self, target: TargetAdapter, like: Tensor, lattice: bool) -> None:
        """`warm_up` for the batched round, on scratch ContextBatches: at three rows and at one (a
        batch's last row), over contexts of one position and of several. like: a tensor of the real
        batch's context (its device and dtype)."""
        self._warmed.add(("batch", lattice))
        done = announce_compiling("the drafter's batched round")
        features = lambda n: torch.zeros(1, n, self.config.feature_size, dtype=like.dtype, device=like.device)  # noqa: E731
        with inductor_gemm(self._gemm):
            for rounds in (((1, 1, 1), (3, 2, 1), (1, 2, 1)), ((1,), (2,), (1,))):  # per round, each row's features
                scratch = self.new_context_batch()
                scratch.add_rows(len(rounds[0]))
                for sizes in rounds:
                    feats = [features(n) for n in sizes]
                    self.backbone.extend_batch(scratch, feats, self.config.block_size)
                    self.draft_round_batch(scratch, [0] * len(sizes), feats, target,
                                           self.config.num_draft_positions, lattice)
        done()

    def draft_round(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                    lattice: bool = True) -> "RoundScores":
        """Extend `cache` by new_features [1, n, F] (positions cache.length..), then score the block
        [anchor, MASK, ...] at the positions after them: RoundScores of its L = num_draft_positions
        draft positions (with the selector's lattice when `lattice`)."""
        B, device = self.config.block_size, new_features.device
        dtype = self.backbone.fc.weight.dtype
        if self._warmed is not None and lattice not in self._warmed:  # compiled, this kind not warmed up yet
            self.warm_up(target, new_features, lattice)
        if not cache.keys:  # the first round: no context yet
            empty = lambda: torch.zeros(1, self.config.num_key_value_heads, 0, self.config.head_dim,  # noqa: E731
                                        dtype=dtype, device=device)
            cache.keys, cache.values = [empty() for _ in self.backbone.layers], [empty() for _ in self.backbone.layers]
        start, n = cache.length, new_features.shape[1]
        window = self.config.context_keep
        kept = cache.keys[0].shape[2] + n  # the context entries the block sees: the kept ones and the new ones,
        kept = kept if window is None else min(kept, window)  # or the last `window` of them
        ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        length = start + n  # the block's first position
        s = self._round(cache.keys, cache.values, new_features.to(dtype), torch.arange(start, length, device=device),
                        self.embed_block(ids, target), torch.arange(length, length + B, device=device),
                        torch.arange(length - kept, length + B, device=device),  # the context it sees, the block
                        self.head_weights(target, dtype), torch.tensor(anchor, device=device), lattice)
        # contiguous, as eager's concatenation gives them (a compiled first round may hand back a view of the
        # projection): a layout that changes from round to round would be a graph per layout
        cache.keys, cache.values = [k.contiguous() for k in s.keys], [v.contiguous() for v in s.values]
        cache.length = length
        if s.cands is None:  # a head with its own forward, or a selector that reads the round's context
            cands, first, steps, ctx = self._outside_graph(s.hidden, anchor, lambda: new_features[0, -1], target,
                                                           lattice)
            return s._replace(cands=cands, first=first, steps=steps, context=ctx)
        return s

    def _round(self, keys: list[Tensor], values: list[Tensor], features: Tensor, feature_positions: Tensor,
               x: Tensor, positions: Tensor, key_positions: Tensor, head: tuple[Tensor, Tensor | None] | None,
               anchor: Tensor, lattice: bool) -> "RoundScores":
        """The tensor work of `draft_round` (what `compile` compiles). keys/values: per layer the kept
        context [1, kv, C, hd]; features [1, n, F] at feature_positions [n]; x [1, B, H] the embedded
        block at positions [B]; key_positions [C + n + B]; head: the LM head (weight, bias) in the
        drafter's dtype, or None; anchor [] long. Returns the context K/V the next round starts from
        (the last `config.context_keep` entries when the drafter's layers need no more)."""
        new = self.backbone.context_kv(features, feature_positions)
        keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(keys, new)]  # [1, kv, C + n, hd]
        values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(values, new)]
        window = self.config.context_keep  # the block sees, and the cache keeps, only the last `window` (0: none)
        if window is not None:
            keys, values = [k[:, :, k.shape[2] - min(k.shape[2], window):] for k in keys], \
                           [v[:, :, v.shape[2] - min(v.shape[2], window):] for v in values]
        L = self.config.num_draft_positions
        hidden = self.backbone(x, positions, list(zip(keys, values)), rows=L + 1, key_positions=key_positions)[0, 1:]
        if head is None or self.candidate_selector.reads_context:
            return RoundScores(keys, values, hidden, None, None, None)  # [L, H]
        ids, scores = self.candidates(self._finish_logits(F.linear(hidden, *head)))  # [L, K]
        cands = Candidates(ids if self.draft_vocab is None else self.draft_vocab[ids], scores)
        first, steps = self.candidate_selector.lattice(cands, hidden, anchor) if lattice else (None, None)
        return RoundScores(keys, values, hidden, cands, first, steps)

    # -- one drafting round of a batch (propose_batch, propose_tree_batch): one graph when compiled ---
    def draft_round_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor] | None,
                          target: TargetAdapter, L: int, lattice: bool = True) -> "RoundScores":
        """Score the blocks [anchors[r], MASK, ...] of R rows after their contexts in `context` (already
        extended): RoundScores of the first L draft positions (hidden [R, L, H], candidates [R, L, K],
        with `lattice` the selector's lattice: first [R, K], steps [R, L-1, K, K]); keys and values None
        (the context stays in the ContextBatch). Row r's block sits at positions lengths[r].. and sees its
        own context (its last `context_window` positions) and its whole block, within each layer's layout.
        With a selector that reads the round's context, its RoundContext (the rows' anchors' states from
        `new_features`, their last positions)."""
        if self._warmed is not None and ("batch", lattice) not in self._warmed:  # compiled, not warmed up yet
            self._warm_up_batch(target, context.keys[0], lattice)
        R, B, device = len(anchors), self.config.block_size, context.keys[0].device
        dtype = self.backbone.fc.weight.dtype
        ids = torch.full((R, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(anchors, device=device)
        s = self._round_batch(context.keys, context.values, self.embed_block(ids, target),
                              torch.tensor(context.lengths, device=device)[:, None],
                              torch.arange(max(context.lengths), device=device), self.head_weights(target, dtype),
                              ids[:, 0], lattice)
        if s.cands is None:  # a head with its own forward, or a selector that reads the round's context
            hidden = s.hidden[:, :L]
            cands, first, steps, ctx = self._outside_graph(
                hidden, ids[:, 0], lambda: torch.cat([f[0, -1:] for f in new_features]), target, lattice)  # last: [R, F]
            return RoundScores(None, None, hidden, cands, first, steps, ctx)
        return RoundScores(None, None, s.hidden[:, :L], Candidates(s.cands.ids[:, :L], s.cands.scores[:, :L]),
                           s.first, None if s.steps is None else s.steps[:, : L - 1])

    def _outside_graph(self, hidden: Tensor, anchors, last: Callable[[], Tensor], target: TargetAdapter,
                       lattice: bool) -> tuple[Candidates, Tensor | None, Tensor | None, RoundContext | None]:
        """A round's candidates and lattice outside its graph, where the graph stops at the hidden states (a
        candidate head with its own forward, or a selector that reads the round's context): hidden [L, H]
        (batch 1) or [R, L, H]; anchors as the selector takes them (an int, or [R]); last() the features of
        the position before each anchor ([F] or [R, F]), read only by a selector that reads the round's
        context → (candidates, first, steps, that RoundContext or None)."""
        if self.candidate_selector.reads_context:
            cands, log_z = self.draft_candidates(hidden, target, with_log_z=True)
            ctx = self.round_context(cands, log_z, last(), target)
        else:
            cands, ctx = self.draft_candidates(hidden, target), None
        first, steps = self.candidate_selector.lattice(cands, hidden, anchors, **self._reads(ctx)) if lattice \
            else (None, None)
        return cands, first, steps, ctx

    def _round_batch(self, keys: list[Tensor], values: list[Tensor], x: Tensor, lengths: Tensor, key_slots: Tensor,
                     head: tuple[Tensor, Tensor | None] | None, anchors: Tensor, lattice: bool) -> "RoundScores":
        """The tensor work of `draft_round_batch` (what `compile` compiles), for every draft position.
        keys/values: per layer the ContextBatch's buffers [R, kv, capacity, hd], row r's context in slots
        0 .. lengths[r]-1 (slot = position); x [R, B, H] the embedded blocks; lengths [R, 1]; key_slots
        [C] the slots 0 .. C-1 of the longest context; head as in `_round`; anchors [R].

        The block's K/V are concatenated after the first C slots rather than written into the buffers:
        a compiled graph that writes into its inputs copies them back whole after every layer."""
        R, B, _ = x.shape
        C = key_slots.shape[0]
        positions = lengths + torch.arange(B, device=x.device)  # [R, B]
        visible = key_slots < lengths  # [R, C]: its own context
        if self.config.context_window is not None:
            visible = visible & (key_slots >= lengths - self.config.context_window)
        mask = torch.cat([visible, visible.new_ones(R, B)], 1)[:, None, None, :].expand(R, 1, B, C + B)
        key_positions = torch.cat([key_slots.expand(R, C), positions], 1)  # [R, C + B]
        context = [(k[:, :, :C], v[:, :, :C]) for k, v in zip(keys, values)]  # [R, kv, C, hd]
        L = self.config.num_draft_positions
        hidden = self.backbone(x, positions, context, mask, rows=L + 1, key_positions=key_positions)[:, 1:]
        if head is None or self.candidate_selector.reads_context:
            return RoundScores(None, None, hidden, None, None, None)  # [R, L, H]
        logits = F.linear(as_rows(hidden), *head).view(R, L, -1)  # (as rows: a 3-d slice multiplies as a batch)
        ids, scores = self.candidates(self._finish_logits(logits))  # [R, L, K]
        cands = Candidates(ids if self.draft_vocab is None else self.draft_vocab[ids], scores)
        first, steps = self.candidate_selector.lattice(cands, hidden, anchors) if lattice else (None, None)
        return RoundScores(None, None, hidden, cands, first, steps)
