"""Verification policies (dflash2.policy): the goodput choice is optimal, it answers costs and
confidences as it should, and no width sequence a policy may choose changes what is committed:
greedy equality and the exact sampled distribution with adversarial widths, and a mutant policy that
decides on a token's own value (forbidden by the VerifyPolicy contract) must be caught."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash2 import SamplingParams, VerifyPolicy, spec_generate, spec_generate_batch
from dflash2.policy.confidence import Calibrator, NodeRates, RoundCounts
from dflash2.decoding.loop import AutoregressiveDrafter
from dflash2.policy import (QUIET_ROUNDS, ROUND_SAMPLES, ROUND_WINDOW, SKIPPED, UNKNOWN_CONFIDENCE, CostModel, FixedWidth,
                            GoodputPolicy, TreeGoodputPolicy, best_cap, best_widths, hopeful, profile_draft)
from dflash2.decoding.rng import TorchRandom
from dflash2.decoding.sealed import SealedDrafts
from dflash2.decoding.tree import TokenTree, verify_tree
from dflash2.decoding.verify import Draft
from tests.helpers import MASK, hf_greedy, max_abs_diff, tiny_drafter, tiny_target
from tests.decoding.test_exact_distribution import DRAFTERS, EXACT, PARAMS, ar_distribution, spec_distribution
from tests.decoding.test_tree_decoding import DRAFTERS as TREE_DRAFTERS
from tests.decoding.test_tree_decoding import PARAMS as TREE_PARAMS
from tests.decoding.test_tree_decoding import ar_distribution as tree_ar_distribution
from tests.decoding.test_tree_decoding import random_tree, tree_distribution

DETECT = 1e-4


class ScriptedWidths:
    """An adversarial policy: round k verifies min(script[k % len], drafted) tokens of every row, whatever
    the confidences say (a valid policy: the widths never depend on the drafted tokens' values); with
    `skips`, the j-th round asked skips its draft when skips[j % len] (a plain step for every row)."""

    def __init__(self, script: list[int], skips: list[bool] = (False,)) -> None:
        self.script, self.round, self.seen = script, 0, []
        self.skips, self.asked = list(skips), 0

    def drafts(self, rows: int) -> bool:
        skip = self.skips[self.asked % len(self.skips)]
        self.asked += 1
        return not skip

    def widths(self, drafts: SealedDrafts, draft_s: float) -> list[int]:
        w = self.script[self.round % len(self.script)]
        self.round += 1
        return [min(w + i, n) for i, n in enumerate(drafts.lengths)]  # rows differ too

    def observe(self, draft, verified: int, accepted: list[int]) -> None:
        assert verified <= draft.tokens.shape[0] and all(0 <= i < verified for i in accepted)
        if isinstance(draft, Draft):  # a path accepts a prefix
            assert accepted == list(range(len(accepted)))
        self.seen.append((verified, len(accepted)))


class PeekingPolicy(ScriptedWidths):
    """A mutant: verifies a draft only when its first token is the likelier of the proposal's candidates
    (decides on that token's own value), else none of it. SealedDrafts shows no tokens: it runs only where
    the loop is made to hand the drafts over unsealed (`unsealed_drafts`)."""

    def widths(self, drafts: list[Draft], draft_s: float) -> list[int]:
        def likely(d: Draft) -> bool:
            return d.q_ids is not None and int(d.tokens[0]) == int(d.q_ids[0, d.q_probs[0].argmax()])
        return [d.tokens.shape[0] if d.tokens.shape[0] and likely(d) else 0 for d in drafts]


# -- the choice ------------------------------------------------------------------------------------
def _rate(curves, widths, round_s):
    gain = sum(1 + sum(c[:w]) for c, w in zip(curves, widths))
    return gain / round_s(sum(widths) + len(curves))


curve = st.lists(st.floats(0.0, 1.0), max_size=4).map(lambda cs: list(itertools.accumulate(cs, lambda a, b: a * b)))


@settings(max_examples=60)
@given(curves=st.lists(curve, min_size=1, max_size=3), fixed=st.floats(0.0, 2.0), slope=st.floats(0.0, 1.0),
       square=st.floats(0.0, 0.2))
def test_best_widths_is_the_best_of_every_choice(curves, fixed, slope, square):
    round_s = lambda n: 0.05 + fixed + slope * n + square * n * n  # noqa: E731
    got = best_widths(curves, round_s)
    best = max(_rate(curves, w, round_s) for w in itertools.product(*(range(len(c) + 1) for c in curves)))
    assert all(0 <= w <= len(c) for w, c in zip(got, curves))
    assert _rate(curves, got, round_s) >= best - 1e-9


@settings(max_examples=60)
@given(curves=st.lists(curve, min_size=1, max_size=3), fixed=st.floats(0.0, 2.0), slope=st.floats(0.0, 1.0))
def test_best_cap_is_the_best_cap_of_a_padded_pass(curves, fixed, slope):
    round_s = lambda n: 0.05 + fixed + slope * n  # noqa: E731
    rows, longest = len(curves), max(len(c) for c in curves)

    def rate(cap):
        return (rows + sum(sum(c[:cap]) for c in curves)) / round_s(rows * (cap + 1))

    got = best_cap(curves, round_s)
    cap = max(got)
    assert got == [min(cap, len(c)) for c in curves]
    assert rate(cap) >= max(rate(w) for w in range(longest + 1)) - 1e-9


def test_cost_model_interpolates_and_extends(monkeypatch):
    cost = CostModel(((1, 1.0), (4, 1.3), (16, 4.3)))
    assert cost.verify_s(1) == cost.verify_s(0) == 1.0
    assert cost.verify_s(2) == pytest.approx(1.1) and cost.verify_s(10) == pytest.approx(2.8)
    assert cost.verify_s(20) == pytest.approx(5.3)  # the last segment's slope
    for bad in ((), ((2, 1.0), (2, 1.5)), ((0, 1.0),), ((1, -1.0),)):
        with pytest.raises(ValueError, match="CostModel needs points"):
            CostModel(bad)
    calls = []
    measured = CostModel.measure(calls.append, [4, 1, 4], repeats=2)
    assert [n for n, _ in measured.points] == [1, 4] and calls == [1, 4, 1, 4, 1, 4]  # warm-ups, then turns

    clock = [0.0]  # a fake clock: a real sleep's overshoot on a busy machine can exceed the gaps below
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow_small(n):  # a pass over 2 tokens slowed by the machine: noise only adds time
        clock[0] += {1: 0.002, 2: 0.02, 3: 0.004}[n]

    noisy = CostModel.measure(slow_small, [1, 2, 3], repeats=1)
    assert [t for _, t in noisy.points] == pytest.approx([0.002, 0.004, 0.004])  # 2 tokens cost no more than 3 measured


@pytest.mark.parametrize("static", [False, True], ids=["adapter", "static"])
def test_profile_verify_measures_each_width_and_leaves_no_trace(static):
    from dflash2 import StaticTarget, TargetAdapter
    from dflash2.policy import profile_verify

    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    tgt = (StaticTarget if static else TargetAdapter)(target, drafter.target_layer_ids)
    cost = profile_verify(tgt, sizes=(1, 3, 7), context=12, repeats=1)
    assert [n for n, _ in cost.points] == [2, 4, 8] and all(s > 0 for _, s in cost.points)
    prompt = [3, 1, 4, 1, 5]  # the target still decodes exactly after being profiled
    out = spec_generate(drafter, tgt, torch.tensor([prompt]), max_new_tokens=8)
    assert out.sequences[0].tolist() == hf_greedy(target, prompt, 8)


def test_profile_verify_batch_measures_padded_passes_and_leaves_no_trace():
    from dflash2.policy import profile_verify_batch

    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    cost = profile_verify_batch(target, rows=3, sizes=(1, 3), context=10, repeats=1)
    assert [n for n, _ in cost.points] == [6, 12] and all(s > 0 for _, s in cost.points)
    prompts = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    policy = GoodputPolicy(cost, positions=3, padded=True)
    outs = spec_generate_batch(drafter, target, prompts, max_new_tokens=10, policy=policy)
    assert [o.sequences[0].tolist() for o in outs] == [hf_greedy(target, p.tolist(), 10) for p in prompts]


def test_goodput_widths_follow_cost_and_confidence():
    sure = Draft(torch.arange(6), confidence=torch.full((6,), 0.95))
    unsure = Draft(torch.arange(6), confidence=torch.full((6,), 0.05))
    flat = CostModel(((1, 1.0), (64, 1.0)))  # a memory-bound pass: width is free
    steep = CostModel(((1, 1.0), (2, 3.0)))  # every token costs more than a pass
    policy = GoodputPolicy(flat, positions=6, calibrator=Calibrator(6, prior_strength=1e9))  # raw values as given
    assert policy.widths(SealedDrafts([sure, unsure]), draft_s=0.1) == [6, 6]
    policy.cost = steep
    assert policy.widths(SealedDrafts([sure, unsure]), draft_s=0.1) == [0, 0]
    policy.cost = CostModel(((1, 1.0), (2, 1.1)))
    assert policy.widths(SealedDrafts([sure, unsure]), draft_s=0.1) == [6, 0]


def test_goodput_learns_what_verification_accepts():
    """Drafts without confidences: the calibrator learns each position's acceptance; a drafter whose
    first token is never accepted is not verified once the evidence is in."""
    policy = GoodputPolicy(CostModel(((1, 1.0), (2, 1.2))), positions=4)
    blind = Draft(torch.arange(4))
    assert policy.widths(SealedDrafts([blind]), 0.0)[0] > 0  # the prior (c = UNKNOWN_CONFIDENCE) pays at this cost
    for _ in range(50):
        policy.observe(blind, 4, [])
    assert policy.widths(SealedDrafts([blind]), 0.0) == [0]


def test_policies_are_checked():
    assert isinstance(FixedWidth(), VerifyPolicy) and isinstance(GoodputPolicy(CostModel(((1, 1.0),)), 4), VerifyPolicy)
    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    with pytest.raises(ValueError, match="policy must be a dflash2.VerifyPolicy"):
        spec_generate(drafter, target, torch.tensor([[3, 1]]), max_new_tokens=4, policy=object())
    with pytest.raises(ValueError, match="use TreeGoodputPolicy"):
        spec_generate(drafter, target, torch.tensor([[3, 1]]), max_new_tokens=4, verify="tree",
                      policy=GoodputPolicy(CostModel(((1, 1.0),)), 4))
    with pytest.raises(ValueError, match="positions=tree_nodes"):
        spec_generate(drafter, target, torch.tensor([[3, 1]]), max_new_tokens=8, verify="tree", tree_nodes=6,
                      policy=TreeGoodputPolicy(CostModel(((1, 1.0),)), 2))

    class TooWide(ScriptedWidths):
        def widths(self, drafts, draft_s):
            return [n + 1 for n in drafts.lengths]

    with pytest.raises(ValueError, match="do not fit the drafts' lengths"):
        spec_generate(drafter, target, torch.tensor([[3, 1]]), max_new_tokens=8, policy=TooWide([0]))


# -- losslessness under any widths -------------------------------------------------------------------
@settings(max_examples=12)
@given(script=st.lists(st.integers(0, 4), min_size=1, max_size=5), budget=st.integers(1, 14),
       prompt=st.lists(st.integers(0, MASK - 1), min_size=1, max_size=6),
       skips=st.lists(st.booleans(), min_size=1, max_size=4))
def test_greedy_output_is_the_targets_whatever_the_widths(script, budget, prompt, skips):
    _check_greedy_under_scripted_widths(script, budget, prompt, skips, most=4)


def _check_greedy_under_scripted_widths(script, budget, prompt, skips, most, **verify):
    """Greedy output equals the target's, at batch 1 and batched, with ScriptedWidths sizing every round
    (`most`: the longest draft, so a round commits at most min(max(script), most) + 1 tokens)."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter("qwen3", 5, selector="walk")
    want = hf_greedy(target, prompt, budget)
    policy = ScriptedWidths(script, skips)
    out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=budget, policy=policy, **verify)
    assert out.sequences[0].tolist() == want
    assert all(n <= min(max(script), most) + 1 for n in out.acceptance_lengths)  # the widths were applied
    batch = spec_generate_batch(drafter, target, torch.tensor([prompt, prompt[::-1]]), max_new_tokens=budget,
                                policy=ScriptedWidths(script, skips), **verify)
    assert [r.sequences[0].tolist() for r in batch] == [want, hf_greedy(target, prompt[::-1], budget)]


class FeatureCount:
    """Wraps a drafter's propose: checks that every round's drafter has read the target
    features of every token before its anchor, once (skipped rounds' features come at the next draft)."""

    def __init__(self, drafter, prompt_lengths: list[int], committed: list[int]):
        self.read = [0] * len(prompt_lengths)
        self.prompt_lengths, self.committed, self.rounds = prompt_lengths, committed, 0
        propose = drafter.propose

        def one(cache, anchor, features, *args):
            self._check([0], [features])
            return propose(cache, anchor, features, *args)

        drafter.propose = one

    def _check(self, rows, features):
        for r, f in zip(rows, features):
            self.read[r] += 0 if f is None else f.shape[1]
            assert self.read[r] == self.prompt_lengths[r] + self.committed[r] - 1, (self.read, self.committed)
        self.rounds += 1


@pytest.mark.parametrize("skips", [[True, False], [False, True, True], [True, True, True, False]])
def test_a_skipped_round_hands_its_features_to_the_next_draft(skips):
    """After plain steps the drafter reads every committed token's features, once and in order: the
    count matches at every draft, and the run with skips drafts what the run without them drafts at the
    same committed prefix (greedy: the drafts depend only on the context)."""
    target = tiny_target("qwen3")
    prompt = [3, 1, 4, 1, 5]

    def run(skip_script):
        drafter = tiny_drafter("qwen3", 5, selector="walk").with_config()  # a copy: propose is wrapped
        committed, drafts = [0], {}
        spy = FeatureCount(drafter, [len(prompt)], committed)
        propose = drafter.propose

        def recorded(cache, anchor, features, *args):
            draft = propose(cache, anchor, features, *args)
            drafts[committed[0]] = draft.tokens.tolist()
            return draft

        drafter.propose = recorded
        spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=24,
                      policy=ScriptedWidths([1], skip_script),
                      on_commit=lambda tokens, n: committed.__setitem__(0, committed[0] + len(tokens)))
        return spy.rounds, drafts

    rounds, with_skips = run(skips)
    _, without = run([False])
    assert rounds > 2 and with_skips and all(without.get(n) == d for n, d in with_skips.items() if n in without)
    assert sum(n in without for n in with_skips) >= 2  # the comparison is not empty


