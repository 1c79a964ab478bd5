#!/usr/bin/env bash
# Trains the embedded DFlash-2 and DFlash-1 drafters with the same data and budget, ships them into
# dflash2/embedded/, and evaluates them on HumanEval. Resumable: rerun after an interruption and each
# run continues from its last complete checkpoint (the data cache is reused).
#   bash experiments/embedded/train_drafters.sh      (from the repository root, ~80 min on 2 CPU cores)
set -euo pipefail
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
out=$(python -c "from dflash2.train import load_config; print(load_config('configs/embedded_dflash2.yaml', []).out)")
mkdir -p "$(dirname "$out")"
[ -f runs/embedded/prompts.pt ] || python experiments/embedded/build_prompts.py
log "regenerating the shared drafter data with the target (skipped when cached)"
python -m dflash2.train --config configs/embedded_dflash2.yaml --stop-after 0
log "training both drafters, one core each"
for v in dflash2 dflash1; do
  OMP_NUM_THREADS=1 python -m dflash2.train --config "configs/embedded_$v.yaml" > "$(dirname "$out")/$v.out" 2>&1 &
done
wait
for v in dflash2 dflash1; do
  rm -rf "dflash2/embedded/$v" && cp -r "$(dirname "$out")/$v/final" "dflash2/embedded/$v"
done
log "evaluating on HumanEval"
python experiments/embedded/eval_humaneval.py
log "done"
