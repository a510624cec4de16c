#!/usr/bin/env bash
# bash scripts/gpu_smoke.sh [pytest args...]
#
# The GPU tier on a CUDA machine: sets up the CUDA stack (requirements-gpu.txt) in its own environment, checks
# that torch sees a GPU (otherwise every test would only skip), then runs the tests marked `gpu` and lists why any
# was skipped (the 2-GPU tests on a 1-GPU machine, SmolLM2 without its pip package). docs/gpu.md says what they
# cover and what has run where.
#   CHATGEN_VENV   the environment (default: <repo>/.venv-gpu, apart from the CPU one)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CHATGEN_VENV="${CHATGEN_VENV:-$repo/.venv-gpu}"
CHATGEN_REQUIREMENTS=requirements-gpu.txt bash "$repo/scripts/setup_env.sh"
cd "$repo"
"$CHATGEN_VENV/bin/python" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("[chatgen] torch sees no CUDA GPU here: the gpu tier would only skip (check the driver and "
             "CUDA_VISIBLE_DEVICES)")
print(f"[chatgen] {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}", file=sys.stderr)
PY
exec "$CHATGEN_VENV/bin/python" -m pytest -m gpu -rs "$@"
