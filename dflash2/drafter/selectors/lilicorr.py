"""LiLiCorr: a small transformer over the whole candidate lattice scores every transition
(`selector: lilicorr`; vLLM 0.32's `lilicorr.py`, from SGLang PR #37462; the same math, our own code).

Each of the L × K candidates becomes one token of a lattice sequence:

    x[t, k] = E(c[t, k]) P_tok + h_t P_pass + MLP(LayerNorm(f[t, k])) + slot_t + rank_k
        f = (log p, p, log p − log p_top1, k / (K − 1), [k = 0])      five candidate features
    x ← x + Attn(RMSNorm(x), bias) ;  x ← x + MLP(RMSNorm(x))          num_layers times, over all L·K tokens

With the anchor's state a = RMSNorm(P_ctx · s), each candidate gets outgoing and incoming unit vectors
from SiLU(W_x x + W_a a + W_× (x ⊙ a) + b), and transitions score λ⟨out, in⟩ (anchor → position 0,
t → t + 1). These replace the unaries: the walk of `dflash2.drafter.selectors.codebook` and the token
trees run over them unchanged. K must be a power of two <= 16 (as vLLM requires). It sits on either
backbone (conv none or two_tap) and trains by cross-entropy along the lattice's gold path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.config import DFlash2Config
from dflash2.drafter.heads import Candidates, RoundContext
from dflash2.registry import register_selector
from dflash2.decoding.rng import RandomSource
from dflash2.drafter.selectors.codebook import walk, walk_batch
from dflash2.decoding.verify import Draft

NUM_FEATURES = 5


class LatticeMLP(nn.Module):
    """down(SiLU(up(x))) with biases (vLLM's NemotronHMLP with hidden_act silu: not gated)."""

    def __init__(self, width: int, hidden: int, out: int | None = None) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, width if out is None else out, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Full attention over the lattice tokens with an additive per-head bias (no cache, no mask)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.out_proj = nn.Linear(width, width, bias=True)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """x [R, M, h], bias [heads, M, M] → [R, M, h]."""
        R, M, h = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(R, M, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)[None])
        return self.out_proj(out.transpose(1, 2).reshape(R, M, h))


class LatticeLayer(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = LatticeMLP(width, int(width * mlp_ratio))

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrSelector(nn.Module):
    trains_on_candidates = True  # trained along the gold path of its lattice (it has no edge_scores)
    reads_context = True  # reads the candidates' log-probs and embeddings and the anchor's state

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        H, B, K = config.hidden_size, config.block_size, config.selector_top_k
        h = config.lilicorr_hidden_size or H
        heads, eps = config.lilicorr_num_heads, config.rms_norm_eps
        self.block_size, self.top_k, self.width = B, K, h
        self.vector_eps, self.logit_scale = config.lilicorr_vector_eps, config.lilicorr_logit_scale
        slots = B - 1
        self.token_proj = nn.Identity() if h == H else nn.Linear(H, h, bias=True)
        self.pass_hidden_proj = nn.Linear(H, h, bias=True)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, h, out=h)
        self.slot_embedding = nn.Parameter(torch.randn(1, 1, slots, 1, h) * 0.02)
        self.rank_embedding = nn.Parameter(torch.randn(1, 1, 1, K, h) * 0.02)
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * B - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(H, h, bias=True)
        self.layers = nn.ModuleList(LatticeLayer(h, heads, config.lilicorr_mlp_ratio, eps)
                                    for _ in range(config.lilicorr_num_layers))
        self.output_norm = nn.RMSNorm(h, eps=eps)
        self.anchor_norm = nn.RMSNorm(h, eps=eps)
        self.factor_input_proj = nn.Linear(3 * h, h, bias=True)
        r = config.lilicorr_factor_dim
        self.out_head = nn.Linear(h, r, bias=True)
        self.in_head = nn.Linear(h, r, bias=True)
        self.anchor_out_head = nn.Linear(h, r, bias=True)

    def attention_bias(self, slots: int) -> Tensor:
        """[heads, slots·K, slots·K]: the learned relative-slot bias between lattice tokens (the trained
        offset B − 1 is kept when fewer slots than B − 1 are scored)."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        return bias + (rel == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]

    def scores(self, cands: Candidates, hidden: Tensor, context: RoundContext) -> tuple[Tensor, Tensor]:
        """cands [..., L, K], hidden [..., L, H], context (log_z [..., L], anchor_state [..., H],
        embeddings [..., L, K, H]) → first [..., K], steps [..., L-1, K, K] (λ-scaled cosines)."""
        lead, (L, K) = cands.ids.shape[:-2], cands.ids.shape[-2:]
        if K != self.top_k or not 1 <= L <= self.block_size - 1:
            raise ValueError(f"LiLiCorr scores 1..{self.block_size - 1} positions of {self.top_k} candidates, got {L} × {K}")
        dtype = self.slot_embedding.dtype
        emb = context.embeddings.reshape(-1, L, K, context.embeddings.shape[-1]).to(dtype)
        hid = hidden.reshape(-1, L, hidden.shape[-1]).to(dtype)
        logp = (cands.scores.float() - context.log_z.float()[..., None]).reshape(-1, L, K)  # [R, L, K]
        rank = torch.arange(K, device=logp.device, dtype=torch.float32) / float(max(K - 1, 1))
        features = torch.stack([logp, logp.exp(), logp - logp.max(-1, keepdim=True).values,
                                rank.expand_as(logp), (rank == 0).float().expand_as(logp)], dim=-1)  # [R, L, K, 5]
        x = self.token_proj(emb) + self.pass_hidden_proj(hid)[..., None, :]
        x = x + self.feature_mlp(self.feature_norm(features.to(dtype)))
        x = x + self.slot_embedding[:, 0, :L] + self.rank_embedding[:, 0]  # [R, L, K, h]
        R = x.shape[0]
        x = x.reshape(R, L * K, self.width)
        bias = self.attention_bias(L)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(R, L, K, self.width)
        a = self.anchor_norm(self.context_proj(context.anchor_state.reshape(R, -1).to(dtype)))  # [R, h]
        w_x, w_a, w_cross = self.factor_input_proj.weight.split(self.width, dim=1)
        a_row = a[:, None, None, :]
        factor = F.silu(F.linear(x, w_x, self.factor_input_proj.bias) + F.linear(a_row, w_a) + F.linear(x * a_row, w_cross))
        out_vec = F.normalize(self.out_head(factor), dim=-1, eps=self.vector_eps)  # [R, L, K, r]
        in_vec = F.normalize(self.in_head(factor), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)  # [R, r]
        first = (anchor_out[:, None, :] * in_vec[:, 0]).sum(-1)  # [R, K]
        steps = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [R, L-1, K, K]
        first, steps = self.logit_scale * first.float(), self.logit_scale * steps.float()
        return first.reshape(*lead, K), steps.reshape(*lead, L - 1, K, K)

    def lattice(self, cands: Candidates, hidden: Tensor, anchor, *, context: RoundContext) -> tuple[Tensor, Tensor]:
        return self.scores(cands, hidden, context)

    def forward(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                rng: RandomSource, *, context: RoundContext) -> Draft:
        first, steps = self.scores(cands, hidden, context)
        return walk(first, steps, cands.ids, temperature, rng)[0]

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int], *,
                     context: RoundContext) -> list[Draft]:
        first, steps = self.scores(cands, hidden, context)  # [R, K], [R, L-1, K, K]
        index = walk_batch(first, steps, cands.ids)
        return [Draft(row) for row in cands.ids.gather(2, index[..., None])[..., 0]]


register_selector('lilicorr', LiLiCorrSelector)
