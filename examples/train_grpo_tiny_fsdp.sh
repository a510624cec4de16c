#!/usr/bin/env bash
# bash examples/train_grpo_tiny_fsdp.sh [key=value ...]
#
# configs/grpo_tiny_fsdp.yaml on the tiny sort-digits task (docs/fsdp_backend.md): examples/prepare_tiny.sh makes
# the tiny model, the task data and the supervised warm start, then `chatgen train configs/grpo_tiny_fsdp.yaml`
# trains it with the fsdp trainer (transformers' Llama under torch FSDP2) and writes $OUTPUT_DIR
# (metrics.jsonl, metrics.png, tensorboard/, checkpoints/); held-out reward every 5 episodes. Extra arguments
# go to `chatgen train`.
CONFIG=configs/grpo_tiny_fsdp.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_tiny_fsdp/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
