#!/usr/bin/env bash
# bash examples/train_online_dpo_tiny.sh [key=value ...]
#
# Online DPO on CPU in about two minutes: examples/prepare_tiny.sh makes the tiny model, the task data and the
# supervised warm start (the model can sort, mostly the wrong way), then
#   Online DPO   chatgen train configs/online_dpo_tiny.yaml    -> $OUTPUT_DIR (metrics.jsonl, metrics.png,
#                checkpoints/); held-out reward is logged every 5 episodes ("eval/reward"), as for GRPO
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=10, or --resume with OUTPUT_DIR set).
CONFIG=configs/online_dpo_tiny.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/online_dpo_tiny/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
