"""Parity with vLLM's own reading of the published attention fields: every layout of
tests/drafter/test_published_semantics.py is resolved by vLLM 0.32's `_resolve_layer_attention` (its
`qwen3_dflash.py`, run in the vLLM venv that DFLASH2_VLLM_PYTHON names) and must give each layer the
(window, causal) dflash2 reads. Skipped without that venv (CI never has one)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dflash2.drafter.reference_format import config_from_reference
from tests.drafter.test_published_semantics import LAYOUTS, reference_config

VLLM = os.environ.get("DFLASH2_VLLM_PYTHON")

RESOLVE = r"""
import json, sys, types
from unittest import mock
from transformers import Qwen3Config
import vllm.model_executor.models.qwen3_dflash as q

out = {}
for name, cfg in json.load(sys.stdin).items():
    config = Qwen3Config(**cfg)  # as vLLM builds a draft's hf_config from its config.json (model_type qwen3)
    with mock.patch.object(q, "get_current_vllm_config",
                           return_value=types.SimpleNamespace(use_v2_model_runner=True)):  # mixed layers need it
        try:
            out[name] = [list(q._resolve_layer_attention(config, i)) for i in range(cfg["num_hidden_layers"])]
        except ValueError as error:  # vLLM refuses the layout
            out[name] = f"refused: {error}"
print(json.dumps(out))
"""


@pytest.mark.skipif(not VLLM, reason="set DFLASH2_VLLM_PYTHON to the python of a venv with vLLM 0.32")
def test_every_layout_resolves_as_vllm_resolves_it():
    configs = {name: reference_config(2, fields) for name, fields in LAYOUTS.items()}
    done = subprocess.run([VLLM, "-c", RESOLVE], input=json.dumps(configs), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    differ = {}
    for name, cfg in configs.items():
        ours = [[window, causal] for causal, window in config_from_reference(reference_config(2, LAYOUTS[name])).attention_layout]
        if ours != theirs[name]:
            differ[name] = {"dflash2": ours, "vllm": theirs[name]}
    assert set(differ) == set(KNOWN), json.dumps(differ, indent=1)
    for name, why in KNOWN.items():
        assert differ[name]["vllm"] == why[0], differ[name]


# Where vLLM's reading differs from the reference's (z-lab/dflash through transformers' Qwen3Config), which
# dflash2 follows: what vLLM gives, and why dflash2 keeps the reference's reading.
KNOWN = {
    "sliding-without-use_sliding_window": (
        "refused: DFlash sliding attention requires a window size configured in dflash_config.swa_window_size or "
        "the top-level sliding_window.",
        "Qwen3Config drops sliding_window without use_sliding_window: the reference runs these sliding layers "
        "unwindowed (causal), vLLM refuses the file"),
}


ROPE = r"""
import json, sys, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
spec = json.load(sys.stdin)
out = {}
for name, case in spec.items():
    with set_current_vllm_config(VllmConfig()):  # its custom ops read the compilation config
        rope = get_rope(case["head_dim"], max_position=256, is_neox_style=case["neox"], rope_parameters=case["rope"],
                        dtype=torch.float64)
    q = torch.tensor(case["q"], dtype=torch.float64)  # [T, heads * hd], vLLM's layout
    k = torch.tensor(case["k"], dtype=torch.float64)
    positions = torch.tensor(case["positions"])
    q2, k2 = rope.forward_native(positions, q.clone(), k.clone())
    out[name] = {"q": q2.tolist(), "k": k2.tolist()}
print(json.dumps(out))
"""


@pytest.mark.skipif(not VLLM, reason="set DFLASH2_VLLM_PYTHON to the python of a venv with vLLM 0.32")
def test_rope_of_either_style_rotates_as_vllms_rotary_embedding():
    import torch

    from dflash2.layers import RotaryEmbedding, apply_rope

    heads, hd, T = 2, 16, 7
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 5, 9, 30, 31, 100])
    cases = {}
    for neox in (True, False):
        for partial in (1.0, 0.5):
            rope = {"rope_type": "default", "rope_theta": 10000.0, **({"partial_rotary_factor": partial} if partial < 1 else {})}
            q, k = torch.randn(T, heads * hd, generator=g, dtype=torch.float64), torch.randn(T, hd, generator=g,
                                                                                              dtype=torch.float64)
            cases[f"neox={neox},partial={partial}"] = dict(neox=neox, rope=rope, head_dim=hd, q=q.tolist(), k=k.tolist(),
                                                           positions=positions.tolist())
    done = subprocess.run([VLLM, "-c", ROPE], input=json.dumps(cases), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for name, case in cases.items():
        table = RotaryEmbedding(hd, case["rope"], 256, heads * hd, heads)
        cos, sin = table(positions, torch.float64)
        for x, n in (("q", heads), ("k", 1)):
            ours = apply_rope(torch.tensor(case[x]).view(1, T, n, hd).transpose(1, 2), cos, sin, interleaved=not case["neox"])
            ours = ours.transpose(1, 2).reshape(T, n * hd)
            want = torch.tensor(theirs[name][x], dtype=torch.float64)
            # vLLM builds its cos/sin cache in float32: agreement to float32's precision, as the issue asks
            torch.testing.assert_close(ours, want, rtol=0, atol=1e-5, msg=lambda m: f"{name} {x}: {m}")
            wrong = apply_rope(torch.tensor(case[x]).view(1, T, n, hd).transpose(1, 2), cos, sin, interleaved=case["neox"])
            assert (wrong.transpose(1, 2).reshape(T, n * hd) - want).abs().max() > 0.1  # the other style is caught
