"""Pure helpers of the experiment scripts whose numbers docs/results.md reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tau_by_segment_bins_each_round_by_where_it_starts():
    tau_by_segment = _load("experiments/embedded/eval_humaneval.py").tau_by_segment
    # prompt 1: rounds start at offsets 1, 4, 8, 9 (the first new token is the prefill's)
    # prompt 2: rounds start at 1, 9
    got = tau_by_segment([[3, 4, 1, 2], [8, 8]], segment=8, max_new_tokens=20)
    assert got == [(3 + 4 + 8) / 3, (1 + 2 + 8) / 3, None]
    # a round starting past the last full stretch lands in the last bin
    assert tau_by_segment([[16, 5]], segment=8, max_new_tokens=17) == [16.0, None, 5.0]


def test_acceptance_curve_counts_rounds_with_at_least_k_drafts():
    curve = _load("experiments/embedded/eval_humaneval.py").acceptance_curve
    assert curve([1, 2, 4], block_size=4) == [2 / 3, 1 / 3, 1 / 3]
