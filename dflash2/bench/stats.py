"""The statistics every bench table reports (ours and the servers'): per-prompt ratios measured back
to back, their median and quartiles, and a method's tokens per second over its runs. `items` are a
method's (repetition, prompt, Run) triples; `base` maps (repetition, prompt) to the baseline's Run."""

from __future__ import annotations

import statistics


def ratios(items, base: dict) -> list[float]:
    """tokens/s(run) / tokens/s(the base's run of the same prompt and repetition, measured back to back)."""
    found = []
    for rep, p, r in items:
        b = base.get((rep, p))
        if b is not None and r.seconds > 0 and b.seconds > 0:
            found.append((r.new_tokens / r.seconds) / (b.new_tokens / b.seconds))
    return found


def median_ratio(items, base: dict) -> float | None:
    """Median over (repetition, prompt) of the per-prompt ratios against the base."""
    found = ratios(items, base)
    return statistics.median(found) if found else None


def quartiles(values: list[float]) -> tuple[float, float] | None:
    """First and third quartiles of per-prompt ratios (the spread behind the median)."""
    values = sorted(values)
    if len(values) < 2:
        return (values[0], values[0]) if values else None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def tokens_per_s(items) -> float:
    """Tokens per second over a method's runs (its total tokens over its total time)."""
    seconds = sum(r.seconds for _, _, r in items)
    return sum(r.new_tokens for _, _, r in items) / seconds if seconds else 0.0


__all__ = ["median_ratio", "quartiles", "ratios", "tokens_per_s"]
