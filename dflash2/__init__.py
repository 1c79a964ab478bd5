"""dflash2: DFlash 2 speculative decoding.

A block-diffusion drafter reads the target's hidden states and drafts a whole block in one forward
pass; a two-tap dynamic convolution, per-position top-K candidates and a path selector (DFlash 2)
pick the path; the target verifies the block in one pass, losslessly.
"""

from .batch import ar_generate_batch, spec_generate_batch
from .backbone import BlockDiffusionBackbone, ContextCache
from .config import DFlash2Config, default_target_layer_ids
from .conv import NoConv, TwoTapDynamicConv
from .drafter import DFlash2Drafter
from .embedded import load_embedded
from .heads import CandidateHead, Candidates
from .interfaces import BatchDrafter, CheckedDrafter, Drafter, Selector, TreeDrafter
from .loop import AutoregressiveDrafter, GenerationResult, ar_generate, spec_generate
from .rng import RandomSource, TorchRandom
from .sampling import SamplingParams, greedy_token, process_logits
from .selector import ArgmaxSelector, ViterbiSelector, WalkSelector, viterbi_path
from .static_target import StaticTarget
from .target import TargetAdapter
from .tree import TokenTree, TreeVerdict, best_first_tree, verify_tree
from .verify import Draft, Verdict, commit, verify_block

__version__ = "0.1.0"

__all__ = [
    "ArgmaxSelector", "AutoregressiveDrafter", "BatchDrafter", "CheckedDrafter", "Drafter", "Selector", "TreeDrafter", "BlockDiffusionBackbone", "CandidateHead", "Candidates",
    "ContextCache", "DFlash2Config", "DFlash2Drafter", "Draft", "GenerationResult", "NoConv", "RandomSource",
    "SamplingParams", "StaticTarget", "TargetAdapter", "TokenTree", "TorchRandom", "TreeVerdict", "TwoTapDynamicConv", "Verdict", "ViterbiSelector",
    "WalkSelector", "ar_generate", "ar_generate_batch", "best_first_tree", "commit", "default_target_layer_ids", "greedy_token", "load_embedded", "process_logits",
    "spec_generate", "spec_generate_batch", "verify_block", "verify_tree", "viterbi_path",
]
