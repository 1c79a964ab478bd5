#!/usr/bin/env bash
# Trains the embedded DFlash-2 and DFlash-1 drafters with the same data and budget, ships them into
# dflash2/embedded/, and evaluates them on HumanEval. Each stage is the drafter's base config
# (configs/embedded_dflash2.yaml or configs/embedded_dflash1.yaml: they differ only in conv and selector)
# plus the stage's overrides below; what each stage was for and what it measured:
# experiments/embedded/README.md, "Training stages".
#   bash experiments/embedded/train_drafters.sh                 # the shipped stages 1 2 3 4 6 7 (~9 h on 2 cores)
#   bash experiments/embedded/train_drafters.sh 5               # one stage (5: grown to 3 layers, not shipped)
#   bash experiments/embedded/train_drafters.sh --overrides 6 dflash2   # print a stage's overrides
# Resumable: rerun after an interruption and each run continues from its last complete checkpoint
# (the data caches are reused).
set -euo pipefail

overrides() {  # $1 stage, $2 dflash2 or dflash1 → the overrides of configs/embedded_$2.yaml
  local v=$2 more="lr=3.0e-4 data.num_sequences=16000"
  case $1 in
    1) echo "" ;;
    2) echo "init=runs/embedded-v2/$v/final out=runs/embedded-v3/$v data.prompts=runs/embedded/prompts-v3.pt" \
            "data.cache=runs/embedded/data-v3.pt steps=2500 lr=3.0e-4 seed=1" ;;
    3) echo "init=runs/embedded-v3/$v/final out=runs/embedded-v4/$v data.prompts=runs/embedded/prompts-v3.pt" \
            "data.cache=runs/embedded/data-v3b.pt steps=5000 seed=2 $more" ;;
    4) echo "init=runs/embedded-v4/$v/final out=runs/embedded-v5/$v data.prompts=runs/embedded/prompts-v4.pt" \
            "data.cache=runs/embedded/data-v4.pt steps=5000 seed=3 $more" ;;
    5) echo "init=runs/embedded-v5/$v/final out=runs/embedded-v7/$v drafter.num_layers=3" \
            "data.prompts=runs/embedded/prompts-v4.pt data.cache=runs/embedded/data-v4.pt steps=4000 seed=3 $more" ;;
    6) echo "init=runs/embedded-v5/$v/final out=runs/embedded-v8/$v data.prompts=runs/embedded/prompts-v6.pt" \
            "data.cache=runs/embedded/data-v6.pt steps=3000 seed=4 $more" ;;
    7) echo "init=runs/embedded-v8/$v/final out=runs/embedded-v9/$v data.prompts=runs/embedded/prompts-v6.pt" \
            "data.cache=runs/embedded/data-v7.pt steps=2000 seed=5 $more" ;;
    *) echo "unknown stage $1 (stages: 1-7)" >&2; return 2 ;;
  esac
}
if [ "${1:-}" = "--overrides" ]; then overrides "$2" "$3"; exit; fi

log() { echo "[$(date -u +%H:%M:%S)] $*"; }
[ -f runs/embedded/prompts.pt ] || python experiments/embedded/build_prompts.py
[ -f runs/embedded/prompts-v3.pt ] || python experiments/embedded/build_prompts.py \
  --typed torch transformers hypothesis --out runs/embedded/prompts-v3.pt
[ -f runs/embedded/prompts-v4.pt ] || python experiments/embedded/build_prompts.py --typed pydantic huggingface_hub \
  rich anyio click typer markdown_it PIL _pytest fsspec matplotlib numpy sympy networkx --out runs/embedded/prompts-v4.pt
[ -f runs/embedded/prompts-v6.pt ] || python experiments/embedded/build_prompts.py --typed pydantic huggingface_hub \
  rich anyio click typer markdown_it PIL _pytest fsspec matplotlib numpy sympy networkx \
  --doctest sympy networkx numpy torch mpmath transformers fontTools sortedcontainers --out runs/embedded/prompts-v6.pt
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(1 2 3 4 6 7)
for stage in "${stages[@]}"; do
  log "stage $stage: regenerating the shared drafter data with the target (skipped when cached)"
  # shellcheck disable=SC2046  # the overrides are words
  python -m dflash2.train --config configs/embedded_dflash2.yaml $(overrides "$stage" dflash2) --stop-after 0
  log "stage $stage: training both drafters, one core each"
  pids=()
  for v in dflash2 dflash1; do
    # shellcheck disable=SC2046
    out=$(python -c "import sys; from dflash2.train import load_config; print(load_config(sys.argv[1], sys.argv[2:]).out)" \
          "configs/embedded_$v.yaml" $(overrides "$stage" "$v"))
    mkdir -p "$out"
    # shellcheck disable=SC2046
    OMP_NUM_THREADS=1 python -m dflash2.train --config "configs/embedded_$v.yaml" $(overrides "$stage" "$v") \
      > "$out.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # a failed run stops the script
done
if [ "${stages[*]}" = "1 2 3 4 6 7" ]; then
  for v in dflash2 dflash1; do
    rm -rf "dflash2/embedded/$v" && cp -r "runs/embedded-v9/$v/final" "dflash2/embedded/$v"
  done
  log "evaluating on HumanEval"
  python experiments/embedded/eval_humaneval.py
fi
log "done"
