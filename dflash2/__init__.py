"""dflash2: DFlash 2 speculative decoding.

A block-diffusion drafter reads the target's hidden states and drafts a whole block in one forward
pass; a two-tap dynamic convolution, per-position top-K candidates and a path selector (DFlash 2)
pick the path; the target verifies the block in one pass, losslessly.

The user-facing names are here; every building block is importable from its own module, one package
per role: `dflash2.decoding` (the loops, the verifiers), `dflash2.drafter` (the model, its selectors),
`dflash2.policy` (how much to verify), `dflash2.targets` (target adapters), `dflash2.train`,
`dflash2.bench`: README.md, "What is where".
"""

from dflash2.decoding.batch import ar_generate_batch, spec_generate_batch
from dflash2.config import DFlash2Config
from dflash2.drafter.model import DFlash2Drafter
from dflash2.embedded import load_embedded
from dflash2.drafter.heads import Candidates
from dflash2.interfaces import BatchDrafter, CheckedDrafter, Drafter, Selector, TreeDrafter, VerifyPolicy
from dflash2.decoding.loop import AutoregressiveDrafter, GenerationResult, ar_generate, spec_generate
from dflash2.decoding.rng import RandomSource, TorchRandom
from dflash2.registry import register_conv, register_selector
from dflash2.decoding.sampling import SamplingParams
from dflash2.decoding.sealed import SealedDrafts
from dflash2.targets import StaticTarget, TargetAdapter
from dflash2.decoding.tree import TokenTree
from dflash2.decoding.verify import Draft

__version__ = "0.1.0"

__all__ = [
    "AutoregressiveDrafter", "BatchDrafter", "Candidates", "CheckedDrafter", "DFlash2Config", "DFlash2Drafter",
    "Draft", "Drafter", "GenerationResult", "RandomSource", "SamplingParams", "SealedDrafts", "Selector", "StaticTarget",
    "TargetAdapter", "TokenTree", "TorchRandom", "TreeDrafter", "ar_generate", "ar_generate_batch", "load_embedded",
    "VerifyPolicy", "register_conv", "register_selector", "spec_generate", "spec_generate_batch",
]