class StrictSkips(ScriptedWidths):
    """ScriptedWidths that fails when the loop asks for widths or reports a round it was told not to draft."""

    def drafts(self, rows: int) -> bool:
        self.drafting = super().drafts(rows)
        return self.drafting

    def widths(self, drafts: list[Draft], draft_s: float) -> list[int]:
        assert self.drafting, "widths() asked for a round that drafts() skipped"
        return super().widths(drafts, draft_s)

    def observe(self, draft: Draft, verified: int, accepted: list[int]) -> None:
        assert self.drafting, "observe() called for a round that drafts() skipped"
        super().observe(draft, verified, accepted)


@pytest.mark.parametrize("batched", [False, True], ids=["spec_generate", "spec_generate_batch"])
def test_a_skipped_round_asks_no_widths_and_reports_nothing(batched):
    """A round the policy does not draft is a plain step and nothing more: the loop neither asks its widths
    nor reports it to observe (the policy counted it when it said no), and the greedy output is the target's."""
    target, prompt = tiny_target("qwen3"), [3, 1, 4, 1, 5]
    drafter = tiny_drafter("qwen3", 5, selector="walk")
    policy = StrictSkips([2], [True, False, True])
    if batched:
        [out] = spec_generate_batch(drafter, target, torch.tensor([prompt]), max_new_tokens=20, policy=policy)
    else:
        out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=20, policy=policy)
    assert out.sequences[0].tolist() == hf_greedy(target, prompt, 20)
    assert policy.asked > policy.round > 0 and len(policy.seen) == policy.round  # some rounds skipped, the rest reported


