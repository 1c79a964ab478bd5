"""How a GoodputPolicy learns what its cost model misses: it times every round it decides.

The model prices a round from parts profiled apart (the pass, the drafting, the loop's own time) and
misses what it does not model: a tree's masks, per-row bookkeeping at many rows, a machine slower than
at warm-up. `RoundTimer` times each round from one `drafts()` call to the next and keeps, per kind
("plain", "draft") and number of rows, the lower quartile of the last ROUND_WINDOW residuals (measured
minus modelled seconds): a gap that also held something else (a newcomer's prefill, the caller's work)
only adds time, and the lower quartile drops up to three in four of them. It also keeps, per number of
rows, the lower median of the last DRAFT_WINDOW probes' cost above the plain steps they replaced,
seeded with the model's price for the first probe, so that one probe slowed a thousandfold (a compile
of a new shape) counts only once a second confirms it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from dflash2.policy.cost import by_rows

DRAFT_WINDOW = 5  # drafting rounds (and probes) per number of rows whose lower median is expected
ROUND_WINDOW = 16  # rounds per kind (plain, drafting) and number of rows whose lower-quartile residual counts
ROUND_SAMPLES = 4  # plain steps at a number of rows measured before their residual counts (a drafting round's: from the first)


@dataclass
class _Round:
    """A round being timed: its kind ("plain", "draft"), rows, the model's seconds for it (None: not a
    sample; a drafting round's is set once its widths are known), when it started, and whether it is one
    of a probe's rounds."""

    kind: str
    rows: int
    modelled: float | None
    start: float
    probe: bool = False


class RoundTimer:
    """Residuals and probe costs as measured (module docstring). clock=None: nothing is timed."""

    def __init__(self, clock: Callable[[], float] | None) -> None:
        self.clock = clock
        # kind → rows → the last residuals, and their lower quartile
        self.windows: dict[str, dict[int, deque]] = {"plain": {}, "draft": {}}
        self.residuals: dict[str, dict[int, float]] = {"plain": {}, "draft": {}}
        self.round: _Round | None = None  # the round in flight
        # rows → the seconds the last probes took above plain steps, and their lower median
        self.probe_windows: dict[int, deque] = {}
        self.probe_s: dict[int, float] = {}
        # the probe in flight: [rows, seconds above plain so far, rounds left, the model's seconds above plain]
        self.probe_open: list | None = None

    def now(self) -> float | None:
        return None if self.clock is None else self.clock()

    def tick(self, now: float | None, kind: str | None, rows: int, modelled: float | None,
             plain_cost: Callable[[int], float]) -> tuple[bool, bool]:
        """Close the round in flight at `now` (its residual joins its window when it is a sample) and start the
        next one then (kind None: none); one reading serves both, so the policy's own seconds belong to the
        round it decides. Returns (whether the round closed was a plain step's sample at `rows` rows, whether
        the estimates changed enough to judge again)."""
        if now is None:
            return False, False
        done, changed = self.round, False
        if done is not None and done.probe and self.probe_open is not None:
            self._close_probe_round(now - done.start, plain_cost)
        if done is not None and done.modelled is not None:
            window = self.windows[done.kind].setdefault(done.rows, deque(maxlen=ROUND_WINDOW))
            window.append(now - done.start - done.modelled)
            if len(window) >= (1 if done.kind == "draft" else ROUND_SAMPLES):
                low = sorted(window)[(len(window) - 1) // 4]  # the lower quartile: a gap that held more only adds
                before = self.residuals[done.kind].get(done.rows)
                self.residuals[done.kind][done.rows] = low
                # (not for a plain step's residual that moved by less than a twentieth of the step)
                changed = done.kind == "draft" or before is None or abs(low - before) > 0.05 * max(done.modelled, 1e-12)
        self.round = None if kind is None else _Round(kind, rows, modelled, now, self.probe_open is not None)
        sampled = done is not None and done.modelled is not None and done.kind == "plain" and done.rows == rows
        return sampled, changed

    def _close_probe_round(self, seconds: float, plain_cost: Callable[[int], float]) -> None:
        """A probe's round took `seconds`: its time above a plain step counts toward the probe's cost, which
        joins the window of its number of rows after the probe's last round."""
        probe = self.probe_open
        rows = probe[0]
        probe[1] += max(0.0, seconds - plain_cost(rows))
        probe[2] -= 1
        if probe[2] == 0:
            window = self.probe_windows.setdefault(rows, deque([probe[3]], maxlen=DRAFT_WINDOW))
            window.append(probe[1])
            self.probe_s[rows] = sorted(window)[(len(window) - 1) // 2]  # the lower median
            self.probe_open = None

    def open_probe(self, rows: int, rounds: int, modelled: float) -> None:
        if self.clock is not None:
            self.probe_open = [rows, 0.0, rounds, modelled]

    def residual(self, kind: str, rows: int) -> float:
        """What a round of `kind` at `rows` rows took beyond the model (read like by_rows); a drafting round's
        is a plain step's until drafting rounds are measured; 0 before any."""
        table = self.residuals[kind] or (self.residuals["plain"] if kind == "draft" else {})
        return by_rows(table, rows) or 0.0

    def probe_cost(self, rows: int, modelled: float) -> float:
        """A probe's seconds above the plain steps it replaces: as measured, else `modelled`."""
        measured = by_rows(self.probe_s, rows)
        return modelled if measured is None else measured

    def window_full(self, rows: int) -> bool:
        """Whether a plain step's residual window at `rows` rows is full."""
        window = self.windows["plain"].get(rows)
        return window is not None and len(window) == ROUND_WINDOW
