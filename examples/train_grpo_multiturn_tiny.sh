#!/usr/bin/env bash
# bash examples/train_grpo_multiturn_tiny.sh [key=value ...]
#
# Multi-turn RL through the OpenAI endpoint, on a CPU: the run serves the tiny Llama's policy over OpenAI HTTP
# (loopback), the built-in calculator environment (chatgen/environments/calculator.py) chats with it through the `openai`
# client (answer, read the calculator, answer again), and GRPO trains on the token ids the server returned.
# examples/prepare_tiny.sh makes the tiny model, the task data and the supervised warm start; this script
# gives the warm start a chat template, then
#   chatgen train configs/grpo_multiturn_tiny.yaml   -> $OUTPUT_DIR (metrics.jsonl, metrics.png, checkpoints/);
#   held-out reward of the final answer every 5 episodes ("eval/reward"); docs/multiturn_rl.md
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20, or --resume with OUTPUT_DIR set).
CONFIG=configs/grpo_multiturn_tiny.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_multiturn_tiny/$(date +%Y%m%d-%H%M%S)}

[[ -f $POLICY_LOAD/chat_template.jinja ]] || python -m chatgen.environments.calculator --write-template "$POLICY_LOAD"
chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
