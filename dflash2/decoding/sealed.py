"""What a verification policy may see of a round's drafts: `SealedDrafts`.

At T > 0 a drafted token d_t is a draw, and verification keeps the target's distribution only if the
decision to verify d_t does not depend on d_t's value. c_t is computed before d_t is drawn, but
c_{t+1} may read d_t (DSpark's head reads the token before each position). So the only legal widths
are stopping rules: extend from t to t + 1 tokens on c_0..c_t alone.

`SealedDrafts` enforces that through its interface: it shows each row's length, and `confidence(t,
rows)` answers only for rows already committed to verify at least t tokens (`commit(rows, n)`); the
widths a policy returns may not fall below what it committed, and the drafted tokens are not shown.
Any policy that passes through it is therefore a stopping rule and lossless; asking for c_{t+1} before
deciding on d_t raises ValueError. Token trees have no confidences (their nodes are chosen, not
drawn): a tree's widths may depend on anything.
"""

from __future__ import annotations

import math

from dflash2.decoding.tree import TokenTree


class SealedDrafts:
    """A round's drafts as a policy sees them. lengths[r]: row r's drafted tokens (a tree: nodes);
    kind: "path" or "tree"; has_confidence[r]: whether row r's drafter filled Draft.confidence."""

    __slots__ = ("kind", "lengths", "has_confidence", "_confidence", "_committed")

    def __init__(self, drafts: list) -> None:
        self.kind = "tree" if drafts and isinstance(drafts[0], TokenTree) else "path"
        self.lengths = tuple(int(d.tokens.shape[0]) for d in drafts)
        values = [None if self.kind == "tree" or d.confidence is None else d.confidence.detach().double().cpu().tolist()
                  for d in drafts]
        self._confidence = values
        self.has_confidence = tuple(v is not None for v in values)
        self._committed = [0] * len(drafts)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def committed(self, row: int) -> int:
        """The tokens row `row` is committed to verify (at least)."""
        return self._committed[row]

    def commit(self, rows: list[int], n: int) -> None:
        """Each of `rows` verifies at least n tokens (n <= its length; commitments only grow)."""
        for r in rows:
            if not 0 <= n <= self.lengths[r]:
                raise ValueError(f"a policy committed row {r} to {n} tokens; it drafted {self.lengths[r]}")
            self._committed[r] = max(self._committed[r], n)

    def confidence(self, t: int, rows: list[int]) -> list[float]:
        """c_t (0-based position t) of each of `rows`, NaN where a row has no confidences. Only for rows
        committed to at least t tokens: c_t may read d_{t-1}, whose own verification must not depend on it."""
        values = []
        for r in rows:
            if self._committed[r] < t:
                raise ValueError(f"a policy read the confidence at position {t} of row {r} before committing to verify "
                                 f"the {t} tokens before it (committed {self._committed[r]}): a width must be a "
                                 "stopping rule (dflash2.decoding.sealed)")
            if t >= self.lengths[r]:
                raise ValueError(f"row {r} drafted {self.lengths[r]} tokens; there is no position {t}")
            conf = self._confidence[r]
            values.append(math.nan if conf is None else conf[t])
        return values

    def check(self, widths: list[int]) -> list[int]:
        """The policy's widths as ints, each within [committed, length]."""
        widths = [int(w) for w in widths]
        if len(widths) != self.rows or any(not c <= w <= n for w, c, n in zip(widths, self._committed, self.lengths)):
            raise ValueError(f"the policy's widths {widths} do not fit the drafts' lengths {list(self.lengths)} "
                             f"and its commitments {self._committed}")
        return widths


__all__ = ["SealedDrafts"]
