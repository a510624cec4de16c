#!/usr/bin/env bash
# bash examples/train_stop_properly_tiny.sh [key=value ...]
#
# configs/stop_properly_tiny.yaml on the tiny sort-digits task (docs/algorithms.md): examples/prepare_tiny.sh makes the tiny
# model, the task data and the supervised warm start, then `chatgen train configs/stop_properly_tiny.yaml` writes
# $OUTPUT_DIR (metrics.jsonl, metrics.png, tensorboard/, checkpoints/); held-out reward every 5 episodes.
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20).
CONFIG=configs/stop_properly_tiny.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/stop_properly_tiny/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
