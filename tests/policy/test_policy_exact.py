"""Verification policies keep the target's sampled distribution exactly, whatever the drafter's
confidences read: enumerated over every random branch, for each policy × each drafter family ×
path and tree × batch 1 and the padded batch, under non-convex (staircase) cost curves.

A confidence c_{t+1} may read token t (DSpark's head with the Markov input), so a policy that picks a
width by a global argmax over the whole survival curve decides on token t's own value and biases the
output. `SealedDrafts` makes that impossible: the mutant that does it is refused, and when the seal
is broken on purpose the enumeration sees the bias."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash2 import DFlash2Drafter, spec_generate, spec_generate_batch
from dflash2.policy.confidence import Calibrator, survival
from dflash2.policy import CostModel, GoodputPolicy, TreeGoodputPolicy, best_cap, best_widths
from dflash2.decoding.sampling import process_logits, SamplingParams
from dflash2.decoding.sealed import SealedDrafts
from tests.helpers import enumerate_outcomes, exact_ar_distribution, max_abs_diff

V, PROMPT, N_NEW, BLOCK, X, K = 3, [1, 2, 0, 2], 4, 3, 1, 2
EXACT, DETECT = 1e-12, 1e-3
T1 = SamplingParams(1.0)
STAIRCASE = CostModel(((1, 1.0), (2, 2.1), (3, 2.5), (4, 2.6)))  # not convex: a wider pass is dear, then cheap
# for trees (whose node rates move only as rounds are observed): two nodes pay at the prior, one after a rejection
TREE_STAIRCASE = CostModel(((1, 1.0), (2, 1.5), (3, 2.13), (4, 2.2)))


@functools.lru_cache(maxsize=None)
def target(vocab: int = V):
    config = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


@functools.lru_cache(maxsize=None)
def drafter(selector: str, markov: bool = False, vocab: int = V, top_k: int = K, x: int = X) -> DFlash2Drafter:
    """Random N(0, 0.1) weights. DSpark's confidence head reads the Markov embedding of the token before
    each position only, near 0 after token X and near 1 after the others (what a trained head does when
    it has learnt that X is a bad predecessor); without the Markov input it reads the hidden state."""
    torch.manual_seed(1)
    d = DFlash2Drafter.from_target(target(vocab), block_size=BLOCK if vocab == V else 4, num_layers=1, conv="none",
                                   selector=selector, selector_top_k=top_k, selector_rank=8, confidence_head=selector == "dspark",
                                   confidence_with_markov=markov, lilicorr_num_layers=1, lilicorr_factor_dim=8)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.1)
        if selector == "dspark":
            head, w1 = d.candidate_selector.confidence_head.proj, d.candidate_selector.markov_head.markov_w1.weight
            H = d.config.hidden_size
            head.weight.zero_()
            head.bias.zero_()
            if markov:  # logits -8 after X, +8 after any other token
                want = torch.full((vocab,), 8.0, dtype=w1.dtype)
                want[x] = -8.0
                head.weight[0, H:] = torch.linalg.lstsq(w1, want[:, None]).solution[:, 0]
            else:
                head.weight[0, :H].normal_(0.0, 30.0)  # spread around the staircase's turning point (c near 0.82)
                head.bias.fill_(5.5)
    return d.eval()


def ar_distribution(vocab: int = V, prompt: tuple = tuple(PROMPT)):
    return exact_ar_distribution(target(vocab), list(prompt), N_NEW, lambda logits: process_logits(logits, T1))


def distribution(d, policy, verify: str = "path", batched: bool = False, vocab: int = V, prompt: tuple = tuple(PROMPT)):
    """The exact distribution of the output (batched: through spec_generate_batch's padded pass; one row, since
    a second row's branches would multiply the first's)."""
    def program(rng):
        if batched:
            out = spec_generate_batch(d, target(vocab), torch.tensor([prompt]), max_new_tokens=N_NEW, temperature=1.0, rng=rng,
                                      policy=policy(), verify=verify, tree_nodes=BLOCK - 1)[0]
        else:
            out = spec_generate(d, target(vocab), torch.tensor([prompt]), max_new_tokens=N_NEW, temperature=1.0, rng=rng,
                                policy=policy(), verify=verify, tree_nodes=BLOCK - 1)
        return tuple(out.new_tokens.tolist())
    return enumerate_outcomes(program)


def second_given_first(dist, first: int = 0, x: int = X) -> float:
    """P(second token = x | first token = `first`)."""
    given = sum(p for k, p in dist.items() if k[0] == first)
    return sum(p for k, p in dist.items() if k[0] == first and k[1] == x) / given


class Widths:
    """A policy mixin: no wall clock (every branch chooses alike) and every width chosen recorded."""

    seen: set

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, clock=None, calibrator=Calibrator(args[1], prior_strength=1e9), draft_s={1: 0.0, 2: 0.0},
                         **kwargs)  # no probe first: drafting is known to cost nothing

    def widths(self, drafts, draft_s):
        widths = super().widths(drafts, 0.0)
        type(self).seen.update(widths)
        return widths


class Goodput(Widths, GoodputPolicy):
    seen = set()


class TreeGoodput(Widths, TreeGoodputPolicy):
    seen = set()


class GlobalArgmax(Goodput):
    """The mutant: widths by the best widths over every row's whole survival curve (what GoodputPolicy did),
    reading every confidence before deciding on any token."""

    def _stopping_widths(self, drafts, draft_s):
        raw = [[drafts.confidence(t, [r])[0] for t in range(n)] for r, n in enumerate(drafts.lengths)]
        curves = [survival(self.calibrator.calibrate(torch.tensor(c, dtype=torch.float64))).tolist() if c and
                  not math.isnan(c[0]) else curve for c, curve in zip(raw, self.known_curves(drafts.lengths))]
        return self._round_rate(curves, draft_s)[0]


def unsealed(monkeypatch):
    """Break the seal: confidences readable before any commitment (the interface as it was)."""
    def confidence(self, t, rows):
        return [math.nan if self._confidence[r] is None else self._confidence[r][t] for r in rows]
    monkeypatch.setattr(SealedDrafts, "confidence", confidence)


# -- the case that showed the bias --------------------------------------------------------------------
def test_the_markov_confidence_case_is_exact():
    Goodput.seen = set()
    got, branches = distribution(drafter("dspark", markov=True), lambda: Goodput(STAIRCASE, BLOCK - 1))
    want = ar_distribution()
    assert max_abs_diff(got, want) < EXACT
    assert second_given_first(got) == pytest.approx(second_given_first(want), abs=EXACT)
    assert len(Goodput.seen) >= 2, f"one width only ({Goodput.seen}): hollow"


@pytest.mark.slow
def test_the_issue_case_is_exact():
    """As reported: vocabulary 5, three candidates, prompt [1, 3, 0, 2], X = 3, blocks of 4. A long enumeration
    (about 50 minutes on 2 cores): `python -m pytest -m slow tests/policy/test_policy_exact.py -k issue_case -s -n 0`
    prints the branches, the conditional and the widths chosen."""
    Goodput.seen = set()
    d = drafter("dspark", markov=True, vocab=5, top_k=3, x=3)
    got, branches = distribution(d, lambda: Goodput(STAIRCASE, 3), vocab=5, prompt=(1, 3, 0, 2))
    want = ar_distribution(5, (1, 3, 0, 2))
    print(f"{branches} branches; P(second = 3 | first = 0) {second_given_first(got, 0, 3)}, target "
          f"{second_given_first(want, 0, 3)}; widths {sorted(Goodput.seen)}")
    assert max_abs_diff(got, want) < EXACT and len(Goodput.seen) >= 2


def test_the_global_argmax_mutant_is_refused_and_biased_when_unsealed(monkeypatch):
    d, policy = drafter("dspark", markov=True), lambda: GlobalArgmax(STAIRCASE, BLOCK - 1)
    with pytest.raises(ValueError, match="stopping rule"):
        distribution(d, policy)
    unsealed(monkeypatch)
    got, _ = distribution(d, policy)
    want = ar_distribution()
    assert max_abs_diff(got, want) > DETECT
    assert abs(second_given_first(got) - second_given_first(want)) > 0.1  # 0.187 against 0.369


# -- every policy × drafter family × path/tree × batch 1/padded batch ------------------------------
FAMILIES = {"dspark": ("dspark", False), "dspark_markov": ("dspark", True), "lilicorr": ("lilicorr", False),
            "walk": ("walk", False)}
CELLS = [(f, v, b) for f in FAMILIES for v in ("path", "tree") for b in (False, True)]


@pytest.mark.parametrize("family, verify, batched", CELLS)
def test_every_policy_is_exact(family, verify, batched):
    cls = Goodput if verify == "path" else TreeGoodput
    cls.seen = set()
    kwargs = dict(padded=True) if batched else {}  # the padded batch's cap (best_cap)
    cost = STAIRCASE if verify == "path" else TREE_STAIRCASE
    got, branches = distribution(drafter(*FAMILIES[family]), lambda: cls(cost, BLOCK - 1, **kwargs), verify, batched)
    assert max_abs_diff(got, ar_distribution()) < EXACT
    assert len(cls.seen) >= 2, f"one width only ({cls.seen}): the cell would not test the policy"


@pytest.mark.parametrize("batched", [False, True])
def test_the_mutant_is_caught_at_batch_1_and_in_the_padded_batch(monkeypatch, batched):
    unsealed(monkeypatch)
    kwargs = dict(padded=True) if batched else {}
    got, _ = distribution(drafter("dspark", markov=True), lambda: GlobalArgmax(STAIRCASE, BLOCK - 1, **kwargs), "path",
                          batched)
    assert max_abs_diff(got, ar_distribution()) > DETECT


# -- the seal itself ---------------------------------------------------------------------------------
def test_the_seal_reveals_a_confidence_only_after_the_tokens_before_it_are_committed():
    from dflash2.decoding.verify import Draft

    view = SealedDrafts([Draft(torch.arange(3), confidence=torch.tensor([0.9, 0.5, 0.1])), Draft(torch.arange(2))])
    assert view.lengths == (3, 2) and view.has_confidence == (True, False) and not hasattr(view, "tokens")
    assert view.confidence(0, [0, 1])[0] == pytest.approx(0.9) and math.isnan(view.confidence(0, [0, 1])[1])
    with pytest.raises(ValueError, match="stopping rule"):
        view.confidence(1, [0])
    view.commit([0], 1)
    assert view.confidence(1, [0]) == [pytest.approx(0.5)]
    with pytest.raises(ValueError, match="do not fit"):
        view.check([0, 2])  # below its commitment
    with pytest.raises(ValueError, match="committed row 1 to 3"):
        view.commit([1], 3)
    assert view.check([1, 2]) == [1, 2]


def test_floors_keep_committed_tokens():
    curves, round_s = [[0.9, 0.1, 0.05]], lambda n: 1.0 + n
    assert best_widths(curves, round_s) == [1]
    assert best_widths(curves, round_s, [2]) == [2]
    assert best_cap(curves * 2, round_s) == [1, 1] and best_cap(curves * 2, round_s, [3, 0]) == [3, 3]
