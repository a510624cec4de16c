#!/usr/bin/env bash
# bash scripts/setup_env.sh
#
# Creates (or reuses) the chatgen virtual environment and prints nothing else of note when it is current.
# Idempotent: a second run with unchanged requirements only re-checks the imports (~15 s).
#   CHATGEN_VENV          where the environment lives (default: <repo>/.venv)
#   CHATGEN_REQUIREMENTS  which pin file to install (default: requirements.txt, the CPU stack;
#                         requirements-gpu.txt on CUDA machines)
#   CHATGEN_PYTHON        the interpreter to build the venv from (default: python3.11, else python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHATGEN_VENV:-$repo/.venv}"
reqs="$repo/${CHATGEN_REQUIREMENTS:-requirements.txt}"
py="${CHATGEN_PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp="$venv/.chatgen-stamp"
# What the pin file brings that chatgen removes again: its "# chatgen-remove:" line (why: in the file).
unneeded="$(sed -n 's/^# chatgen-remove: *//p' "$reqs")"
# the environment adapters' packages, installed without their declared dependencies (why: in the file)
nodeps="$repo/requirements-verifiers.txt"
want="$(cat "$reqs" "$nodeps" "$repo/setup.py" | sha256sum | cut -d' ' -f1)"

# bubblewrap isolates the code sandbox (chatgen/sandbox.py, docs/agents.md); without it the sandbox
# falls back to weaker isolation. Installed where this runs as root with apt; skipped silently otherwise.
if ! command -v bwrap >/dev/null && [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq bubblewrap || (apt-get update -qq && apt-get install -y -qq bubblewrap)) \
    >/dev/null 2>&1 || true
fi

check_imports() {
  # The four must import together in one process: this is what the torchvision trap breaks.
  (cd / && "$venv/bin/python" -c "import transformers, vllm, megatron.core, ray, sentencepiece, chatgen") 2>/dev/null
}

# The venv may be shared between clones (CHATGEN_VENV): its editable `chatgen` must be this checkout's.
points_here() {
  # (from /, so that a `chatgen` folder in the current directory does not answer for the installed one)
  [[ "$(cd / && "$venv/bin/python" -c 'import chatgen, os; print(os.path.dirname(os.path.dirname(os.path.realpath(chatgen.__file__))))' 2>/dev/null)" == "$(realpath "$repo")" ]]
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && check_imports; then
  if ! points_here; then
    echo "[chatgen] pointing $venv at this checkout ($repo)" >&2
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" >/dev/null 2>&1
    points_here || { echo "[chatgen] could not install $repo into $venv" >&2; exit 1; }
  fi
  exit 0
fi

log="$(mktemp -t chatgen-setup.XXXXXX.log)"
echo "[chatgen] setting up $venv from $(basename "$reqs") (first run takes a few minutes; log: $log)" >&2
pip_run() {
  if ! "$venv/bin/python" -m pip "$@" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "[chatgen] 'pip $*' failed; full log: $log" >&2
    exit 1
  fi
}
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip_run install --upgrade pip
pip_run install -r "$reqs"
pip_run install --no-deps -r "$nodeps"
[[ -z "$unneeded" ]] || pip_run uninstall -y $unneeded
pip_run install --no-deps --no-build-isolation -e "$repo"
if ! check_imports; then
  "$venv/bin/python" -c "import transformers, vllm, megatron.core, ray, sentencepiece, chatgen"  # show the error
  exit 1
fi
echo "$want" > "$stamp"
echo "[chatgen] environment ready: source $venv/bin/activate" >&2
