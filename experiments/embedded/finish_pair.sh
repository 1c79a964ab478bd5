#!/usr/bin/env bash
# After the target's run: export it, train both drafters on the same regenerated data (in parallel,
# one core each), install them in the package, train the small AR draft model, evaluate on HumanEval.
# Waits for runs/target/ckpt.pt to reach TARGET_STEPS (default: the run's last step, 1500) first, so it
# can be started early; with a smaller TARGET_STEPS it then stops the target's run there (the checkpoint
# stays resumable) and uses that checkpoint.
set -euo pipefail
TARGET_STEPS=${TARGET_STEPS:-1500}
cd "$(dirname "$0")/../.."
log() { echo "[$(date +%H:%M:%S)] $*"; }

export TARGET_STEPS
until python - <<'PY'
import sys, torch
from dflash2.checkpoint import load_checkpoint
s = load_checkpoint("runs/target/ckpt.pt")
import os
sys.exit(0 if s is not None and s["step"] >= int(os.environ["TARGET_STEPS"]) else 1)
PY
do sleep 20; done
pkill -f "experiments/embedded/train_target.py$" || true
sleep 5
log "target at step $TARGET_STEPS or later: exporting"
python experiments/embedded/train_target.py --export
[ -f runs/embedded/prompts.pt ] || python experiments/embedded/build_prompts.py
bash experiments/embedded/train_drafters.sh
log "training the AR draft model"
python experiments/embedded/train_target.py --preset ar_draft --steps 600 --eval-every 300
python experiments/embedded/train_target.py --preset ar_draft --steps 600 --export
log "done"
