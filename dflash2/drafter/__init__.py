"""The DFlash 2 drafter: a block-diffusion backbone over the target's features, per-position candidates,
and a path selector.

    model.py             DFlash2Drafter: the module and what the loops call (propose: paths, trees, batches)
    files.py             its files and copies: from_target, save/load (ours or published), with_* copies
    rounds.py            a drafting round as one call, one graph when compiled (batch 1 and batches)
    backbone.py          the drafter layers with KV injection of the target's features
    conv.py              the two-tap dynamic convolution around each sublayer
    heads.py             candidate head: top-K ids and scores per position
    selectors/           one file per method: codebook.py (argmax, walk, Viterbi), dspark.py, lilicorr.py;
                         contract.py checks a researcher's own
    reference_format.py  the published checkpoint layout (DFlash-1, DFlash 2, DSpark, LiLiCorr);
                         reference_rope.py its RoPE fields
    draft_vocab.py       a reduced draft vocabulary
"""
