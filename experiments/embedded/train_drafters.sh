#!/usr/bin/env bash
# Trains the embedded DFlash-2 and DFlash-1 drafters with the same data and budget, ships them into
# dflash2/embedded/, and evaluates them on HumanEval. Six stages, each with its own shared data:
#   1. configs/embedded_dflash{2,1}.yaml: 3500 steps from scratch on stdlib prompts (data v2);
#   2. configs/embedded_dflash{2,1}_tune.yaml: 2500 steps from stage 1 on data v3 (half of the
#      prompts are type-annotated functions of installed packages: build_prompts.py --typed);
#   3. configs/embedded_dflash{2,1}_tune2.yaml: 5000 steps from stage 2 on 16000 fresh v3 sequences;
#   4. configs/embedded_dflash{2,1}_tune3.yaml: 5000 steps from stage 3 on 16000 v4 sequences (typed
#      prompts from packages v3 never read);
#   6. configs/embedded_dflash{2,1}_tune5.yaml: 3000 steps from stage 4 on 16000 v6 sequences (v4's
#      prompts plus functions with >>> examples: build_prompts.py --doctest);
#   7. configs/embedded_dflash{2,1}_tune6.yaml: 2000 steps from stage 6 on 16000 fresh v6 sequences.
# (Stage 5, configs/embedded_dflash{2,1}_tune4.yaml, grows stage 4 to 3 layers: measured, not shipped.)
# Resumable: rerun after an interruption and each run continues from its last complete checkpoint
# (the data caches are reused).
#   bash experiments/embedded/train_drafters.sh      (from the repository root, ~9 h on 2 CPU cores)
set -euo pipefail
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
[ -f runs/embedded/prompts.pt ] || python experiments/embedded/build_prompts.py
[ -f runs/embedded/prompts-v3.pt ] || python experiments/embedded/build_prompts.py \
  --typed torch transformers hypothesis --out runs/embedded/prompts-v3.pt
[ -f runs/embedded/prompts-v4.pt ] || python experiments/embedded/build_prompts.py --typed pydantic huggingface_hub \
  rich anyio click typer markdown_it PIL _pytest fsspec matplotlib numpy sympy networkx --out runs/embedded/prompts-v4.pt
[ -f runs/embedded/prompts-v6.pt ] || python experiments/embedded/build_prompts.py --typed pydantic huggingface_hub \
  rich anyio click typer markdown_it PIL _pytest fsspec matplotlib numpy sympy networkx \
  --doctest sympy networkx numpy torch mpmath transformers fontTools sortedcontainers --out runs/embedded/prompts-v6.pt
for stage in "" _tune _tune2 _tune3 _tune5 _tune6; do
  log "stage ${stage:-_scratch}: regenerating the shared drafter data with the target (skipped when cached)"
  python -m dflash2.train --config "configs/embedded_dflash2$stage.yaml" --stop-after 0
  log "stage ${stage:-_scratch}: training both drafters, one core each"
  pids=()
  for v in dflash2 dflash1; do
    out=$(python -c "from dflash2.train import load_config; print(load_config('configs/embedded_$v$stage.yaml', []).out)")
    mkdir -p "$out"
    OMP_NUM_THREADS=1 python -m dflash2.train --config "configs/embedded_$v$stage.yaml" > "$out.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # a failed run stops the script
done
for v in dflash2 dflash1; do
  out=$(python -c "from dflash2.train import load_config; print(load_config('configs/embedded_${v}_tune6.yaml', []).out)")
  rm -rf "dflash2/embedded/$v" && cp -r "$out/final" "dflash2/embedded/$v"
done
log "evaluating on HumanEval"
python experiments/embedded/eval_humaneval.py
log "done"
