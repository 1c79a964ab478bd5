#!/usr/bin/env bash
# A few training steps on a real target, on a GPU: the recipe of configs/train/qwen3_8b_b16.yaml at
# smoke-test scale (16 conversations, 5 steps), with the hf backend so that it needs no vLLM. Prints
# the log records (loss, tokens/s, anchors/s, CUDA peak memory) and exits non-zero if a step fails.
#
#   TARGET=Qwen/Qwen3-8B DATA=path/to/chat.jsonl bash experiments/gpu/train_smoke.sh
#
# TARGET defaults to Qwen/Qwen3-0.6B (small enough for any GPU); DATA to the embedded chat sample.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here: this script trains on one')"
TARGET=${TARGET:-Qwen/Qwen3-0.6B}
DATA=${DATA:-experiments/embedded/chat_sample.jsonl}
OUT=${OUT:-/tmp/dflash2-train-smoke}
rm -rf "$OUT"
python -m dflash2.train --config configs/train/qwen3_8b_b16.yaml \
  target="$TARGET" out="$OUT" data.dataset="$DATA" data.backend=hf data.max_conversations=16 \
  data.new_tokens=256 data.max_length=1024 data.shard_size=16 data.regen_batch=16 \
  steps=5 batch_size=4 grad_accum=1 anchors_per_seq=256 ckpt_every=5 eval_every=5 eval_sequences=4
python - "$OUT" <<'PY'
import json, sys
for line in open(f"{sys.argv[1]}/log.jsonl"):
    r = json.loads(line)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
           if k in ("step", "loss", "top1_acc", "tokens_per_s", "anchors_per_s", "cuda_peak_gb", "heldout_tau")})
PY
