#!/usr/bin/env bash
# bash examples/train_grpo_tiny_moe.sh [key=value ...]
#
# GRPO on a mixture-of-experts model, on a laptop-class CPU: examples/train_grpo_tiny.sh with the tiny Qwen3-MoE
# (2 layers, 4 experts per layer, 2 per token). examples/prepare_tiny.sh makes the model from
# configs/models/tiny_qwen3_moe.yaml, the task data and the supervised warm start, then
#   GRPO   chatgen train configs/grpo_tiny_moe.yaml -> $OUTPUT_DIR (metrics.jsonl: eval/reward every 5 episodes,
#          policy/moe/load_balancing_loss and policy/moe/expert_usage/<e> every episode)
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=20).
export MODEL=${MODEL:-outputs/tiny-qwen3-moe} MODEL_CONFIG=configs/models/tiny_qwen3_moe.yaml
export POLICY_LOAD=${POLICY_LOAD:-outputs/tiny-qwen3-moe-sft}
CONFIG=configs/grpo_tiny_moe.yaml   # checked by prepare_tiny.sh before the warm start
source "$(dirname "${BASH_SOURCE[0]}")/prepare_tiny.sh"
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_tiny_moe/$(date +%Y%m%d-%H%M%S)}

chatgen train "$CONFIG" runtime.output_dir="$OUTPUT_DIR" "$@"
echo "held-out reward per evaluation (episode 0 = before GRPO):"
print_evals "$OUTPUT_DIR/metrics.jsonl" eval/reward eval/solved
echo "router, last episode:"
python - "$OUTPUT_DIR/metrics.jsonl" <<'PY'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1])][-1]
print("  " + ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in last.items() if k.startswith("policy/moe/")))
PY