class CountedGoodput(GoodputPolicy):
    """GoodputPolicy with a fixed drafting time (no wall clock): records its drafts() answers."""

    def __init__(self, *args, draft_time=0.0, **kwargs):
        super().__init__(*args, **{"clock": None, **kwargs})  # the model alone, unless a test gives a clock
        self.draft_time, self.answers = draft_time, []

    def drafts(self, rows):
        self.answers.append(super().drafts(rows))
        return self.answers[-1]

    def widths(self, drafts, draft_s):
        return super().widths(drafts, self.draft_time)

    @staticmethod
    def tree(cost, positions, rates, draft_time=0.5):
        """The same for TreeGoodputPolicy (drafting 0.5 s unless told, explore 0.5 down to 0.01)."""
        class Tree(CountedGoodput, TreeGoodputPolicy):
            pass
        return Tree(cost, positions, rates=rates, explore=0.5, explore_min=0.01, draft_time=draft_time,
                    draft_s={1: draft_time})


def test_goodput_stops_drafting_when_a_plain_step_pays_more_and_probes_within_its_share():
    """A drafter whose tokens are never accepted, against a pass that costs more per token than it
    commits: after its first round the policy stops drafting, then probes once a probe's extra cost
    (drafting 0.5 s + a 5-token pass 3.4 s - a plain step 1.0 s = 2.9 s, twice: after skipped rounds
    a probe drafts two rounds, the first reading the skipped features) is at most the share (0.5,
    halved per probe down to 0.25) of the plain seconds skipped since the last: after 12 skips, then
    after 24; with a cheap pass and accepted drafts it always drafts."""
    cost = CostModel(((1, 1.0), (2, 1.6)))
    policy = CountedGoodput(cost, positions=4, explore=0.5, explore_min=0.25, draft_time=0.5)
    blind = Draft(torch.arange(4))
    for _ in range(50):  # the loop's protocol: drafts(), then widths() and observe() when it drafted
        if policy.drafts(1):
            [w] = policy.widths(SealedDrafts([blind]), 0.0)
            policy.observe(blind, w, [])
    answers = policy.answers
    probes = [i for i, a in enumerate(answers) if a]
    assert probes == [0, 12, 13, 37, 38], probes  # the first round measures the drafting time, then it stops
    assert policy.chosen == Counter({SKIPPED: 50 - len(probes), 4: len(probes)})  # each probe verified in full
    with pytest.raises(ValueError, match="explore"):
        GoodputPolicy(cost, positions=4, explore=0.01, explore_min=0.1)
    eager = CountedGoodput(CostModel(((1, 1.0), (8, 1.1))), positions=4, draft_time=0.1)
    sure = Draft(torch.arange(4))
    for _ in range(20):
        if eager.drafts(1):
            [w] = eager.widths(SealedDrafts([sure]), 0.0)
            eager.observe(sure, w, list(range(w)))
    assert all(eager.answers)
    padded = CountedGoodput(cost, positions=4, padded=True, draft_time=0.5)  # the batched decision, per row count
    assert padded.draft_cost(3) is None and padded.drafts(3)  # nothing measured yet: draft and measure
    assert padded.widths(SealedDrafts([blind] * 3), 0.0) == [4, 4, 4] and padded.draft_s == {3: 0.5}  # a probe: verified in full
    assert padded.draft_cost(2) == 0.5 and padded.draft_cost(6) == 1.0  # other row counts: estimated from it


