"""Verification policies: how many of each row's drafted tokens the target checks this round.

    goodput.py     FixedWidth, GoodputPolicy (paths), TreeGoodputPolicy (token trees): widths that
                   maximise expected committed tokens per second, chosen as a stopping rule
    cost.py        CostModel and the profilers that measure a round's parts on this machine
    confidence.py  per-token confidences: survival curves, online calibration, node rates

A policy sees a round's drafts sealed (dflash2.decoding.sealed): whatever it does, its widths keep the
output lossless.
"""

from dflash2.policy.confidence import Calibrator, NodeRates
from dflash2.policy.cost import CostModel, profile_draft, profile_loop, profile_verify, profile_verify_batch
from dflash2.policy.goodput import (QUIET_ROUNDS, SKIPPED, UNKNOWN_CONFIDENCE, FixedWidth, GoodputPolicy, TreeGoodputPolicy,
                                    best_cap, best_widths, hopeful)
from dflash2.policy.timing import ROUND_SAMPLES, ROUND_WINDOW, RoundTimer

__all__ = ["QUIET_ROUNDS", "ROUND_SAMPLES", "ROUND_WINDOW", "SKIPPED", "UNKNOWN_CONFIDENCE", "Calibrator", "CostModel",
           "FixedWidth", "GoodputPolicy", "NodeRates", "TreeGoodputPolicy", "best_cap", "best_widths", "hopeful",
           "profile_draft", "profile_loop", "profile_verify", "profile_verify_batch", "RoundTimer"]
