"""Pure helpers of the experiment scripts whose numbers docs/results.md reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


SOURCE = '''import os
from typing import List


def plain(x):
    """No annotation, no example."""
    return x


def typed(x: int) -> int:
    """Annotated."""
    return x


class K:
    def method(self, xs):
        """Has an example.

        >>> K().method([1])
        [1]
        """
        return xs
'''


def test_package_functions_keep_what_the_predicate_asks_for():
    bp = _load("experiments/embedded/build_prompts.py")
    typed = bp.package_functions(SOURCE, bp.annotated)
    doc = bp.package_functions(SOURCE, bp.has_doctest)
    assert len(typed) == 1 and "def typed(x: int) -> int:" in typed[0] and "return x" not in typed[0]
    assert len(doc) == 1 and doc[0].startswith("import os\nfrom typing import List\n\n\ndef method(self, xs):")
    assert doc[0].rstrip().endswith('"""')  # signature and docstring, no body, dedented to the top level


def test_sampling_analysis_acceptance_of_each_q():
    """α = Σ min(p̃, q) over the candidates: the recorder's numbers for a hand-made round, each variant's q a
    distribution, no q above the ceiling (p̃'s mass on the candidates), and the expected commit of a round."""
    import torch

    from dflash2.decoding.sampling import SamplingParams
    from dflash2.decoding.verify import Draft

    sa = _load("experiments/embedded/sampling_analysis.py")
    q = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]], dtype=torch.float64)
    for name, v in sa.q_variants(q).items():
        torch.testing.assert_close(v.sum(-1), torch.ones(2, dtype=torch.float64), msg=name)
    assert sa.q_variants(q)["one-hot on q's top candidate"].tolist() == [[1, 0, 0], [1, 0, 0]]
    # logits over a vocabulary of 4 whose p̃ (T = 1) is [0.4, 0.3, 0.2, 0.1] at both positions
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    logits = p.log().expand(3, 4)
    recorder = sa.AcceptanceRecorder(SamplingParams(1.0))
    recorder.inner = lambda *args: "verdict"
    draft = Draft(torch.tensor([0, 1]), torch.tensor([[0, 1, 2], [1, 0, 3]]), q)
    assert recorder(draft, logits, None, None) == "verdict"  # the verifier's own answer is passed through
    [row] = recorder.rows
    assert row["walk q (T = 1)"] == pytest.approx([0.4 + 0.2 + 0.1, 0.3 + 0.4])  # Σ min(p̃(c_k), q_k)
    assert row["ceiling: p̃'s mass on the K candidates"] == pytest.approx([0.9, 0.8])
    assert all(a <= c + 1e-12 for v in row.values() for a, c in zip(v, row["ceiling: p̃'s mass on the K candidates"]))
    [walk] = [s for s in sa.summarize_acceptance(recorder.rows) if s["q"] == "walk q (T = 1)"]
    assert walk["alpha_1"] == pytest.approx(0.7) and walk["expected_commit"] == pytest.approx(1 + 0.7 + 0.7 * 0.7)