@pytest.mark.parametrize("tree", [False, True], ids=["path", "tree"])
def test_probes_keep_to_the_least_share_where_even_hope_loses(tree):
    """The blind drafter of the test above. Once its first position has failed 400 times, drafting
    loses even at optimistic acceptance (each rate two standard errors up): a probe would have nothing
    to learn, and probes keep to explore_min's share (none in 200 rounds here); after two failures
    the optimistic rates could still make drafting pay, and it probes at explore's share (round 11:
    the test above's first probe after skipped rounds). Without the rule both would probe there: at
    20 rows a probe drafts and verifies every row (on the embedded pair about 120 ms, 20 plain steps)
    where every round has already shown it loses."""
    cost = CostModel(((1, 1.0), (2, 1.6)))
    blind = Draft(torch.arange(4))

    def probes_after(failures: int) -> list[int]:
        if tree:
            rates = NodeRates(4, UNKNOWN_CONFIDENCE)
            for _ in range(failures):
                rates.observe(4, [])
            policy = CountedGoodput.tree(cost, 4, rates)
        else:
            calibrator = Calibrator(4)
            for _ in range(failures):
                calibrator.observe(torch.full((4,), UNKNOWN_CONFIDENCE), 4, 0)
            policy = CountedGoodput(cost, positions=4, calibrator=calibrator, explore=0.5, explore_min=0.01,
                                    draft_time=0.5, draft_s={1: 0.5})
        for _ in range(200):
            if policy.drafts(1):
                [w] = policy.widths(SealedDrafts([blind]), 0.0)
                policy.observe(blind, w, [])
        return [i for i, a in enumerate(policy.answers) if a]

    assert probes_after(400) == []
    assert probes_after(2)[:1] == [11]


def test_hope_is_one_margin_on_a_rounds_tokens_not_one_per_node():
    """15-node trees where node 0 is accepted 45% of the time, node 1 15% and the rest never, over
    100 full rounds (0.6 tokens a round, the prior still lifting the estimate to 0.85); a round costs
    1 s of drafting and a 1.2 s pass, so it ties 1-second plain steps at 1.2 accepted tokens. One
    margin on the round's tokens (two standard errors of a round's count, about 0.15) cannot reach
    1.2, so probes keep to explore_min's share: none in 200 rounds. A margin on every node's rate,
    summed over 15 nodes (what the policy did before), reaches 1.5 and probed within ten rounds,
    where every probe only confirms skipping."""
    cost = CostModel(((1, 1.0), (16, 1.2)))
    rates = NodeRates(15, UNKNOWN_CONFIDENCE)
    for k in range(100):
        rates.observe(15, [] if k % 20 < 11 else [0] if k % 20 < 17 else [0, 1])
    policy = CountedGoodput.tree(cost, 15, rates, draft_time=1.0)
    assert rates.full.n == 100 and rates.full.total == 60
    hope = sum(policy.hopeful_curve())
    assert 0.85 < hope < 1.1, hope
    blind = Draft(torch.arange(15))
    for _ in range(200):
        if policy.drafts(1):
            [w] = policy.widths(SealedDrafts([blind]), 0.0)
            policy.observe(blind, w, [])
    assert not any(policy.answers)


def test_hopeful_curves():
    """hopeful(): the curve scaled to E + 2·sqrt(v / n) + 1/n (v: the rounds' variance, at least
    Σ c(1 − c)), each value at most 1; RoundCounts' variance is the sample variance."""
    counts = RoundCounts()
    assert counts.variance() is None
    for k in (0, 3, 1, 1, 0, 2):
        counts.add(k)
    assert counts.n == 6 and counts.variance() == pytest.approx(statistics.variance([0, 3, 1, 1, 0, 2]))
    curve = [0.5, 0.25, 0.125]
    floor = sum(c * (1 - c) for c in curve)
    for rounds, strength in ((RoundCounts(), 2.0), (counts, 2.0)):
        n = rounds.n + strength
        aim = 0.875 + 2 * (max(rounds.variance() or 0.0, floor) / n) ** 0.5 + 1 / n
        out = hopeful(curve, rounds, strength)
        assert out == pytest.approx([min(1.0, c * aim / 0.875) for c in curve])
        assert out == sorted(out, reverse=True) and max(out) <= 1.0
    steady = RoundCounts()
    for _ in range(10_000):
        steady.add(1)  # every round accepts one token: only the floor and 1/n remain
    assert sum(hopeful([0.9, 0.1], steady, 2.0)) == pytest.approx(1 + 2 * (0.18 / 10_002) ** 0.5 + 1 / 10_002)
    assert hopeful([0.0, 0.0], RoundCounts(), 4.0) == [0.125, 0.125]  # nothing expected: the margin spread evenly
    calibrator = Calibrator(2)
    calibrator.observe(torch.full((2,), 0.9), 2, 1)  # verified every position: a full round
    calibrator.observe(torch.full((2,), 0.9), 1, 1)  # not
    assert calibrator.full.n == 1 and calibrator.full.total == 1


def _run_blind(policy, rounds: int, clock: list, probe_round_s) -> list[int]:
    """The blind drafter's decode on a fake clock: a plain step takes 1 s, a drafting round
    probe_round_s(policy) seconds; the rounds that drafted."""
    blind = Draft(torch.arange(4))
    for _ in range(rounds):
        if policy.drafts(1):
            [w] = policy.widths(SealedDrafts([blind]), 0.0)
            policy.observe(blind, w, [])
            clock[0] += probe_round_s(policy)
        else:
            clock[0] += 1.0
    return [i for i, a in enumerate(policy.answers) if a]


def test_probes_keep_to_their_share_of_the_time_as_measured():
    """The drafter of the test above, whose drafting rounds take the 3.9 s the model says, but the
    first round of a probe takes 10 s on the clock (reading the skipped rounds' features), which no
    drafting round timed alone shows: the model prices a probe at 2 × 2.9 s above plain steps. The
    first probe (12, 13) is priced by the model; its measured 9 + 2.9 s joins the model's 5.8 s, whose
    lower median is still the model's (the next probe after 24 plain steps, at the halved share 0.25);
    once a second probe confirms it, 11.9 s sets when the next comes: after 48 plain steps, where the
    model alone would have probed after 24 (the test above)."""
    cost = CostModel(((1, 1.0), (2, 1.6)))
    clock = [0.0]
    policy = CountedGoodput(cost, positions=4, explore=0.5, explore_min=0.25, draft_time=0.5, clock=lambda: clock[0])
    backlog = lambda p: 10.0 if p.answers[-2:-1] == [False] else 3.9  # noqa: E731 (after skipped rounds: their backlog)
    assert _run_blind(policy, 150, clock, backlog) == [0, 12, 13, 37, 38, 86, 87, 135, 136]
    assert policy.residual("draft", 1) == pytest.approx(0.0)
    assert policy.timer.probe_s == {1: pytest.approx(11.9)} and policy.timer.probe_cost(1, 5.8) == pytest.approx(11.9)
    assert policy.timer.probe_cost(2, 5.8) == pytest.approx(23.8)  # more rows: scaled from the most measured
    assert CountedGoodput(cost, positions=4).timer.probe_cost(1, 5.8) == 5.8  # nothing measured: the model's


