"""The vLLM helper: a job runs in another interpreter, and whatever vLLM does comes back as a result.

The suite never needs vLLM. With DFLASH2_VLLM_PYTHON set to the python of a venv that has vLLM
(docs/checkpoints.md), the last test serves the exported embedded DFlash-1 drafter and checks the
engine's greedy outputs against the target's; otherwise it is skipped.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dflash2.engines.vllm import VLLMResult, run_vllm


def test_a_missing_interpreter_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="vllm_python"):
        run_vllm(tmp_path / "nope" / "python", tmp_path, [[1, 2]], max_new_tokens=4)


def test_an_interpreter_without_vllm_comes_back_as_an_error_not_a_crash(tmp_path):
    if any(p for p in sys.path if os.path.isdir(os.path.join(p, "vllm"))):
        pytest.skip("this interpreter has vLLM")
    result = run_vllm(sys.executable, tmp_path, [[1, 2]], max_new_tokens=4)
    assert result.error == "ModuleNotFoundError: No module named 'vllm'" and result.outputs == []


def test_the_worker_imports_the_venvs_vllm_not_the_module_beside_it(tmp_path, monkeypatch):
    """The worker lives next to dflash2/engines/vllm.py, and a script's directory comes first on
    sys.path: without care `import vllm` finds that module ("cannot import name 'LLM'") and every
    engine row is refused. A stand-in vllm package on the path must be the one reached."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "class LLM:\n    def __init__(self, **kwargs):\n        raise ValueError('stand-in engine reached')\n"
        "class SamplingParams:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = run_vllm(sys.executable, tmp_path, [[1, 2]], max_new_tokens=4)
    assert result.error == "ValueError: stand-in engine reached"


def test_tau_and_acceptance_come_from_the_spec_decode_counters():
    r = VLLMResult(outputs=[[1] * 30, [2] * 30], wall_s=2.0,
                   spec_decode={"drafts": 20, "draft_tokens": 300, "accepted": 42, "accepted_per_position": [15, 9, 0]})
    assert r.tau == pytest.approx(1 + 42 / 20)
    assert r.acceptance_by_position == [0.75, 0.45, 0.0]
    assert r.tokens_per_s == 30.0
    assert VLLMResult(outputs=[[1]], wall_s=1.0).tau is None


@pytest.mark.skipif(not os.environ.get("DFLASH2_VLLM_PYTHON"), reason="set DFLASH2_VLLM_PYTHON to a venv with vLLM")
def test_vllm_serves_the_exported_embedded_drafter_losslessly(tmp_path):
    from dflash2 import ar_generate
    from dflash2.embedded import embedded_path, load_embedded

    tokenizer, target, drafter = load_embedded("dflash1")
    drafter.save_pretrained(tmp_path / "dflash1", format="reference")
    prompts = [tokenizer("def fibonacci(n):")["input_ids"], tokenizer("import os\n\n\ndef walk(path):")["input_ids"]]
    with torch.no_grad():
        greedy = [ar_generate(target, torch.tensor([p]), max_new_tokens=32).new_tokens.tolist() for p in prompts]
    served = run_vllm(os.environ["DFLASH2_VLLM_PYTHON"], embedded_path("target"), prompts, max_new_tokens=32,
                      drafter=tmp_path / "dflash1", num_speculative_tokens=15)
    assert served.error is None, served.log_tail
    assert served.outputs == greedy and served.tau is not None and served.tau > 1
