#!/usr/bin/env bash
# bash examples/train_verifiers_tiny.sh [key=value ...]
#
# Multi-turn GRPO on an environment written in verifiers' own API (chatgen/environments/verifiers_sort.py
# through the verifiers adapter; needs `pip install --no-deps -r requirements-verifiers.txt`), the tiny Llama on
# CPU. examples/prepare_tiny.sh makes the tiny model, the task data and the supervised warm
# start; this script gives the warm start the calculator environment's plain chat template, then
#   chatgen train configs/verifiers_tiny.yaml   -> $OUTPUT_DIR; docs/agents.md
CONFIG=configs/verifiers_tiny.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/verifiers_tiny/$(date +%Y%m%d-%H%M%S)}

[[ -f $POLICY_LOAD/chat_template.jinja ]] || python -m chatgen.environments.calculator --write-template "$POLICY_LOAD"
chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
