"""The embedded demo pair, shipped inside the package (built by `experiments/embedded/`).

    tokenizer, target, drafter = dflash2.embedded.load_embedded("dflash2")   # or "dflash1"

Directories (HF-style, safetensors): `tokenizer/`, `target/` (a small Qwen3ForCausalLM trained on the
Python standard library's source), `dflash2/` and `dflash1/` (drafters trained against it with the
same data and steps), `ar_draft/` (a small AR model for HF assisted generation baselines), and
`token_counts.safetensors` (the target's training corpus counted by token: `token_counts()`, which
ranks a draft vocabulary, see `dflash2.drafter.draft_vocab`).
"""

from __future__ import annotations

from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VARIANTS = ("dflash2", "dflash1")
# the DFlash-2 drafter trained for SmolLM2-135M-Instruct (the `smollm2` target, fetched from PyPI at first use):
# what `python -m dflash2.generate` runs by default when this installation has it
SMOLLM2_DRAFTER = "smollm2_dflash2"


def embedded_path(name: str) -> Path:
    return HERE / name


def available(variant: str = "dflash2") -> bool:
    return all((HERE / d / f).is_file() for d, f in (("tokenizer", "tokenizer.json"), ("target", "config.json"),
                                                        (variant, "model.safetensors")))


def smollm2_drafter() -> Path | None:
    """The directory of the SmolLM2 drafter in this installation, or None."""
    path = HERE / SMOLLM2_DRAFTER
    return path if (path / "model.safetensors").is_file() else None


def token_counts() -> torch.Tensor:
    """Occurrences [V] of every token id in the embedded target's training corpus
    (experiments/embedded/count_tokens.py)."""
    from dflash2.drafter.draft_vocab import load_counts

    path = HERE / "token_counts.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"the embedded token counts are not in this installation ({path})")
    return load_counts(path)


def load_embedded(variant: str = "dflash2", *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(tokenizer, target, drafter) of the embedded pair; FileNotFoundError if this installation lacks it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash2.drafter.model import DFlash2Drafter

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not available(variant):
        raise FileNotFoundError(f"the embedded {variant!r} pair is not in this installation ({HERE})")
    tokenizer = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    target = AutoModelForCausalLM.from_pretrained(str(HERE / "target"), dtype=dtype).to(device).eval()
    drafter = DFlash2Drafter.from_pretrained(HERE / variant, device=device, dtype=dtype).eval()
    return tokenizer, target, drafter
