#!/usr/bin/env bash
# The published tables on a GPU machine (docs/published_tables.md): every configs/bench/published_*.yaml
# through `python -m dflash2.bench`, one after the other, each into its own docs/results/published_* folder.
#   bash experiments/gpu/published_tables.sh [key=value ...]     # e.g. num_prompts=16 for a first look
# Needs CUDA, the checkpoints (hub ids, cached or online) and SGLang with DFlash for the server rows
# (without it, add servers={} to run our loop's rows only).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: this script needs CUDA')"
for config in configs/bench/published_*.yaml; do
    echo "== $config"
    name=$(basename "$config" .yaml)
    python -m dflash2.bench --config "$config" out="docs/results/$name" "$@"
done
