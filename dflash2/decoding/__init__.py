"""Decoding: the speculative round and the loops around it.

    loop.py      spec_generate / ar_generate: one sequence, one round per iteration
    batch.py     spec_generate_batch / ar_generate_batch: left-padded rows, continuous batching
    round.py     the steps of a round both loops share: propose, decide, commit
    verify.py    the lossless verifier of a path (greedy, deterministic and stochastic drafts)
    tree.py      token trees and their lossless verifier
    sampling.py  the target's processed distribution (temperature, top-k, top-p), as HF samples it
    rng.py       the random source every draw goes through (tests enumerate it)
    sealed.py    what a verification policy may see of a round's drafts
    checks.py    argument checks, one clear error per bad input
"""
