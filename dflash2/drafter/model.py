"""The DFlash-2 drafter: backbone + candidate head + path selector.

One round of drafting (batch 1 at inference):

    new target features [1, n, F] ──extend_context──► ContextCache (per-layer K/V, kept across rounds)
    [anchor, MASK × (B-1)] ──target embedding──► [1, B, H] ──backbone──► hidden [1, B, H]
    hidden[:, 1:] ──target LM head──► logits [1, L, V] ──CandidateHead──► ids, U [L, K]
        (with a draft vocabulary, the head's rows of those V' ids only: logits [1, L, V'])
    (ids, U, hidden[1:], anchor) ──selector──► Draft(tokens [L], q or None)

The drafter holds no embedding or LM head: it borrows the target's (frozen), through the adapter;
unless its config gives it its own (`own_embedding`, `own_lm_head`: a published checkpoint that ships
`embed_tokens` / `lm_head`, which it must when its width differs from the target's, `target_hidden_size`).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.drafter.backbone import BlockDiffusionBackbone, ContextBatch, ContextCache
from dflash2.config import DFlash2Config
from dflash2.drafter.heads import CandidateHead, Candidates, RoundContext
from dflash2.decoding.rng import RandomSource
from dflash2.drafter.files import DrafterFiles
from dflash2.drafter.rounds import DraftingRounds
from dflash2.drafter.selectors.codebook import build_selector
from dflash2.targets.adapter import TargetAdapter
from dflash2.decoding.tree import TokenTree, best_first_tree
from dflash2.decoding.verify import Draft


class DFlash2Drafter(DrafterFiles, DraftingRounds, nn.Module):
    """The drafter (module docstring); its checkpoints and copies: `DrafterFiles`; its drafting rounds, compiled
    or not: `DraftingRounds`."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = BlockDiffusionBackbone(config)
        self.candidates = CandidateHead(config.selector_top_k)
        self.candidate_selector = build_selector(config)
        self._warmed: set | None = None  # compiled: the kinds of round warmed up so far (lattice or not; batched)
        n = config.draft_vocab_size  # the token ids the LM head drafts among (None: all of them)
        self.register_buffer("draft_vocab", None if n is None else torch.arange(n))
        # the drafter's own embedding and LM head (a checkpoint that ships them, e.g. one narrower than its
        # target); None: it reads the target's
        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = nn.Embedding(V, H) if config.own_embedding else None
        self.lm_head = nn.Linear(H, V, bias=False) if config.own_lm_head else None

    # -- dflash2.interfaces: Drafter, TreeDrafter, BatchDrafter, CheckedDrafter --------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    def check_target(self, target: TargetAdapter) -> None:
        """The target must have the hidden size (the drafter's target_hidden_size, else its own),
        vocabulary and number of layers this drafter was built for."""
        c = self.config
        width = ("target_hidden_size", c.target_hidden_size) if c.target_hidden_size is not None else \
            ("hidden_size", c.hidden_size)
        for (name, ours), theirs in ((width, target.hidden_size), (("vocab_size", c.vocab_size), target.vocab_size),
                                     (("num_target_layers", c.num_target_layers), target.num_layers)):
            if ours != theirs:
                raise ValueError(f"drafter and target do not fit: drafter {name} = {ours}, target "
                                 f"{name.removeprefix('target_')} = {theirs}")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def new_cache(self) -> ContextCache:
        return ContextCache()

    def new_context_batch(self) -> ContextBatch:
        """The context of a batch of rows for `propose_batch` / `propose_tree_batch` (no rows yet)."""
        return ContextBatch()

    @torch.no_grad()
    def propose(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                temperature: float, rng: RandomSource) -> Draft:
        """Extend the context by new_features [1, n, F] (positions cache.length..), then draft the
        block that starts with `anchor` at position cache.length. Returns L = B - 1 draft tokens
        (config.draft_len if set)."""
        if self.config.block_size == 1:
            self.backbone.extend_context(cache, new_features)
            return Draft(torch.zeros(0, dtype=torch.long, device=new_features.device))
        s = self.draft_round(cache, anchor, new_features, target, lattice=False)
        return self.candidate_selector(s.cands, s.hidden, anchor, temperature, rng, **self._reads(s.context))

    @torch.no_grad()
    def propose_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor],
                      target: TargetAdapter, temperature: float, rng: RandomSource) -> list[Draft]:
        """Row r as `propose(row r's cache, anchors[r], new_features[r], ...)`, every row in one
        backbone pass over the rows' shared context (a ContextBatch, its padding masked)."""
        L = self.config.num_draft_positions if self.config.block_size > 1 else 0
        self.backbone.extend_batch(context, new_features, self.config.block_size)
        if L == 0:
            return [Draft(torch.zeros(0, dtype=torch.long, device=f.device)) for f in new_features]
        s = self.draft_round_batch(context, anchors, new_features, target, L, lattice=False)
        selector = self.candidate_selector
        if temperature == 0:  # deterministic: all rows at once
            return selector.select_batch(s.cands, s.hidden, anchors, **self._reads(s.context))
        ctx = s.context
        return [selector(Candidates(s.cands.ids[r], s.cands.scores[r]), s.hidden[r], anchors[r], temperature, rng,
                         **self._reads(None if ctx is None else RoundContext(*(t[r] for t in ctx))))
                for r in range(len(anchors))]

    @torch.no_grad()
    def propose_tree(self, cache: ContextCache, anchor: int, new_features: Tensor, target: TargetAdapter,
                     max_nodes: int, max_depth: int) -> TokenTree:
        """Like `propose`, but returns the `max_nodes` most probable nodes of the B×K lattice (depth
        <= max_depth) as a token tree for `verify="tree"`. Deterministic at every temperature: the
        tree verifier's one-decision-per-node rule handles sampling."""
        L = min(self.config.num_draft_positions, max_depth, max_nodes)  # M nodes reach depth M at most
        if self.config.block_size == 1 or L <= 0:
            self.backbone.extend_context(cache, new_features)
            return TokenTree.empty(new_features.device)
        s = self.draft_round(cache, anchor, new_features, target)
        return best_first_tree(s.cands.ids[:L], s.first, s.steps[: L - 1], max_nodes)

    @torch.no_grad()
    def propose_tree_batch(self, context: ContextBatch, anchors: list[int], new_features: list[Tensor],
                           target: TargetAdapter, max_nodes: int, max_depths: list[int]) -> list[TokenTree]:
        """Row r as `propose_tree(row r's cache, anchors[r], new_features[r], target, max_nodes,
        max_depths[r])`, every row in one backbone pass (as `propose_batch`)."""
        self.backbone.extend_batch(context, new_features, self.config.block_size)
        depths = [min(self.config.num_draft_positions, d, max_nodes) for d in max_depths]  # M nodes: depth <= M
        L = max(depths)
        if L <= 0:
            return [TokenTree.empty(f.device) for f in new_features]
        s = self.draft_round_batch(context, anchors, new_features, target, L)  # [R, L, K], [R, L-1, K, K]
        return [best_first_tree(s.cands.ids[r, :d], s.first[r], s.steps[r, : d - 1], max_nodes) if d > 0
                else TokenTree.empty(f.device) for r, (d, f) in enumerate(zip(depths, new_features))]

    def _candidates(self, cache: ContextCache, anchor: int, target: TargetAdapter, L: int) -> tuple[Tensor, Candidates]:
        """The first L draft positions of the block after `anchor`: hidden [L, H], candidates [L, K]."""
        hidden = self.block_hidden(cache, anchor, target, rows=L + 1)[0, 1:]  # [L, H]
        return hidden, self.draft_candidates(hidden, target)  # ids, U: [L, K]

    def draft_candidates(self, hidden: Tensor, target: TargetAdapter, with_log_z: bool = False):
        """hidden [..., H] → the top-K candidates (ids, U [..., K]) of each position: over the whole
        vocabulary, or over the draft vocabulary (its logits [..., V'], ids mapped back to token ids).
        with_log_z: (candidates, log Σ exp of each position's logits [...], float32)."""
        if with_log_z:
            if self.draft_vocab is not None:
                raise ValueError("the candidates' log-probabilities need the whole vocabulary: no draft vocabulary")
            logits = self.draft_logits(hidden, target)
            return self.candidates(logits), logits.float().logsumexp(-1)
        if self.draft_vocab is None:
            return self.candidates(self.draft_logits(hidden, target))
        ids, scores = self.candidates(self.draft_logits(hidden, target, vocab=self.draft_vocab))
        return Candidates(self.draft_vocab[ids], scores)

    def round_context(self, cands: Candidates, log_z: Tensor, last_features: Tensor, target: TargetAdapter) -> RoundContext:
        """What a selector that reads the round's context gets: cands [..., L, K], log_z [..., L], the
        target features of the position before each anchor last_features [..., F] → RoundContext."""
        dtype = self.backbone.fc.weight.dtype
        return RoundContext(log_z, self.backbone.fuse(last_features.to(dtype)), target.embed(cands.ids).to(dtype))

    def _reads(self, context: RoundContext | None) -> dict[str, RoundContext]:
        """The keyword a selector that reads the round's context is called with (none for the others)."""
        return {"context": context} if self.candidate_selector.reads_context else {}

    def embed_block(self, block_ids: Tensor, target: TargetAdapter) -> Tensor:
        """block ids [...] → [..., H]: rows of the embedding matrix (the drafter's own, else the target's)
        × input_embedding_scale."""
        if self.embed_tokens is not None:
            x = F.embedding(block_ids, self.embed_tokens.weight)
        else:
            x = target.embed(block_ids).to(self.backbone.fc.weight.dtype)
        scale = self.config.input_embedding_scale
        return x if scale is None else x * scale

    def head_weights(self, target: TargetAdapter, dtype: torch.dtype) -> tuple[Tensor, Tensor | None] | None:
        """The LM head the draft logits come from, as (weight [V or V', H], bias or None) in `dtype` (the
        draft vocabulary's rows when there is one): the drafter's own, else the target's (None for a
        target head with its own forward, which only `draft_logits` runs)."""
        if self.lm_head is None:
            return target.head_weights(dtype, self.draft_vocab)
        weight = self.lm_head.weight if self.draft_vocab is None else self.lm_head.weight[self.draft_vocab]
        return weight.to(dtype), None

    def draft_logits(self, hidden: Tensor, target: TargetAdapter, vocab: Tensor | None = None) -> Tensor:
        """hidden [..., H] → logits [..., V] through the LM head (the drafter's own, else the target's; or
        [..., V'] of the token ids `vocab` [V'] only), then the reference's output multiplier and
        soft-capping when configured."""
        if self.lm_head is None:
            return self._finish_logits(target.lm_logits(hidden, vocab))
        weight = self.lm_head.weight if vocab is None else self.lm_head.weight[vocab]
        return self._finish_logits(F.linear(hidden, weight))

    def candidate_logits(self, hidden: Tensor, cand: Tensor, target: TargetAdapter) -> Tensor:
        """hidden [..., H], cand [..., K] token ids → [..., K]: the draft logits of those tokens only
        (equal to draft_logits(hidden).gather(-1, cand), without the [..., V] logits)."""
        if self.lm_head is None:
            return self._finish_logits(target.lm_logits_at(hidden, cand))
        return self._finish_logits(torch.einsum("...h,...kh->...k", hidden, F.embedding(cand, self.lm_head.weight)))

    def _finish_logits(self, logits: Tensor) -> Tensor:
        """The reference's output multiplier and soft-capping, when configured."""
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def block_hidden(self, cache: ContextCache, anchor: int, target: TargetAdapter, rows: int | None = None) -> Tensor:
        """Hidden states [1, B, H] of the block [anchor, MASK, ...] at positions cache.length.., or of
        its first `rows` positions only ([1, rows, H]; the same values, less work)."""
        B, device = self.config.block_size, cache.keys[0].device
        ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        positions = torch.arange(cache.length, cache.length + B, device=device)
        keys = torch.arange(cache.length - cache.keys[0].shape[2], cache.length + B, device=device)  # kept context, block
        x = self.embed_block(ids, target)  # [1, B, H]
        return self.backbone(x, positions, list(zip(cache.keys, cache.values)), rows=rows, key_positions=keys)
