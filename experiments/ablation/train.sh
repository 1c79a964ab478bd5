#!/usr/bin/env bash
# The selector ablation on the embedded pair: every variant is configs/embedded_dflash2.yaml (the same
# data, optimiser, anchors and budget) plus the overrides below; only the backbone's conv and the path
# selector differ. DFlash-2 Viterbi is the walk drafter decoded with Viterbi (no training of its own).
#   bash experiments/ablation/train.sh                # every variant, one after the other
#   bash experiments/ablation/train.sh dspark         # one variant
#   bash experiments/ablation/train.sh --overrides lilicorr_v2   # print a variant's overrides
# Resumable: rerun after an interruption and each run continues from its last checkpoint.
set -euo pipefail
BUDGET="steps=250 ckpt_every=50"  # about 5 minutes a variant on 2 CPU cores, 30 for LiLiCorr (docs/training.md)
overrides() {
  case $1 in
    dflash1)     echo "drafter.conv=none drafter.selector=argmax" ;;
    dflash2)     echo "drafter.conv=two_tap drafter.selector=walk" ;;
    dspark)      echo "drafter.conv=none drafter.selector=dspark drafter.confidence_head=true" ;;
    lilicorr_v1) echo "drafter.conv=none drafter.selector=lilicorr" ;;
    lilicorr_v2) echo "drafter.conv=two_tap drafter.selector=lilicorr" ;;
    *) echo "unknown variant $1 (dflash1 dflash2 dspark lilicorr_v1 lilicorr_v2)" >&2; return 2 ;;
  esac
}
if [ "${1:-}" = "--overrides" ]; then overrides "$2"; exit; fi
[ -f runs/embedded/prompts.pt ] || python experiments/embedded/build_prompts.py
for v in ${@:-dflash1 dflash2 dspark lilicorr_v1 lilicorr_v2}; do
  python -m dflash2.train --config configs/embedded_dflash2.yaml out=runs/ablation/$v $BUDGET $(overrides $v)
  # the trained drafter, kept in bfloat16 (half the bytes) where experiments/ablation/evaluate.py reads it
  python -c "import sys, torch; from dflash2 import DFlash2Drafter; DFlash2Drafter.from_pretrained(sys.argv[1]).to(torch.bfloat16).save_pretrained(sys.argv[2])" \
    runs/ablation/$v/final experiments/ablation/drafters/$v
  cp runs/ablation/$v/final/train_config.json experiments/ablation/drafters/$v/
done
