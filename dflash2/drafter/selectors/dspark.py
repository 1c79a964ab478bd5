"""DSpark's sequential Markov head and confidence head, as a path selector (`selector: dspark`).

DSpark (vLLM 0.32's `qwen3_dspark.py`) drafts the block with the DFlash backbone in one pass, then puts
intra-block dependency back with a low-rank Markov head, left to right from the anchor:

    S_t(a, b) = U_t(b) + (W2 · W1[a])[b]       W1, W2 [V, r]; b among the top-K candidates of position t

At T = 0 the argmax at each step, at T > 0 a draw from softmax(S_t / T), the q the verifier checks:
the walk of `dflash2.drafter.selectors.codebook` with a pairwise term that ignores the hidden state.
The confidence head estimates P(token t accepted | tokens before it accepted) for `Draft.confidence`:

    c_t = sigmoid(w · [h_t ; W1[a_t]] + b)       (W1[a_t] only with config.confidence_with_markov)

Training (docs/training.md): the Markov head by the selector loss, the confidence head by binary
cross-entropy against whether the teacher-forced greedy pick is the label.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash2.config import DFlash2Config
from dflash2.drafter.heads import Candidates
from dflash2.registry import register_selector
from dflash2.decoding.rng import RandomSource
from dflash2.drafter.selectors.codebook import PairwiseSelector, walk, walk_batch
from dflash2.decoding.verify import Draft


class MarkovHead(nn.Module):
    """W1 (an embedding of the previous token) and W2 (its projection to a logit bias); vLLM's
    DSparkMarkovHead, with the same parameter names."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # no bias at init: the head starts as the backbone's argmax


class ConfidenceHead(nn.Module):
    """[h ; W1[a]] (or h) → one logit per drafted token (vLLM's DSparkConfidenceHead: `proj`, with bias)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: Tensor, markov_embed: Tensor) -> Tensor:
        """hidden [..., H], markov_embed [..., r] → logits [...] (float32: the head is a calibration)."""
        x = torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float())[..., 0]


class DSparkSelector(PairwiseSelector):
    reads_context = False

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.markov_head = MarkovHead(config.vocab_size, config.selector_rank)
        self.confidence_head = (ConfidenceHead(config.hidden_size, config.selector_rank, config.confidence_with_markov)
                                if config.confidence_head else None)

    def edge_scores(self, prev: Tensor, hidden: Tensor, cand: Tensor) -> Tensor:
        """bias(prev)[cand]: prev [..., P] ids, hidden [..., H] (unused), cand [..., K] ids → [..., P, K]."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        a = self.markov_head.markov_w1.weight[prev].to(dtype)  # [..., P, r]
        return a @ self.markov_head.markov_w2.weight[cand].to(dtype).transpose(-1, -2)  # [..., P, K]

    def confidence_logits(self, hidden: Tensor, prev: Tensor) -> Tensor | None:
        """hidden [..., H] of drafted positions, prev [...] the token before each → logits [...] (None: no head)."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(hidden, self.markov_head.markov_w1.weight[prev])

    def forward(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                rng: RandomSource) -> Draft:
        first, steps = self.lattice(cands, hidden, anchor)
        draft, _ = walk(first, steps, cands.ids, temperature, rng)
        return draft._replace(confidence=self._confidence(hidden, anchor, draft.tokens))

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
        """The greedy (T = 0) draft of R rows at once: cands [R, L, K], hidden [R, L, H]."""
        first, steps = self.lattice(cands, hidden, anchors)
        tokens = cands.ids.gather(2, walk_batch(first, steps, cands.ids)[..., None])[..., 0]  # [R, L]
        conf = self._confidence(hidden, torch.as_tensor(anchors, device=tokens.device), tokens)
        return [Draft(row, confidence=None if conf is None else conf[r]) for r, row in enumerate(tokens)]

    def _confidence(self, hidden: Tensor, anchor, tokens: Tensor) -> Tensor | None:
        """hidden [..., L, H], anchor int or [...], drafted tokens [..., L] → c [..., L] (None: no head)."""
        anchor = torch.as_tensor(anchor, device=tokens.device).reshape(*tokens.shape[:-1], 1)
        prev = torch.cat([anchor, tokens[..., :-1]], dim=-1)  # the token before each drafted one
        logits = self.confidence_logits(hidden, prev)
        return None if logits is None else torch.sigmoid(logits)


register_selector('dspark', DSparkSelector)
