# source examples/env.sh   (every launch script does, from the project root: a chatgen clone or a `chatgen init` project)
#
# Which chatgen the scripts run: in a chatgen clone, its own environment (scripts/setup_env.sh sets it up on first
# use; CHATGEN_VENV / CHATGEN_REQUIREMENTS choose another); in a project made by `chatgen init`, the chatgen on
# PATH (the environment you ran `chatgen init` from: activate it first).
if [[ -f scripts/setup_env.sh ]]; then
  bash scripts/setup_env.sh
  export PATH="${CHATGEN_VENV:-$PWD/.venv}/bin:$PATH"
fi
if ! command -v chatgen >/dev/null; then
  echo "chatgen is not on PATH: activate the environment it is installed in (e.g. source <chatgen clone>/.venv/bin/activate)" >&2
  exit 1
fi
export OMP_WAIT_POLICY=PASSIVE   # shared CPU cores: spinning OpenMP threads slow the tiny model's steps ~10x
