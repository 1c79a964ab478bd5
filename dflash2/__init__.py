"""dflash2: DFlash 2 speculative decoding.

A block-diffusion drafter reads the target's hidden states and drafts a whole block in one forward
pass; a two-tap dynamic convolution, per-position top-K candidates and a path selector (DFlash 2)
pick the path; the target verifies the block in one pass, losslessly.

The user-facing names are here; every building block is importable from its own module
(`dflash2.backbone`, `dflash2.conv`, `dflash2.selector`, `dflash2.verify`, `dflash2.tree`, ...):
README.md, "What is where".
"""

from .batch import ar_generate_batch, spec_generate_batch
from .config import DFlash2Config
from .drafter import DFlash2Drafter
from .embedded import load_embedded
from .heads import Candidates
from .interfaces import BatchDrafter, CheckedDrafter, Drafter, Selector, TreeDrafter, VerifyPolicy
from .loop import AutoregressiveDrafter, GenerationResult, ar_generate, spec_generate
from .rng import RandomSource, TorchRandom
from .registry import register_conv, register_selector
from .sampling import SamplingParams
from .sealed import SealedDrafts
from .target import StaticTarget, TargetAdapter
from .tree import TokenTree
from .verify import Draft

__version__ = "0.1.0"

__all__ = [
    "AutoregressiveDrafter", "BatchDrafter", "Candidates", "CheckedDrafter", "DFlash2Config", "DFlash2Drafter",
    "Draft", "Drafter", "GenerationResult", "RandomSource", "SamplingParams", "SealedDrafts", "Selector", "StaticTarget",
    "TargetAdapter", "TokenTree", "TorchRandom", "TreeDrafter", "ar_generate", "ar_generate_batch", "load_embedded",
    "VerifyPolicy", "register_conv", "register_selector", "spec_generate", "spec_generate_batch",
]
