#!/usr/bin/env bash
# bash examples/train_grpo_tiny.sh [key=value ...]
#
# The README's main job, on a laptop-class CPU in a few minutes: GRPO teaches the embedded tiny Llama to sort
# digits ascending. Steps (each skipped when its output exists):
#   1. the tiny model        chatgen make-tiny-model                 -> $MODEL
#   2. the task data         python -m chatgen.rlhf.tasks            -> $DATA_DIR/{train,eval,sft}.jsonl
#   3. supervised warm start examples/sft_warm_start.py (300 steps)  -> $POLICY_LOAD
#      on mixed demonstrations (70% sorted descending): the model can sort, mostly the wrong way
#   4. GRPO                  chatgen train configs/grpo_tiny.yaml    -> $OUTPUT_DIR (metrics.jsonl, metrics.png,
#      tensorboard/, checkpoints/); held-out reward is logged every 5 episodes ("eval/reward")
# Extra arguments go to `chatgen train` (e.g. runtime.num_episode=30, or --resume with OUTPUT_DIR set).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
export PATH="${CHATGEN_VENV:-$PWD/.venv}/bin:$PATH"
export OMP_WAIT_POLICY=PASSIVE   # shared CPU cores: spinning OpenMP threads slow the tiny model's steps ~10x

MODEL=${MODEL:-outputs/tiny-llama}
export DATA_DIR=${DATA_DIR:-outputs/sort_digits}
export POLICY_LOAD=${POLICY_LOAD:-outputs/tiny-llama-sft}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo_tiny/$(date +%Y%m%d-%H%M%S)}

[[ -d $MODEL ]] || chatgen make-tiny-model --config configs/models/tiny_llama.yaml --output "$MODEL"
[[ -f $DATA_DIR/sft.jsonl ]] || python -m chatgen.rlhf.tasks --output "$DATA_DIR"
[[ -d $POLICY_LOAD ]] || python examples/sft_warm_start.py --load "$MODEL" --data "$DATA_DIR/sft.jsonl" \
  --output "$POLICY_LOAD" --steps 300
chatgen train configs/grpo_tiny.yaml "$@"
echo "held-out reward per evaluation (episode 0 = before GRPO):"
python - "$OUTPUT_DIR/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "eval/reward" in r:
        print(f"  episode {r['episode']:3d}: reward {r['eval/reward']:.3f}, solved {r['eval/solved']:.3f}")
PY
