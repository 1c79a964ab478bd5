"""Verification policies: how many of each row's drafted tokens the target checks this round.

Verifying n of a row's L drafted tokens costs a target pass over n + 1 tokens and commits, in
expectation, 1 + Σ_{t<=n} s_t tokens (s: the survival curve, `dflash2.policy.confidence`). The loops
truncate each draft to its width before verifying it, so losslessness never depends on the policy.

    FixedWidth     verify everything drafted (what the loops do without a policy)
    GoodputPolicy  max over widths n_r of  Σ_r (1 + Σ_{t<=n_r} s_r,t) / (draft_s + verify_s(Σ_r (n_r + 1)))
                   (the globally largest s_r,t fill any total best: sort the slots once, scan the totals)
    TreeGoodputPolicy  the first n nodes of each row's best-first tree, n chosen from each node index's
                   observed acceptance rate

`drafts` says whether to draft at all. Confidences come from `Draft.confidence`, calibrated online;
drafts without them are read at a constant raw value, so the calibrator learns each position's rate.
`CostModel` holds verify seconds against tokens per pass (piecewise linear between measured points).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from itertools import accumulate
from typing import Callable

import torch

from dflash2.policy.confidence import Calibrator, NodeRates, RoundCounts, survival
from dflash2.policy.cost import CostModel, by_rows
from dflash2.policy.timing import DRAFT_WINDOW, RoundTimer
from dflash2.decoding.sealed import SealedDrafts
from dflash2.decoding.verify import Draft

# The raw value a draft without confidences is read at (one calibrator bin per position): optimistic, so that a
# policy starts by drafting and verifying as the fixed rows do and narrows only on evidence (a pessimistic prior
# would skip the drafts that could prove it wrong).
UNKNOWN_CONFIDENCE = 0.9
SKIPPED = -1  # GoodputPolicy.chosen's key for the row-rounds of a round that drafted nothing
QUIET_ROUNDS = 30  # skipped rounds at most that GoodputPolicy answers without judging or timing them (drafts())
HOPE_Z = 2.0  # the optimistic tokens per round a probe needs: this many standard errors above the estimate


def hopeful(curve: list[float], rounds: RoundCounts, strength: float) -> list[float]:
    """An expected curve (a round's expected accepted tokens at each width: the sum of its first values)
    made optimistic: scaled so that a full-width round accepts E + HOPE_Z·sqrt(v / n) + 1/n tokens, at
    most 1 per value. E: the curve's sum; n: the full-width rounds observed plus the prior's `strength`;
    v: their accepted tokens' sample variance, at least Σ c(1 − c) over the curve's values (what
    independent positions would give: the floor while few rounds are in).

    One margin on the round's total, not one per position: a margin on each of 15 node rates, summed,
    claims every position lucky at once (tokens per round several standard errors up, about √15 × 2
    for independent nodes), and kept a policy probing a drafter that a round's own spread had shown to
    lose."""
    expected = sum(curve)
    n = rounds.n + strength
    floor = sum(c * (1 - c) for c in curve)
    spread = max(rounds.variance() or 0.0, floor)
    aim = expected + HOPE_Z * math.sqrt(spread / n) + 1 / n
    if expected <= 0:
        return [min(1.0, aim / len(curve))] * len(curve)
    return [min(1.0, c * aim / expected) for c in curve]


class FixedWidth:
    """Verify every drafted token (the loops' behaviour without a policy)."""

    def drafts(self, rows: int) -> bool:
        return True

    def widths(self, drafts: SealedDrafts, draft_s: float) -> list[int]:
        return list(drafts.lengths)

    def observe(self, draft: Draft, verified: int, accepted: list[int]) -> None:
        pass


class GoodputPolicy:
    """Widths that maximise expected committed tokens per second of the round (module docstring), and before
    each round whether drafting pays at all (`drafts`): a drafting round costs its drafting (a low median of
    the last rounds at these rows), the pass over the widths and the loop's own time, and commits
    1 + Σ_t s̄_t per row; a plain step costs verify_s(rows) and commits one. Every round is timed (`timer`)
    and what the model missed is added back. Skipped stretches are broken by probes whose extra cost is at
    most `explore` × the seconds skipped (halved by each probe that confirms skipping, down to
    `explore_min`). padded=True prices `spec_generate_batch`'s [rows, 1 + widest] pass with one cap for
    every row; clock=None times nothing. docs/architecture.md ("The adaptive policy") gives each rule's reason."""

    capped = False  # True: one width for every row (best_cap) even in an unpadded pass (TreeGoodputPolicy)
    quiet_rounds = QUIET_ROUNDS  # the longest quiet stretch (0: every call judges and times its round)

    def __init__(self, cost: CostModel, positions: int, calibrator: Calibrator | None = None,
                 padded: bool = False, explore: float = 0.05, explore_min: float = 0.002,
                 draft_s: dict[int, float] | None = None, loop_s: dict[int, float] | None = None,
                 clock: Callable[[], float] | None = time.perf_counter) -> None:
        if not 0 < explore_min <= explore <= 1:
            raise ValueError(f"GoodputPolicy needs 0 < explore_min <= explore <= 1, got {explore_min}, {explore}")
        self.cost, self.padded, self.positions = cost, padded, positions
        self.calibrator = calibrator or Calibrator(positions)
        self.explore, self.explore_min = explore, explore_min
        self.draft_s: dict[int, float] = dict(draft_s or {})  # rows → the drafting seconds of a round expected
        self._draft_window = {rows: deque([s], maxlen=DRAFT_WINDOW) for rows, s in self.draft_s.items()}
        self.loop_s: dict[int, float] = dict(loop_s or {})  # rows → the loop's own seconds in a round
        self._share = explore  # of the skipped seconds that the next probe may cost above a plain step
        self.skipped_s = 0.0  # plain steps' seconds since the last drafting round (from the cost model)
        # rows → (whether drafting pays, a plain step's seconds, a probe's seconds above it), until the estimates change
        self._pays: dict[int, tuple[bool, float, float]] = {}
        self._probing = False  # this round drafts to learn: verify all of it
        self._stale = False  # rounds were skipped since the last draft: the next one reads their features too
        self._probe_again = False  # the probe after skipped rounds is followed by one that times drafting alone
        self.chosen: Counter[int] = Counter()  # width → row-rounds verified at it (SKIPPED: rounds not drafted)
        self.judged = 0  # the rounds judged in full (drafts() outside a quiet stretch)
        self.timer = RoundTimer(clock)  # every round timed: what the model misses (dflash2.policy.timing)
        # quiet stretches (drafts()): rounds shown to skip as surely, rounds left unjudged, their rows, plain seconds
        self._skips_ahead = self._quiet = self._quiet_rows = 0
        self._quiet_plain_s = 0.0

    def _raw(self, draft: Draft) -> torch.Tensor:
        """A draft's raw confidences [L] (UNKNOWN_CONFIDENCE where the drafter gives none)."""
        if draft.confidence is None:
            return torch.full((draft.tokens.shape[0],), UNKNOWN_CONFIDENCE, dtype=torch.float64)
        return draft.confidence.detach().cpu().double()

    def expected_survival(self) -> list[float]:
        """s̄ [positions]: the chance that every position up to t is accepted, from expected_rates."""
        return list(accumulate(self.expected_rates(self.calibrator.seen.shape[0]), lambda x, y: x * y))

    def _round_rate(self, curves: list[list[float]], draft_s: float,
                    floor: list[int] | None = None) -> tuple[list[int], float]:
        """The widths for these curves (a row's expected accepted tokens at each width: the sum of its
        first `width` values), at least `floor`, and their expected committed tokens per second."""
        rows = len(curves)
        fixed = draft_s + self.loop_cost(rows) + self.residual("draft", rows)
        choose = best_cap if self.padded or self.capped else best_widths
        widths = choose(curves, lambda tokens: fixed + self.cost.verify_s(tokens), floor)
        gain = rows + sum(sum(c[:w]) for c, w in zip(curves, widths))
        return widths, gain / max(fixed + self.cost.verify_s(self._pass_tokens(widths)), 1e-12)

    def _pass_tokens(self, widths: list[int]) -> int:
        """The tokens of the target pass that verifies these widths: every row padded to the widest
        (padded, or one cap for all: capped), else each row's anchor and its own width."""
        rows = len(widths)
        return rows * (max(widths, default=0) + 1) if self.padded or self.capped else rows + sum(widths)

    def _drafting_model(self, draft_s: float, widths: list[int]) -> float:
        """A drafting round's seconds by the model alone (no residual): drafting, the loop, the pass."""
        return draft_s + self.loop_cost(len(widths)) + self.cost.verify_s(self._pass_tokens(widths))

    def _plain_model(self, rows: int) -> float:
        """A plain step's seconds by the model alone (no residual): the pass and the loop."""
        return self.cost.verify_s(rows) + self.loop_cost(rows)

    def loop_cost(self, rows: int) -> float:
        """The loop's own seconds in a round at `rows` rows, outside the target pass and the drafting
        (choosing tokens, the cache's bookkeeping): from `loop_s`, read like draft_cost; 0 without it."""
        return by_rows(self.loop_s, rows) or 0.0

    def residual(self, kind: str, rows: int) -> float:
        """What a round of `kind` ("plain" or "draft") at `rows` rows took beyond the model, as measured."""
        return self.timer.residual(kind, rows)

    def plain_cost(self, rows: int) -> float:
        """A plain step's seconds at `rows` rows: the pass, the loop's own time and the measured residual."""
        return self._plain_model(rows) + self.residual("plain", rows)

    def _time_round(self, now: float | None, kind: str | None, rows: int, modelled: float | None) -> bool:
        """The timer's tick (RoundTimer.tick); estimates that changed are judged again. Returns whether the round
        closed was a plain step's sample at `rows` rows."""
        sampled, changed = self.timer.tick(now, kind, rows, modelled, self.plain_cost)
        if changed:
            self._pays.clear()
        return sampled

    def draft_cost(self, rows: int) -> float | None:
        """The expected drafting seconds of a round with `rows` rows: as measured at that number, else
        at the next larger number measured (drafting fewer rows costs no more), else the largest
        measured scaled up linearly; None before any drafting round."""
        return by_rows(self.draft_s, rows)

    def drafts(self, rows: int) -> bool:
        if self._quiet and rows == self._quiet_rows:  # settled skipping: what the full call would answer
            self._quiet -= 1
            self.skipped_s += self._quiet_plain_s
            self.chosen[SKIPPED] += rows
            return False
        self._quiet = 0  # (a stretch ends at another number of rows: what it showed held only at its own)
        now = self.timer.now()
        sampled = self._time_round(now, None, rows, None)  # the round before this one ends here
        self.judged += 1
        drafting = self._drafts(rows)
        if not drafting and self._skips_ahead and (now is None or sampled and self.timer.window_full(rows)):
            # the next rounds skip too, whatever they would time: answered without judging or timing them
            # (this round is not timed either; the first full call after them opens a round, the next closes it)
            self._quiet, self._quiet_rows, self.timer.round = self._skips_ahead, rows, None
            return False
        # a drafting round's model is known once its widths are (widths()); a plain step's now
        self._time_round(now, "draft" if drafting else "plain", rows, None if drafting else self._plain_model(rows))
        return drafting

    def _drafts(self, rows: int) -> bool:
        self._skips_ahead = 0  # (set below where this round skips and the next ones would as surely)
        draft_s = self.draft_cost(rows)
        if draft_s is None or self._probe_again:  # no drafting time measured yet, or a probe's second round
            self._probing, self._probe_again = True, False
            return True
        if rows not in self._pays:  # (a skipped round changes no estimate: skipping costs no recomputation)
            _, rate = self._round_rate([self.expected_curve()] * rows, draft_s)
            plain_s = self.plain_cost(rows)
            # a probe's price above a plain step by the model alone: a drafting round's residual, which one
            # slow round can set, would also price the probes that measure it again
            probe_extra = self._drafting_model(draft_s, [self.positions] * rows) - self._plain_model(rows)
            plain_rate = rows / max(plain_s, 1e-12)
            pays = rate > plain_rate  # (where it pays, hope is not asked: a drafting round recomputes this)
            hopeful = pays or self._round_rate([self.hopeful_curve()] * rows, draft_s)[1] > plain_rate
            self._pays[rows] = (pays, plain_s, probe_extra, hopeful)
        pays, plain_s, probe_extra, hopeful = self._pays[rows]
        if pays:
            self.skipped_s, self._share = 0.0, self.explore
            return True
        self.skipped_s += plain_s
        share = self._share if hopeful else self.explore_min  # nothing to learn where even hope loses
        rounds = 2 if self._stale else 1
        if self.timer.probe_cost(rows, probe_extra * rounds) > share * self.skipped_s:
            self.chosen[SKIPPED] += rows
            self._stale = True
            # how many of the next rounds skip as surely, nothing changing before them (the same sums, in the same order)
            limit, skipped = self.timer.probe_cost(rows, probe_extra * 2), self.skipped_s
            while self._skips_ahead < self.quiet_rounds and limit > share * (skipped := skipped + plain_s):
                self._skips_ahead += 1
            self._quiet_plain_s = plain_s
            return False
        # a probe: draft and verify it all, twice (the first round also reads the skipped rounds'
        # features, so only the second times drafting); the next may cost half the share
        self.skipped_s, self._share = 0.0, max(self._share / 2, self.explore_min)
        self._probing, self._probe_again = True, self._stale
        self.timer.open_probe(rows, rounds, probe_extra * rounds)
        return True

    def widths(self, drafts: SealedDrafts, draft_s: float | None) -> list[int]:
        self.check(drafts)
        rows = drafts.rows
        drafted = any(drafts.lengths)  # (else a skipped round, counted as SKIPPED)
        timed = draft_s is not None  # (None: the round's drafting also read a prompt's features)
        draft_s = draft_s if timed else self.draft_cost(rows) or 0.0
        sample = drafted and timed and not self._stale  # a drafting round timed alone
        if sample:  # its seconds join the window at its number of rows
            window = self._draft_window.setdefault(rows, deque(maxlen=DRAFT_WINDOW))
            window.append(draft_s)
            self.draft_s[rows] = sorted(window)[(len(window) - 1) // 2]  # the lower median
            self._pays.clear()
        self._stale = self._stale and not drafted
        if self._probing:  # a round drafted to learn: every position it drafted is observed
            self._probing = False
            widths = list(drafts.lengths)
        else:
            widths = self._stopping_widths(drafts, draft_s)
        if drafted:
            self.chosen.update(widths)
        if self.timer.round is not None and self.timer.round.kind == "draft":  # the round's model, when a sample
            self.timer.round.modelled = self._drafting_model(draft_s, widths) if sample else None
        return widths

    def _stopping_widths(self, drafts: SealedDrafts, draft_s: float) -> list[int]:
        """The goodput widths as a stopping rule (dflash2.decoding.sealed): row r verifies its token t only if the
        best widths, with its confidences up to t revealed and later positions at their expected rates,
        reach past t. Rows without confidences are known whole: for them it is the best widths at once."""
        lengths = drafts.lengths
        if not any(drafts.has_confidence):
            return self._round_rate(self.known_curves(lengths), draft_s)[0]
        rows, longest = drafts.rows, max(lengths)
        blind = self.calibrator.calibrate(torch.full((longest,), UNKNOWN_CONFIDENCE, dtype=torch.float64)).tolist()
        expected = self.expected_rates(longest)
        cond = [list((expected if sealed else blind)[:n]) for n, sealed in zip(lengths, drafts.has_confidence)]
        done, plan = [False] * rows, None
        for t in range(longest):
            alive = [r for r in range(rows) if not done[r] and t < lengths[r]]
            if not alive:
                break
            reveal = [r for r in alive if drafts.has_confidence[r]]
            for r, c in zip(reveal, drafts.confidence(t, reveal)):
                cond[r][t] = self.calibrator.calibrate_at(t, c)
            if reveal or plan is None:
                floor = [drafts.committed(r) for r in range(rows)]
                curves = [list(accumulate(c[: f if d else len(c)], lambda x, y: x * y)) for c, f, d in zip(cond, floor, done)]
                plan = self._round_rate(curves, draft_s, floor)[0]
            for r in alive:
                if plan[r] > t:
                    drafts.commit([r], t + 1)
                else:
                    done[r] = True
        return [drafts.committed(r) for r in range(rows)]

    def observe(self, draft: Draft, verified: int, accepted: list[int]) -> None:
        if verified:
            self.calibrator.observe(self._raw(draft), verified, len(accepted))
            self._pays.clear()

    # what a round's rows are expected to accept (TreeGoodputPolicy reads trees instead)
    def check(self, drafts: SealedDrafts) -> None:
        if drafts.kind == "tree":
            raise ValueError("GoodputPolicy sizes path drafts; for verify='tree' use TreeGoodputPolicy")

    def known_curves(self, lengths: tuple[int, ...]) -> list[list[float]]:
        """[rows][L_r] the survival of calibrated confidences for drafts without them (each position read at
        UNKNOWN_CONFIDENCE, so at its observed rate): verifying the first n accepts the sum of the first n."""
        if not any(lengths):
            return [[] for _ in lengths]
        blind = self.calibrator.calibrate(torch.full((max(lengths),), UNKNOWN_CONFIDENCE, dtype=torch.float64))
        s = survival(blind).tolist()
        return [s[:n] for n in lengths]

    def expected_rates(self, length: int) -> list[float]:
        """[length] each position's observed acceptance rate (the prior UNKNOWN_CONFIDENCE until it has
        seen about prior_strength tokens): what a confidence not revealed yet is expected to calibrate to."""
        m = self.calibrator.prior_strength
        rates = ((self.calibrator.accepted.sum(1) + m * UNKNOWN_CONFIDENCE) / (self.calibrator.seen.sum(1) + m)).tolist()
        return [rates[min(t, len(rates) - 1)] for t in range(length)]

    def expected_curve(self) -> list[float]:
        """[positions] what a round not drafted yet is expected to accept (drafts())."""
        return self.expected_survival()

    def hopeful_curve(self) -> list[float]:
        """[positions] expected_curve() made optimistic (`hopeful`, from the full-width rounds observed):
        where drafting loses even at it, a probe has little to learn, and probes keep to the least
        share (explore_min)."""
        return hopeful(self.expected_curve(), self.calibrator.full, self.calibrator.prior_strength)


class TreeGoodputPolicy(GoodputPolicy):
    """GoodputPolicy for token trees (spec_generate(..., verify="tree")): each row verifies the first
    n nodes of its best-first tree (its n most probable nodes), n chosen as GoodputPolicy chooses a
    width, from `rates` (NodeRates: a_i, how often node index i is accepted). A round verifying n
    nodes commits 1 + Σ_{i<n} a_i tokens per row in expectation. a_i starts at UNKNOWN_CONFIDENCE, so
    the first rounds verify whole trees and observe every index. One n for every row (best_cap): a
    tree's a_i need not fall with i (a sibling can be rarer than a grandchild), which best_widths'
    slot order needs. Per-round confidences are not read (a TokenTree carries none). positions: the
    most nodes a tree has (tree_nodes)."""

    capped = True

    def __init__(self, cost: CostModel, positions: int, rates: NodeRates | None = None, **kwargs) -> None:
        super().__init__(cost, positions, **kwargs)
        self.rates = rates or NodeRates(positions, UNKNOWN_CONFIDENCE)
        if self.rates.nodes < positions:
            raise ValueError(f"TreeGoodputPolicy(positions={positions}) needs NodeRates of as many nodes, got "
                             f"{self.rates.nodes}")

    def check(self, drafts: SealedDrafts) -> None:
        if max(drafts.lengths, default=0) > self.positions:
            raise ValueError(f"TreeGoodputPolicy(positions={self.positions}) got a draft of {max(drafts.lengths)} "
                             "nodes: give it positions=tree_nodes")

    def known_curves(self, lengths) -> list[list[float]]:
        rates = self.rates.rate_list()
        return [rates[:n] for n in lengths]

    def expected_curve(self) -> list[float]:
        return self.rates.rate_list()[: self.positions]

    def hopeful_curve(self) -> list[float]:
        return hopeful(self.expected_curve(), self.rates.full, self.rates.prior_strength)

    def observe(self, draft, verified: int, accepted: list[int]) -> None:
        if verified:
            self.rates.observe(verified, accepted)
            self._pays.clear()


def best_widths(curves: list[list[float]], round_s: Callable[[int], float], floor: list[int] | None = None) -> list[int]:
    """Survival curves (row r: s_r,1 >= s_r,2 >= ..., its drafted tokens) and the round's seconds as a
    function of the tokens verified → the widths n_r >= floor[r] maximising
    (Σ_r 1 + Σ_{t<=n_r} s_r,t) / round_s(Σ_r n_r + 1)."""
    rows = len(curves)
    floor = floor or [0] * rows
    slots = sorted(((s, r, t) for r, curve in enumerate(curves) for t, s in enumerate(curve) if t >= floor[r]),
                   key=lambda slot: (-slot[0], slot[1], slot[2]))
    counts = list(floor)  # slots taken so far, and at the best total
    gain = rows + sum(sum(c[:f]) for c, f in zip(curves, floor))
    base = rows + sum(floor)
    best, taken = gain / max(round_s(base), 1e-12), list(counts)
    for k, (s, r, t) in enumerate(slots, start=1):
        if t != counts[r]:  # a slot before it in the same row is not taken yet: curves must not rise
            raise ValueError(f"survival curve of row {r} rises at position {t}")
        counts[r] += 1
        gain += s
        rate = gain / max(round_s(base + k), 1e-12)
        if rate > best:
            best, taken = rate, list(counts)
    return taken


def best_cap(curves: list[list[float]], round_s: Callable[[int], float], floor: list[int] | None = None) -> list[int]:
    """best_widths for a padded pass: the cap W >= max(floor) maximising (Σ_r 1 + Σ_{t<=min(W, L_r)} s_r,t) /
    round_s(rows × (W + 1)) → each row's width min(W, L_r)."""
    rows = len(curves)
    # identical curves (every row of a tree policy's expected round; rows of full trees) summed once
    groups = Counter(tuple(c) for c in curves)
    longest = max(map(len, groups), default=0)
    gains = [float(rows)] * (longest + 1)  # gains[W]: the tokens a round capped at W commits in expectation
    for curve, k in groups.items():
        sums = list(accumulate(curve, initial=0.0))  # sums[w]: the curve's first w values
        sums += [sums[-1]] * (longest + 1 - len(sums))
        gains = [g + k * v for g, v in zip(gains, sums)]
    rates = [g / max(round_s(rows * (cap + 1)), 1e-12) for cap, g in enumerate(gains)]
    low = max(floor, default=0) if floor else 0
    best = max(range(low, longest + 1), key=rates.__getitem__)  # the first best: the narrowest on a tie
    return [min(best, len(c)) for c in curves]


__all__ = ["FixedWidth", "GoodputPolicy", "TreeGoodputPolicy", "best_cap", "best_widths", "hopeful"]
