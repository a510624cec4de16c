#!/usr/bin/env bash
# bash examples/prepare_tiny.sh   (examples/train_*_tiny.sh source it first)
#
# What every tiny example trains on, each step skipped when its output exists:
#   1. the tiny model        chatgen make-tiny-model                 -> $MODEL
#   2. the task data         python -m chatgen.tasks            -> $DATA_DIR/{train,eval,sft}.jsonl and
#                            preference_{train,eval}.jsonl (the same prompts as DPO pairs)
#   3. `chatgen config $CONFIG` (when the sourcing script sets CONFIG): every check of the run, in seconds
#   4. supervised warm start examples/sft_warm_start.py ($SFT_STEPS steps, default 300)  -> $POLICY_LOAD
#      on mixed demonstrations (70% sorted descending): the model can sort, mostly the wrong way
# Sourced, it also leaves chatgen on PATH (examples/env.sh), the working directory at the project root (the
# directory above this script: a chatgen clone or a `chatgen init` project), DATA_DIR and POLICY_LOAD exported
# (the tiny configs read them). Set CHATGEN_VERBOSE=1 to see every library's warnings.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

MODEL=${MODEL:-outputs/tiny-llama}
MODEL_CONFIG=${MODEL_CONFIG:-configs/models/tiny_llama.yaml}   # the spec MODEL is made from
export DATA_DIR=${DATA_DIR:-outputs/sort_digits}
export POLICY_LOAD=${POLICY_LOAD:-outputs/tiny-llama-sft}

[[ -d $MODEL ]] || chatgen make-tiny-model --config "$MODEL_CONFIG" --output "$MODEL"
[[ -f $DATA_DIR/sft.jsonl && -f $DATA_DIR/preference_eval.jsonl ]] || python -m chatgen.tasks --output "$DATA_DIR"
# the run's config (CONFIG, set by the script that sources this one) gets every check `chatgen train` makes
# before the minutes of the warm start (the key=value arguments given to the script included)
if [[ -n ${CONFIG:-} ]]; then
  overrides=()
  for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
  chatgen config "$CONFIG" "${overrides[@]}" > /dev/null
fi
[[ -d $POLICY_LOAD ]] || python examples/sft_warm_start.py --load "$MODEL" --data "$DATA_DIR/sft.jsonl" \
  --output "$POLICY_LOAD" --steps "${SFT_STEPS:-300}"