@pytest.mark.parametrize("stalled", [0, 13], ids=["first-round", "probe"])
def test_one_stalled_round_does_not_stop_the_probes(stalled):
    """The same drafter, where one drafting round timed alone (a residual sample) stalls for 1000 s: a
    compile of a shape not seen before, in a timed round. Round 0 (the first drafting round, before
    any probe) or round 13 (the first probe's second round). The stalled residual, and the stalled
    probe, would each price every later probe at about a thousand seconds, and a policy that has
    stopped drafting would never probe again in these 150 rounds. A probe is priced without the
    drafting residual, and the model's price stays in the probe window beside the stalled probe (their
    lower median: the model's): probes keep coming, every 25 rounds at the least share (after round
    0's stall, with the stalled residual even hope loses, so the first comes at explore_min's share
    too), and the next probe's second round, a residual sample, brings the drafting residual back to
    the model's."""
    cost = CostModel(((1, 1.0), (2, 1.6)))
    clock = [0.0]
    policy = CountedGoodput(cost, positions=4, explore=0.5, explore_min=0.25, draft_time=0.5, clock=lambda: clock[0])
    stall = lambda p: 1000.0 if len(p.answers) == stalled + 1 else 3.9  # noqa: E731
    probes = _run_blind(policy, 150, clock, stall)
    assert probes[:5] == {0: [0, 24, 25, 49, 50], 13: [0, 12, 13, 37, 38]}[stalled], probes
    assert policy.timer.probe_cost(1, 5.8) == pytest.approx(5.8) and policy.residual("draft", 1) == pytest.approx(0.0, abs=1e-9)


class _Judged(GoodputPolicy):
    """GoodputPolicy that judges (and times) every round: no quiet stretches."""

    quiet_rounds = 0


@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 120)), min_size=1, max_size=4),
       slope=st.sampled_from([0.25, 0.5, 1.0, 2.0]), draft_time=st.sampled_from([0.25, 1.0, 4.0]),
       explore=st.sampled_from([(0.5, 0.25), (0.05, 0.002), (1.0, 1.0)]),
       accepted=st.lists(st.integers(0, 4), min_size=1, max_size=6), timed=st.booleans(),
       extra=st.sampled_from([0.0, 0.5]))
@example(segments=[(3, 19), (2, 60), (3, 82)], slope=0.25, draft_time=1.0, explore=(0.5, 0.25), accepted=[0, 3, 4],
         timed=True, extra=0.0)  # a stretch at 3 rows cut by 2 rows: what it showed does not hold when 3 rows come back
def test_quiet_stretches_answer_as_the_full_calls_do(segments, slope, draft_time, explore, accepted, timed, extra):
    """Quiet stretches change no answer: over any run of numbers of rows, acceptances, costs and shares,
    a policy that answers settled skips with a counter drafts in the same rounds, verifies the same
    widths and counts the same skips as one that judges every round, without a clock and on a clock
    whose plain steps take a constant `extra` above the model (so that a residual sample missed in a
    stretch would have read what the others read). It also makes fewer full calls where it skips long."""
    cost = CostModel(((1, 1.0), (2, 1.0 + slope)))
    runs = []
    for cls in (GoodputPolicy, _Judged):
        clock = [0.0]
        policy = cls(cost, 4, explore=explore[0], explore_min=explore[1], draft_s={1: draft_time},
                     clock=(lambda c=clock: c[0]) if timed else None)
        answers, k = [], 0
        for rows, count in segments:
            for _ in range(count):
                drafting = policy.drafts(rows)
                answers.append(drafting)
                if drafting:
                    drafts = [Draft(torch.arange(4))] * rows
                    widths = policy.widths(SealedDrafts(drafts), draft_time)
                    for d, w in zip(drafts, widths):
                        policy.observe(d, w, list(range(min(w, accepted[k % len(accepted)]))))
                        k += 1
                    answers.append(tuple(widths))
                    clock[0] += draft_time + cost.verify_s(rows + sum(widths)) + extra
                else:
                    clock[0] += cost.verify_s(rows) + extra
        runs.append((answers, policy.chosen, policy.skipped_s, policy.judged))
    (quiet, chosen, skipped_s, quiet_calls), (judged, judged_chosen, judged_skipped_s, judged_calls) = runs
    assert quiet == judged and chosen == judged_chosen and skipped_s == judged_skipped_s
    assert quiet_calls <= judged_calls == sum(count for _, count in segments)


def test_quiet_stretches_leave_most_skipped_rounds_unjudged_and_keep_sampling_the_plain_step():
    """The blind drafter against a dear pass, 400 rounds on a clock: a stretch starts once a plain step's
    residual window is full, then every QUIET_ROUNDS + 2 rounds judge and time one round (a sample)."""
    cost = CostModel(((1, 1.0), (2, 1.6)))
    clock = [0.0]
    policy = GoodputPolicy(cost, 4, explore=0.05, explore_min=0.002, draft_s={1: 0.5}, clock=lambda: clock[0])
    blind = Draft(torch.arange(4))
    for _ in range(400):
        if policy.drafts(1):
            [w] = policy.widths(SealedDrafts([blind]), 0.5)
            policy.observe(blind, w, [])
            clock[0] += 3.9
        else:
            clock[0] += 1.0
    assert policy.chosen[SKIPPED] > 390  # (a probe or two among them)
    # the window's first samples, then two full calls a stretch, and each probe's rounds and the two after them
    assert policy.judged <= ROUND_WINDOW + 2 + 2 * 400 / (QUIET_ROUNDS + 2) + 2 * 4, policy.judged
    window = policy.timer.windows["plain"][1]
    assert len(window) == ROUND_WINDOW and policy.residual("plain", 1) == pytest.approx(0.0)
    before = list(window)
    for _ in range(2 * (QUIET_ROUNDS + 2)):
        if not policy.drafts(1):
            clock[0] += 1.5  # the machine slows: the samples read it
    assert list(window) != before and max(window) == pytest.approx(0.5)


def _distribution_with(policy_factory, drafter_name, params):
    """The exact output distribution with a fresh policy in every branch (a policy is per generation)."""
    return spec_distribution(DRAFTERS[drafter_name](), params, policy=policy_factory)[0]


