#!/usr/bin/env bash
# bash examples/train_grpo_tiny.sh [key=value ...]
#
# The README's main job, on a laptop-class CPU in a few minutes: GRPO teaches the embedded tiny Llama to sort
# digits ascending. examples/prepare_tiny.sh makes the tiny model, the task data and the supervised warm start
# (the model can sort, mostly the wrong way), then
#   GRPO   chatgen train configs/grpo_tiny.yaml    -> $OUTPUT_DIR (metrics.jsonl, metrics.png, tensorboard/,
#          checkpoints/); held-out reward is logged every 5 episodes ("eval/reward")
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=30, or --resume with OUTPUT_DIR set).
CONFIG=configs/grpo_tiny.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_tiny/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
