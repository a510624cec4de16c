#!/usr/bin/env bash
# bash examples/train_opd_tiny.sh [key=value ...]
#
# configs/opd_tiny.yaml, on-policy distillation on the tiny sort-digits task (docs/algorithms.md):
# examples/prepare_tiny.sh makes the tiny model, the task data and the supervised warm start (the student);
# the teacher is grpo_tiny trained from that warm start for 20 episodes, made here first unless TEACHER_LOAD
# names a checkpoint with the student's tokenizer. Then `chatgen train configs/opd_tiny.yaml` writes
# $OUTPUT_DIR (metrics.jsonl with distill/reverse_kl, held-out reward every 5 episodes). Extra arguments go to
# `chatgen train` (e.g. runtime.num_episode=20, runtime.algorithm.task_reward_coef=0.5).
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
TEACHER_RUN=${TEACHER_RUN:-outputs/opd_tiny/teacher}
export TEACHER_LOAD=${TEACHER_LOAD:-$TEACHER_RUN/checkpoints/episode_000020/policy_trainer}
if [[ ! -d $TEACHER_LOAD ]]; then
  echo "[opd_tiny] training the teacher: grpo_tiny, 20 episodes -> $TEACHER_LOAD"
  chatgen train configs/grpo_tiny.yaml runtime.output_dir="$TEACHER_RUN" runtime.num_episode=20 \
    runtime.save_episode_interval=20
fi
CONFIG=configs/opd_tiny.yaml
chatgen config "$CONFIG" "$@" > /dev/null   # every check (the teacher's tokenizer too) before the run
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/opd_tiny/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