@pytest.mark.parametrize("script", [[0], [1], [0, 2, 1], pytest.param([2, 0], marks=pytest.mark.slow)])
@pytest.mark.parametrize("drafter_name", ["sampled_walk_sparse_q", "sampled_dspark"])
def test_sampled_output_is_exact_whatever_the_widths(script, drafter_name):
    params = PARAMS["T0.7_topk2"]
    got = _distribution_with(lambda: ScriptedWidths(script), drafter_name, params)
    assert max_abs_diff(got, ar_distribution(params)) < EXACT


@pytest.mark.parametrize("skips", [[True, False], [False, True]])
def test_sampled_output_is_exact_when_rounds_skip_their_draft(skips):
    params = PARAMS["T0.7_topk2"]
    got = _distribution_with(lambda: ScriptedWidths([2], skips), "sampled_walk_sparse_q", params)
    assert max_abs_diff(got, ar_distribution(params)) < EXACT


class Recorded:
    """A policy mixin: widths without the wall clock (each branch must choose alike), every width
    chosen recorded in Recorded.seen."""

    seen: set = set()

    def widths(self, drafts, draft_s):
        widths = super().widths(drafts, 0.0)
        Recorded.seen.update(widths)
        return widths


class RecordedGoodput(Recorded, GoodputPolicy):
    pass


class RecordedTreeGoodput(Recorded, TreeGoodputPolicy):
    pass


def test_sampled_output_is_exact_under_the_goodput_policy():
    """DSpark's confidences (computed before each token is drawn) size the widths: still exact."""
    params, Recorded.seen = PARAMS["T1"], set()
    cost = CostModel(((1, 1.0), (2, 1.4), (3, 1.8)))
    got = _distribution_with(lambda: RecordedGoodput(cost, positions=2, calibrator=Calibrator(2, prior_strength=1e9)),
                             "sampled_dspark", params)
    assert max_abs_diff(got, ar_distribution(params)) < EXACT
    assert len(Recorded.seen) >= 2, f"the policy chose one width only ({Recorded.seen}): hollow"


def unsealed_drafts(monkeypatch):
    """The loop hands a policy the drafts themselves (what SealedDrafts prevents)."""
    import dflash2.decoding.checks

    def apply(policy, drafts, draft_s):
        return drafts if policy is None else [d.truncate(w) for d, w in zip(drafts, policy.widths(drafts, draft_s))]
    monkeypatch.setattr(dflash2.decoding.checks, "apply_policy", apply)
    for module in ("dflash2.decoding.loop", "dflash2.decoding.batch"):
        monkeypatch.setattr(f"{module}.apply_policy", apply)


def test_a_policy_cannot_see_tokens():
    view = SealedDrafts([Draft(torch.arange(3))])
    with pytest.raises(TypeError):  # not a list of drafts
        PeekingPolicy([0]).widths(view, 0.0)
    assert not any(hasattr(view, name) for name in ("tokens", "drafts", "q_ids", "q_probs"))


def test_a_policy_that_peeks_at_a_token_is_caught(monkeypatch):
    unsealed_drafts(monkeypatch)
    params = PARAMS["T0.7_topk2"]
    got = _distribution_with(lambda: PeekingPolicy([0]), "sampled_walk_sparse_q", params)
    assert max_abs_diff(got, ar_distribution(params)) > DETECT


def test_a_truncation_that_misaligns_q_is_caught(monkeypatch):
    """Mutant: the width cut keeps the first n tokens with the last n positions' proposal distributions."""
    def misaligned(self, n):
        n = max(n, 0)
        if n >= self.tokens.shape[0] or self.q_ids is None:
            return Draft(self.tokens[:n]) if n < self.tokens.shape[0] else self
        L = self.tokens.shape[0]
        return Draft(self.tokens[:n], self.q_ids[L - n:], self.q_probs[L - n:])

    monkeypatch.setattr(Draft, "truncate", misaligned)
    params = PARAMS["T0.7_topk2"]
    got = _distribution_with(lambda: ScriptedWidths([1]), "sampled_walk_sparse_q", params)
    assert max_abs_diff(got, ar_distribution(params)) > DETECT


@pytest.mark.parametrize("rounds, expected", [
    ([(3, None), (3, 0.3), (3, 0.2), (2, 0.05), (1, 0.01)], 0.2),  # the rounds with every row in flight
    ([(2, None), (2, 0.2), (1, 0.05)], 0.3),  # none with all three: the fullest rounds', scaled to three rows
])
def test_profile_draft_times_the_rounds_with_every_row(monkeypatch, rounds, expected):
    """Rows that accept more finish first: the last rounds of profile_draft's batch draft a few rows
    and took a fraction of a full round (on the embedded pair 4.6 ms against 25 ms at 32 rows), which
    as the prior made drafting look five times cheaper than it is."""
    import dflash2.policy.cost

    def fake_batch(drafter, target, ids, policy, **_):  # what the loop hands the policy, round by round
        for n, seconds in rounds:
            policy.widths(SealedDrafts([Draft(torch.arange(2))] * n), seconds)

    monkeypatch.setattr(dflash2.policy.cost, "spec_generate_batch", fake_batch)
    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    assert profile_draft(drafter, target, rows=3, context=8) == pytest.approx(expected)


def test_profile_draft_measures_a_round_and_a_policy_given_it_does_not_probe_first():
    """profile_draft times real drafting rounds (one row, and a batch); a GoodputPolicy started from
    that time and a calibration that has seen drafts fail does not draft at all when the pass is dear,
    where one without it spends its first round drafting to measure."""
    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    one, three = profile_draft(drafter, target, rows=1, context=8), profile_draft(drafter, target, rows=3, context=8)
    assert 0 < one < 1 and 0 < three < 1
    with pytest.raises(ValueError, match="drafted nothing"):
        profile_draft(AutoregressiveDrafter(), target, rows=1, context=8)
    failed = Calibrator(3)
    for _ in range(50):
        failed.observe(torch.full((3,), UNKNOWN_CONFIDENCE), 3, 0)
    dear = CostModel(((1, 1.0), (2, 1.9)))
    informed = GoodputPolicy(dear, positions=3, calibrator=failed, draft_s={1: one}, clock=None)
    assert [informed.drafts(1) for _ in range(5)] == [False] * 5
    assert GoodputPolicy(dear, positions=3, calibrator=failed).drafts(1)  # nothing measured: a probe
    # a prior far above the truth: skipped until a probe measures the drafting, which replaces it
    # (explore_min = explore: even where drafting loses at optimistic acceptance, probes keep their share)
    wrong = CountedGoodput(CostModel(((1, 1.0), (8, 1.1))), positions=4, draft_time=0.1, draft_s={1: 100.0},
                           explore=0.5, explore_min=0.5)
    sure = Draft(torch.arange(4))
    for _ in range(1000):  # a probe after skips costs two drafts: after 400 plain seconds
        if wrong.drafts(1):
            [w] = wrong.widths(SealedDrafts([sure]), 0.0)
            wrong.observe(sure, w, list(range(w)))
    assert not wrong.answers[0] and wrong.draft_s == {1: pytest.approx(0.1)} and all(wrong.answers[-100:])
    # a first measured round far slower than the prior (a compile of a new shape): drafting goes on
    compiles = CountedGoodput(CostModel(((1, 1.0), (8, 1.1))), positions=4, draft_s={1: 0.1})
    times = iter([100.0] + [0.1] * 50)
    for _ in range(30):
        if compiles.drafts(1):
            [w] = GoodputPolicy.widths(compiles, SealedDrafts([sure]), next(times))
            compiles.observe(sure, w, list(range(w)))
    assert all(compiles.answers) and compiles.draft_s == {1: pytest.approx(0.1)}


