#!/usr/bin/env bash
# bash scripts/gpu_prepare.sh   (here, with network to PyPI; then on the GPU machine: bash scripts/gpu_run.sh)
#
# Makes the carry folder (.gpu, ignored by git) that scripts/gpu_run.sh needs on the offline GPU machine:
#   .gpu/wheels/       cp312 manylinux wheels, no dependencies: megatron-core 0.16.1 and blake3 1.0.11 (not on that
#                      machine: vLLM brings blake3 here; the shared-memory weight push imports it), and
#                      protobuf, tensorboard (+ its data server), matplotlib, which gpu_run.sh installs only if
#                      that machine lacks them (its image had them when last read)
#   .gpu/test-models/  the tiny test models, prebuilt (tests/conftest.py's cache, keyed by the maker's source)
# and checks it stays under the device tool's 64 MiB (with the working tree). Re-running skips what exists.
# docs/gpu.md: how to carry it (`carry: [".gpu"]`) and the time limit to give the run.
#   CHATGEN_PYTHON   a Python with chatgen's stack and pip (default: .venv/bin/python if it exists, else python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
carry="${CHATGEN_GPU_CARRY:-.gpu}"
default=python3
[[ -x .venv/bin/python ]] && default=.venv/bin/python
python="${CHATGEN_PYTHON:-$default}"
mkdir -p "$carry/wheels" "$carry/test-models"

# the versions: megatron-core as requirements*.txt pin it; the others as the CPU stack has them
wheels=(megatron-core==0.16.1 blake3==1.0.11 protobuf==7.36.2 tensorboard==2.21.0 tensorboard-data-server==0.7.2 matplotlib==3.11.2)
for spec in "${wheels[@]}"; do
  name=${spec%%==*}
  if compgen -G "$carry/wheels/${name//-/_}-${spec##*==}-*.whl" > /dev/null; then
    echo "[gpu_prepare] $spec: have it"
    continue
  fi
  echo "[gpu_prepare] $spec: downloading"
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --timeout 30 -d "$carry/wheels" "$spec"
done

CHATGEN_TEST_CACHE="$repo/$carry/test-models" PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" - <<'PY'
import sys
sys.path.insert(0, "tests")
from conftest import build_tiny_model
print("[gpu_prepare] test model:", build_tiny_model("tiny_llama"))
PY

size=$(du -sm "$carry" | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cm --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "[gpu_prepare] $carry: ${size} MiB; the working tree besides it: ${tree} MiB (the device tool carries 64 MiB)"
if (( size + tree > 60 )); then
  echo "[gpu_prepare] too big for one carry: remove what gpu_run.sh will not need" >&2
  exit 1
fi
