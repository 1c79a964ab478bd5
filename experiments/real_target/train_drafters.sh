#!/usr/bin/env bash
# The SmolLM2 drafters: every variant is configs/train/smollm2_dflash2.yaml (one regenerated dataset, one
# feature cache, the same optimiser, anchors and steps) plus the overrides below; only the backbone's conv
# and the path selector differ. DFlash-2 Viterbi and the trees are the walk drafter decoded otherwise (no
# training of their own). LiLiCorr reads every candidate's log-probability over the whole vocabulary, so it
# trains without the draft vocabulary (a step costs about four times the others': docs/results/real_target).
#   bash experiments/real_target/train_drafters.sh               # data and features, then every variant
#   bash experiments/real_target/train_drafters.sh dflash2       # one variant
#   bash experiments/real_target/train_drafters.sh --overrides dspark
# Resumable: rerun after an interruption and the data, the features and each run continue where they stopped.
set -euo pipefail
BASE=configs/train/smollm2_dflash2.yaml
overrides() {
  case $1 in
    dflash1)     echo "drafter.conv=none drafter.selector=argmax" ;;
    dflash2)     echo "drafter.conv=two_tap drafter.selector=walk" ;;
    dspark)      echo "drafter.conv=none drafter.selector=dspark drafter.confidence_head=true" ;;
    lilicorr_v1) echo "drafter.conv=none drafter.selector=lilicorr draft_vocab=null" ;;
    lilicorr_v2) echo "drafter.conv=two_tap drafter.selector=lilicorr draft_vocab=null" ;;
    *) echo "unknown variant $1 (dflash1 dflash2 dspark lilicorr_v1 lilicorr_v2)" >&2; return 2 ;;
  esac
}
if [ "${1:-}" = "--overrides" ]; then overrides "$2"; exit; fi
python -m dflash2.train --config $BASE --data-only
for v in ${@:-dflash2 dflash1 dspark lilicorr_v1 lilicorr_v2}; do
  python -m dflash2.train --config $BASE out=runs/smollm2/$v $(overrides $v)
done
