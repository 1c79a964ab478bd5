"""dflash2.policy.confidence: survival curves, the walk's own estimate, and online calibration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2.policy.confidence import Calibrator, expected_accepted, lattice_confidence, survival
from dflash2.decoding.rng import TorchRandom
from dflash2.drafter.selectors.codebook import walk


def test_survival_and_expected_accepted_by_hand():
    c = torch.tensor([0.5, 0.5, 1.0, 0.0])
    assert torch.allclose(survival(c), torch.tensor([0.5, 0.25, 0.25, 0.0]))
    assert torch.allclose(expected_accepted(c), torch.tensor([0.0, 0.5, 0.75, 1.0, 1.0]))
    assert expected_accepted(torch.ones(2, 3)).shape == (2, 4)


@given(st.integers(1, 6), st.integers(2, 5), st.floats(0.3, 3.0), st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_lattice_confidence_is_the_sampled_walks_q_at_its_picks(L, K, temperature, seed):
    """At T > 0 the walk draws each pick from softmax(scores / T): lattice_confidence at that T gives the
    same probability of every pick (batched over a leading dimension too)."""
    g = torch.Generator().manual_seed(seed)
    first, steps = torch.randn(K, generator=g), torch.randn(L - 1, K, K, generator=g)
    ids = torch.arange(L * K).view(L, K)
    draft, index = walk(first, steps, ids, temperature, TorchRandom(torch.Generator().manual_seed(seed)))
    q_at_pick = draft.q_probs.gather(1, index[:, None])[:, 0]
    c = lattice_confidence(first, steps, index, temperature)
    assert torch.allclose(c.double(), q_at_pick, atol=1e-5)
    batched = lattice_confidence(torch.stack([first, first]), torch.stack([steps, steps]),
                                 torch.stack([index, index]), temperature)
    assert torch.allclose(batched, torch.stack([c, c]))


def test_lattice_confidence_reads_the_predecessors_row_not_the_best_row():
    """The mutant that reads the row of candidate 0 (not the pick before) gives another number here."""
    first = torch.tensor([0.0, 5.0])  # the walk picks candidate 1 first
    steps = torch.tensor([[[4.0, 0.0], [0.0, 0.0]]])  # from candidate 0: prefers 0; from 1: even
    c = lattice_confidence(first, steps, torch.tensor([1, 0]))
    assert c[1] == pytest.approx(0.5)
    assert c[0] == pytest.approx(torch.softmax(first, -1)[1].item())


def test_calibrator_counts_only_what_verification_observed():
    cal = Calibrator(positions=4, bins=2, prior_strength=1.0)
    c = torch.tensor([0.9, 0.9, 0.9, 0.9])
    cal.observe(c, num_verified=4, num_accepted=1)  # position 0 accepted, 1 rejected, 2-3 not observed
    assert cal.seen[:, 1].tolist() == [1, 1, 0, 0]
    assert cal.accepted[:, 1].tolist() == [1, 0, 0, 0]
    cal.observe(c, num_verified=2, num_accepted=2)  # both verified accepted; position 2 was never verified
    assert cal.seen[:, 1].tolist() == [2, 2, 0, 0]
    cal.observe(c, num_verified=0, num_accepted=0)  # a plain step: nothing observed
    assert cal.seen.sum() == 4
    with pytest.raises(ValueError, match="accepted"):
        cal.observe(c, num_verified=1, num_accepted=2)


def test_calibrator_moves_from_the_raw_value_to_the_observed_rate():
    torch.manual_seed(0)
    cal = Calibrator(positions=1, bins=1, prior_strength=4.0)
    c = torch.tensor([0.9])
    assert cal.calibrate(c).item() == pytest.approx(0.9)  # nothing seen: the raw value
    for accepted in (torch.rand(4000) < 0.3).tolist():  # a head that says 0.9 where 30% survive
        cal.observe(c, 1, int(accepted))
    assert cal.calibrate(c).item() == pytest.approx(0.3, abs=0.03)
    [row] = cal.table()
    assert row["predicted"] == pytest.approx(0.9) and row["observed"] == pytest.approx(0.3, abs=0.03)
    assert cal.calibrate(torch.tensor([0.9, 0.9, 0.9])).shape == (3,)  # past the table: its last row


@given(st.lists(st.floats(0.05, 0.95), min_size=3, max_size=3), st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None)
def test_calibrated_survival_matches_simulated_acceptance(rates, seed):
    """Rounds whose token t survives with probability rates[t] given the ones before: after many rounds
    the calibrated conditional at each position is that rate, whatever the (constant) raw value says.
    Counting the positions after a rejection as rejected (a mutant) would bias positions 1 and 2 down."""
    g = torch.Generator().manual_seed(seed)
    cal = Calibrator(positions=3, bins=1)
    raw = torch.full((3,), 0.5)
    for _ in range(3000):
        k = 0
        while k < 3 and torch.rand(1, generator=g).item() < rates[k]:
            k += 1
        cal.observe(raw, 3, k)
    got = cal.calibrate(raw)
    for t in range(3):
        n = cal.seen[t, 0].item()
        if n > 300:  # enough rounds reached position t
            assert got[t].item() == pytest.approx(rates[t], abs=4 * (0.25 / n) ** 0.5 + 0.01)
