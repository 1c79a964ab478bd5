"""Parity with vLLM 0.32's own code (experiments/vllm_parity): our exported DFlash-2, DSpark and LiLiCorr
drafters load into vLLM's model classes with every parameter set, and vLLM's CPU code gives our
convolutions, candidates, scores, paths and confidences to 1e-5. Two mutants of an exported file must
be caught. Skipped without DFLASH2_VLLM_PYTHON (CI never has vLLM)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

VLLM = os.environ.get("DFLASH2_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM, reason="set DFLASH2_VLLM_PYTHON to the python of a venv with vLLM 0.32")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "vllm_parity"))


def test_every_variant_agrees_with_vllms_code(tmp_path):

    import run as parity

    cases, ours = parity.cases(tmp_path)
    rows = parity.compare(ours, parity.theirs(VLLM, cases, tmp_path))  # a failing worker raises with its stderr
    assert all(r["within_tolerance"] for r in rows.values()), rows


def test_mutated_exports_are_caught(tmp_path):
    """Swap the pre/post halves of one convolution kernel (a plausible export bug: both are [taps, H]),
    and drop DSpark's confidence head bias: the first breaks the conv agreement, the second leaves a
    vLLM parameter unset (or is refused by load_weights)."""
    from safetensors.torch import load_file, save_file

    import run as parity

    cases, ours = parity.cases(tmp_path)
    names = list(cases)
    conv_case, dspark_case = names[0], names[1]
    path = Path(cases[conv_case]["dir"]) / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("attention_conv.base_kernel"))
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    path = Path(cases[dspark_case]["dir"]) / "model.safetensors"
    tensors = load_file(path)
    del tensors[next(k for k in tensors if k.startswith("confidence_head.") and k.endswith("bias"))]
    save_file(tensors, path, metadata={"format": "pt"})
    row = parity.compare({conv_case: ours[conv_case]},
                         parity.theirs(VLLM, {conv_case: cases[conv_case]}, tmp_path))[conv_case]
    assert row["conv"] > 1e-3 and not row["within_tolerance"], row
    try:
        theirs = parity.theirs(VLLM, {dspark_case: cases[dspark_case]}, tmp_path)
    except RuntimeError:  # refused by load_weights: caught too
        return
    row = parity.compare({dspark_case: ours[dspark_case]}, theirs)[dspark_case]
    assert row["unset_by_load_weights"] and not row["within_tolerance"], row
