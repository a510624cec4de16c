#!/usr/bin/env bash
# bash scripts/gpu_smoke.sh [pytest args...]
#
# The GPU tier on a CUDA machine whose Python already has the stack: checks that torch sees a GPU (otherwise every
# test would only skip), then runs tests/gpu and lists why any was skipped (the vLLM tests without vLLM, the 2-GPU
# tests on a 1-GPU machine, SmolLM2 without its pip package). It installs nothing and changes no environment.
# A fresh CUDA venv (network needed):
#   CHATGEN_VENV=.venv-gpu CHATGEN_REQUIREMENTS=requirements-gpu.txt bash scripts/setup_env.sh
# The offline GPU machine lent to sessions (no network, no vLLM): scripts/gpu_prepare.sh + scripts/gpu_run.sh.
# docs/gpu.md says what the tests cover and what has run where.
#   CHATGEN_PYTHON   the interpreter (default: .venv-gpu/bin/python if it exists, else python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
default=python3
[[ -x .venv-gpu/bin/python ]] && default=.venv-gpu/bin/python
python="${CHATGEN_PYTHON:-$default}"
"$python" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("[chatgen] torch sees no CUDA GPU here: the gpu tier would only skip (check the driver and "
             "CUDA_VISIBLE_DEVICES)")
print(f"[chatgen] {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}", file=sys.stderr)
PY
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m pytest tests/gpu -rs "$@"