# -- token trees -------------------------------------------------------------------------------------
@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), nodes=st.integers(1, 9), greedy=st.booleans())
def test_a_truncated_tree_verifies_its_nodes_as_the_whole_tree_does(seed, nodes, greedy):
    """What NodeRates relies on: with the same random stream, the first n nodes of a tree accept
    exactly the whole tree's accepted nodes below n (a node's verdict depends on earlier nodes only)."""

    g = torch.Generator().manual_seed(seed)
    tree = random_tree(g, nodes, vocab=4)
    logits = torch.randn(tree.tokens.shape[0] + 1, 4, generator=g, dtype=torch.float64) * 2
    params = SamplingParams(0.0 if greedy else 1.0)
    full = verify_tree(tree, logits, params, TorchRandom(torch.Generator().manual_seed(seed))).path
    for n in range(tree.tokens.shape[0] + 1):
        cut = tree.truncate(n)
        cut.validate()
        path = verify_tree(cut, logits[: n + 1], params, TorchRandom(torch.Generator().manual_seed(seed))).path
        assert path == [i for i in itertools.takewhile(lambda i: i < n, full)], (n, path, full)


@settings(max_examples=10)
@given(script=st.lists(st.integers(0, 6), min_size=1, max_size=4), budget=st.integers(1, 14),
       prompt=st.lists(st.integers(0, MASK - 1), min_size=1, max_size=6),
       skips=st.lists(st.booleans(), min_size=1, max_size=3))
def test_tree_greedy_output_is_the_targets_whatever_the_node_counts(script, budget, prompt, skips):
    _check_greedy_under_scripted_widths(script, budget, prompt, skips, most=7, verify="tree", tree_nodes=7)


@pytest.mark.parametrize("script", [[0], [1], [2, 0, 5]])
@pytest.mark.parametrize("drafter_name", ["2x2", "lattice_k2"])
def test_tree_sampled_output_is_exact_whatever_the_node_counts(script, drafter_name):
    params = TREE_PARAMS["T1"]
    got, _ = tree_distribution(TREE_DRAFTERS[drafter_name](), params, policy=lambda: ScriptedWidths(script, [False, True]))
    assert max_abs_diff(got, tree_ar_distribution(params)) < EXACT


def test_tree_sampled_output_is_exact_under_the_tree_goodput_policy():
    """TreeGoodputPolicy, learning node rates inside each branch, sizes the trees: still exact."""
    params, Recorded.seen = TREE_PARAMS["T0.7_topk2"], set()
    cost = CostModel(((1, 1.0), (2, 1.3), (9, 3.4)))

    def policy():  # a prior that makes the early counts depend on what was observed
        return RecordedTreeGoodput(cost, 8, rates=NodeRates(8, prior=0.6, prior_strength=0.5))

    got, _ = tree_distribution(TREE_DRAFTERS["lattice_k2"](), params, policy=policy)
    assert max_abs_diff(got, tree_ar_distribution(params)) < EXACT
    assert len(Recorded.seen) >= 2, f"one node count only ({Recorded.seen})"


def test_tree_goodput_verifies_the_nodes_that_pay():
    """Node rates learned from full trees (nodes 0 and 2 usually accepted, the rest never): a cheap
    pass verifies every node, a pass whose every token costs a quarter of a plain step stops after
    node 2, a dear one verifies none; the padded choice of many rows is one count for all."""

    tree = TokenTree(torch.tensor([5, 6, 7, 8, 9, 4]), torch.tensor([-1, -1, 0, 1, 2, 0]))
    policy = TreeGoodputPolicy(CostModel(((1, 1.0), (64, 1.0))), 6, draft_s={1: 0.0})
    assert policy.drafts(1) and policy.widths(SealedDrafts([tree]), 0.0) == [6]  # the prior: every node pays
    for k in range(40):
        policy.observe(tree, 6, [0, 2] if k % 10 else [1])
    rates = policy.rates.rates()
    assert rates[0] > 0.8 and rates[2] > 0.8 and rates[3] < 0.2 and rates[4] < 0.2
    assert policy.widths(SealedDrafts([tree]), 0.0) == [6]  # free width
    policy.cost = CostModel(((1, 1.0), (2, 1.25)))
    assert policy.widths(SealedDrafts([tree]), 0.0) == [3]
    policy.cost = CostModel(((1, 1.0), (2, 3.0)))
    assert policy.widths(SealedDrafts([tree]), 0.0) == [0]
    many = TreeGoodputPolicy(CostModel(((1, 1.0), (2, 1.05))), 6, rates=policy.rates, padded=True)
    assert many.widths(SealedDrafts([tree, tree.truncate(2)]), 0.0) == [3, 2]  # one cap of 3 nodes; the second tree has 2
    with pytest.raises(ValueError, match="distinct accepted nodes"):
        policy.observe(tree, 2, [0, 2])
    with pytest.raises(ValueError, match="NodeRates of as many nodes"):
        TreeGoodputPolicy(CostModel(((1, 1.0),)), 6, rates=NodeRates(3, 0.5))


def test_the_loops_own_time_counts_in_a_plain_step_and_a_drafting_round_alike():
    """A pass dear per token: drafting loses against the bare pass (4.1 tokens in 4.5 s against 1 in
    1 s), and wins once the loop's own 3 s per round count on both sides (4.1 in 7.5 s, 1 in 4 s)."""
    cost = CostModel(((1, 1.0), (5, 4.0)))

    def policy(**loop):
        return GoodputPolicy(cost, 4, calibrator=Calibrator(4, prior_strength=1e9), draft_s={1: 0.5}, **loop)
    assert not policy().drafts(1)
    slow_loop = policy(loop_s={1: 3.0})
    assert slow_loop.drafts(1) and slow_loop.widths(SealedDrafts([Draft(torch.arange(4))]), 0.5) == [4]
    assert slow_loop.loop_cost(1) == 3.0 and slow_loop.loop_cost(2) == 6.0 and policy().loop_cost(3) == 0.0


