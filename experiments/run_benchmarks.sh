#!/usr/bin/env bash
# Every benchmark and experiment behind docs/results.md's embedded-pair tables (about 12 minutes on 2 idle
# CPU cores); each writes its own record under docs/results/. Run from the repository root after experiments/embedded/train_drafters.sh.
set -euo pipefail
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
for cfg in headline tree concurrency block_sweep main; do
  log "bench: configs/bench/$cfg.yaml"
  python -m dflash2.bench --config "configs/bench/$cfg.yaml"
done
log "ablation grid"
python experiments/ablation/grid.py
log "profile of a round"
python experiments/performance/profile_round.py
python experiments/performance/cprofile_loop.py
log "done"
