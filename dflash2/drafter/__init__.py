"""The DFlash 2 drafter: a block-diffusion backbone over the target's features, per-position candidates,
and a path selector.

    model.py             DFlash2Drafter: build, propose (paths, trees, batches), save and load, compile
    backbone.py          the drafter layers with KV injection of the target's features
    conv.py              the two-tap dynamic convolution around each sublayer
    heads.py             candidate head: top-K ids and scores per position
    selectors/           one file per method: codebook.py (argmax, walk, Viterbi), dspark.py, lilicorr.py;
                         contract.py checks a researcher's own
    reference_format.py  the published checkpoint layout (DFlash-1, DFlash 2, DSpark, LiLiCorr)
    draft_vocab.py       a reduced draft vocabulary
"""
