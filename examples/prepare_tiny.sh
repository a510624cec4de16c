#!/usr/bin/env bash
# bash examples/prepare_tiny.sh   (examples/train_*_tiny.sh source it first)
#
# What every tiny example trains on, each step skipped when its output exists:
#   1. the tiny model        chatgen make-tiny-model                 -> $MODEL
#   2. the task data         python -m chatgen.tasks            -> $DATA_DIR/{train,eval,sft}.jsonl and
#                            preference_{train,eval}.jsonl (the same prompts as DPO pairs)
#   3. supervised warm start examples/sft_warm_start.py (300 steps)  -> $POLICY_LOAD
#      on mixed demonstrations (70% sorted descending): the model can sort, mostly the wrong way
# Sourced, it also leaves the venv on PATH, the working directory at the repository root, DATA_DIR and
# POLICY_LOAD exported (the tiny configs read them), and `print_evals METRICS_JSONL KEY...`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
export PATH="${CHATGEN_VENV:-$PWD/.venv}/bin:$PATH"
export OMP_WAIT_POLICY=PASSIVE   # shared CPU cores: spinning OpenMP threads slow the tiny model's steps ~10x

MODEL=${MODEL:-outputs/tiny-llama}
MODEL_CONFIG=${MODEL_CONFIG:-configs/models/tiny_llama.yaml}   # the spec MODEL is made from
export DATA_DIR=${DATA_DIR:-outputs/sort_digits}
export POLICY_LOAD=${POLICY_LOAD:-outputs/tiny-llama-sft}

[[ -d $MODEL ]] || chatgen make-tiny-model --config "$MODEL_CONFIG" --output "$MODEL"
[[ -f $DATA_DIR/sft.jsonl && -f $DATA_DIR/preference_eval.jsonl ]] || python -m chatgen.tasks --output "$DATA_DIR"
[[ -d $POLICY_LOAD ]] || python examples/sft_warm_start.py --load "$MODEL" --data "$DATA_DIR/sft.jsonl" \
  --output "$POLICY_LOAD" --steps 300

print_evals() {  # print_evals METRICS_JSONL KEY...: the held-out figures of each evaluation (episode 0 = start)
  python - "$@" <<'PY'
import json, sys
path, keys = sys.argv[1], sys.argv[2:]
for line in open(path):
    r = json.loads(line)
    if keys[0] in r:
        print(f"  episode {r['episode']:3d}: " + ", ".join(f"{k.split('/')[-1]} {r[k]:.3f}" for k in keys))
PY
}