def _run_rounds(policy, rounds: int, plain_s: float, draft_s, clock: list[float]) -> None:
    """The loop's protocol against a fake clock: a plain step takes plain_s, a drafting round that
    verifies w tokens draft_s(w) (its drafting 0.1 s of it); every drafted token is accepted."""
    sure = Draft(torch.arange(4))
    for _ in range(rounds):
        if policy.drafts(1):
            [w] = GoodputPolicy.widths(policy, SealedDrafts([sure]), 0.1)
            policy.observe(sure, w, list(range(w)))
            clock[0] += draft_s(w)
        else:
            clock[0] += plain_s


def test_measured_rounds_correct_what_the_model_misses():
    """The model says drafting pays (5 tokens in 0.1 + 1.2 s against 1 in 1 s) but a drafting round
    takes 20 s on this machine: once it has measured one such round (a residual of 18.7 s) it stops
    drafting (a drafting round's residual counts from the first: each round priced too low costs many
    plain steps); without a clock it drafts on. The other way round: the model says a plain step pays (a
    pass dear per token), but every round spends 2 s the model does not know of, which makes drafting
    pay (5 tokens in 8.1 s against 1 in 3 s): after four plain steps it drafts, and verifies every
    token (the plain step's residual counts in a drafting round until drafting rounds are measured)."""
    cost = CostModel(((1, 1.0), (5, 1.2)))
    clock = [0.0]
    timed = CountedGoodput(cost, positions=4, draft_s={1: 0.1}, clock=lambda: clock[0])
    _run_rounds(timed, 40, plain_s=1.0, draft_s=lambda w: 20.0, clock=clock)
    assert timed.answers[0] and not any(timed.answers[1:])
    assert timed.residual("draft", 1) == pytest.approx(18.7) and timed.residual("plain", 1) == pytest.approx(0.0)
    blind = CountedGoodput(cost, positions=4, draft_s={1: 0.1})
    _run_rounds(blind, 40, plain_s=1.0, draft_s=lambda w: 20.0, clock=clock)
    assert all(blind.answers)

    dear = CostModel(((1, 1.0), (5, 6.0)))
    unseen = CountedGoodput(dear, positions=4, draft_s={1: 0.5}, clock=lambda: clock[0])
    _run_rounds(unseen, 40, plain_s=3.0, draft_s=lambda w: 2.0 + 0.1 + dear.verify_s(1 + w), clock=clock)
    assert not any(unseen.answers[:ROUND_SAMPLES]) and all(unseen.answers[ROUND_SAMPLES:])
    assert unseen.chosen[4] == 40 - ROUND_SAMPLES
    assert unseen.residual("plain", 1) == pytest.approx(2.0) and unseen.residual("draft", 1) == pytest.approx(2.0)
    assert not CountedGoodput(dear, positions=4, draft_s={1: 0.5}).drafts(1)


def test_rounds_slowed_by_something_else_are_outliers():
    """Plain steps of 1 s, with a run of five 100 s gaps among them (newcomers' prefills as rows
    finish together, the caller's work between generations): the residual stays 0 and whether
    drafting pays does not change. A residual counts only once ROUND_SAMPLES rounds are in."""
    cost = CostModel(((1, 1.0), (5, 6.0)))
    clock = [0.0]
    policy = CountedGoodput(cost, positions=4, draft_s={1: 0.5}, clock=lambda: clock[0])
    for k in range(40):
        policy.drafts(1)
        clock[0] += 100.0 if 3 <= k < 8 else 1.0
        if k < ROUND_SAMPLES - 1:
            assert policy.timer.residuals["plain"] == {}
    assert policy.residual("plain", 1) == pytest.approx(0.0) and not any(policy.answers)
    assert len(policy.timer.windows["plain"][1]) == ROUND_WINDOW


def test_profile_loop_measures_a_plain_step_and_leaves_no_trace():
    from dflash2.policy import profile_loop

    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4)
    whole = profile_loop(drafter, target, rows=1, context=8, steps=5)
    assert 0 < whole < 1  # the pass a plain step makes is taken off (here one dearer than the whole step):
    assert profile_loop(drafter, target, rows=1, context=8, steps=5, cost=CostModel(((1, 10.0),))) == 0.0
    assert 0 < profile_loop(drafter, target, rows=3, context=8, steps=5) < 1
    prompt = [3, 1, 4, 1, 5]
    out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=8)
    assert out.sequences[0].tolist() == hf_greedy(target, prompt, 8)


def test_a_draft_after_skipped_rounds_does_not_set_the_drafting_time():
    """The first draft after skipped rounds also reads their target features: its seconds (here 100×
    the rest) are not the drafting time, and the probe's second round measures it instead."""
    policy = CountedGoodput(CostModel(((1, 1.0), (8, 1.1))), positions=4, draft_s={1: 50.0}, explore=1.0,
                            explore_min=1.0)  # (probes at their share even where hope loses)
    sure, times = Draft(torch.arange(4)), []
    for _ in range(200):
        if policy.drafts(1):
            seconds = 10.0 if policy.answers[-2:-1] == [False] else 0.1  # after a skip: the backlog is read
            times.append(seconds)
            [w] = GoodputPolicy.widths(policy, SealedDrafts([sure]), seconds)
            policy.observe(sure, w, list(range(w)))
    assert not policy.answers[0] and 10.0 in times and policy.draft_s == {1: pytest.approx(0.1)}
    assert all(policy.answers[-50:])  # drafting again, at the drafting time measured without the backlog


def test_a_generations_first_draft_is_not_timed():
    """The first drafting round of spec_generate also reads the prompt's features: the policy gets no
    drafting time for it (None), and the rounds after it theirs."""
    class Times(ScriptedWidths):
        def widths(self, drafts, draft_s):
            self.times = [*getattr(self, "times", []), draft_s]
            return super().widths(drafts, 0.0)

    target, drafter = tiny_target("qwen3"), tiny_drafter("qwen3", 4, selector="walk")
    policy = Times([1], [True, False])  # the first round skips: the first draft comes after it
    spec_generate(drafter, target, torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=12, policy=policy)
    assert policy.times[0] is None and len(policy.times) >= 2 and all(t > 0 for t in policy.times[1:])
    timed = GoodputPolicy(CostModel(((1, 1.0),)), 3, draft_s={1: 0.5})
    timed.widths(SealedDrafts([Draft(torch.arange(3))]), None)
    assert timed.draft_s == {1: 0.5}  # an untimed round leaves the drafting time as it was
