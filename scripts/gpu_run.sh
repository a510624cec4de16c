#!/usr/bin/env bash
# bash scripts/gpu_run.sh   (on the GPU machine, after `bash scripts/gpu_prepare.sh` here; docs/gpu.md)
#
# The offline GPU tier: the first checks of chatgen on a GPU, within a fixed budget, on a machine with no network
# and no vLLM / Ray (the one lent to sessions: one H100 or H200, python3 3.12 with torch and transformers).
#   1. installs what is missing from .gpu/wheels (megatron-core; blake3, protobuf, tensorboard, matplotlib if absent)
#      with pip --no-index --target, into a temporary directory (the machine's environment is not changed)
#   2. pytest tests/gpu (the tests that need only megatron-core; the vLLM ones skip with the reason)
#   3. chatgen check-sync --backend hf, fp32 and bf16: the trainer's weights synced into an hf engine
#   4. chatgen train configs/grpo_tiny_hf.yaml, 2 episodes on one GPU, bf16 (NCCL world, the trainer offloaded and
#      onloaded each episode, a checkpoint from the GPU)
#   4b. chatgen train configs/grpo_tiny_fsdp_hf.yaml, the same on the fsdp trainer (transformers + FSDP2, bf16
#      mixed precision): an RL loop with neither vLLM nor megatron-core; its metrics go into summary.json
#   5. scripts/gpu_probe.py: a ~360M-parameter model's train step, offload/onload, sync, generation, peak memory
# Each step is bounded with `timeout`; all together stay within CHATGEN_GPU_BUDGET_S (450). Without CUDA it runs
# in simulation (the GPU checks skipped with the reason, the probe at the tiny model's size): CI runs it so
# (tests/integration/test_gpu_run.py). At most 8 files go into the output folder:
#   run.log  summary.json  env.json  pytest.txt  check_sync_fp32.json  check_sync_bf16.json  grpo_metrics.jsonl
#   probe.json
# Variables: OUT or CHATGEN_GPU_OUT (the output folder; default outputs/gpu_run), CHATGEN_GPU_BUDGET_S,
# CHATGEN_PYTHON (default python3), CHATGEN_GPU_CARRY (what gpu_prepare.sh made; default .gpu),
# CHATGEN_TEST_CACHE (the test models; default $CHATGEN_GPU_CARRY/test-models).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${CHATGEN_GPU_OUT:-${OUT:-outputs/gpu_run}}"
carry="${CHATGEN_GPU_CARRY:-.gpu}"
python="${CHATGEN_PYTHON:-python3}"
budget="${CHATGEN_GPU_BUDGET_S:-450}"
deadline=$(( $(date +%s) + budget ))
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d /tmp/chatgen-gpu-run.XXXXXX)"
trap 'rm -rf "$work"' EXIT
exec > >(tee -a "$out/run.log") 2>&1

# Offline, loopback only; vLLM, Ray and the server stack hidden (absent there; hidden here, in simulation, so the
# same code paths run); the test models prebuilt by gpu_prepare.sh
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo
export PYTHONUNBUFFERED=1 CHATGEN_HIDE_PACKAGES=vllm,ray,fastapi,uvicorn
export CHATGEN_TEST_CACHE="${CHATGEN_TEST_CACHE:-$repo/$carry/test-models}"
export PYTHONPATH="$repo/scripts/hide_packages:$repo${PYTHONPATH:+:$PYTHONPATH}"

# each step's status, one file per step (a step may run in the background: see `beside`)
mkdir "$work/status"
note() { echo "[gpu_run $(date -u +%H:%M:%S)] $*"; }

# step NAME SECONDS COMMAND...: run COMMAND bounded by SECONDS and by what is left of the budget
step() {
  local name=$1 limit=$2 left rc
  shift 2
  left=$(( deadline - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    note "$name: skipped, ${left}s of the ${budget}s budget left"
    echo "skipped: budget" > "$work/status/$name"
    return 0
  fi
  note "$name: start (at most ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  note "$name: exit $rc after $(( $(date +%s) - t0 ))s"
  if (( rc == 124 || rc == 137 )); then echo "timeout after ${limit}s"
  elif (( rc == 0 )); then echo "ok"
  else echo "failed: exit $rc"; fi > "$work/status/$name"
}

# beside COMMAND...: a step that runs beside the next one. In simulation the steps share no device,
# so two run at a time (CI's two cores; each is mostly one core of imports); on the GPU one at a
# time, in this order. `settle` waits for it (by its id: a bare `wait` would wait for the tee too).
beside_pid=
beside() {
  if [[ $mode == simulation ]]; then "$@" & beside_pid=$!; else "$@"; fi
}
settle() {
  [[ -n $beside_pid ]] && wait "$beside_pid"
  beside_pid=
}

# 1. what is missing, from the carried wheels
missing=$("$python" - <<'PY'
import importlib.util
need = {"megatron": "megatron_core", "blake3": "blake3", "google.protobuf": "protobuf",
        "tensorboard": "tensorboard", "matplotlib": "matplotlib"}
def absent(module):
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is absent
        return True
print(" ".join(wheel for module, wheel in need.items() if absent(module)))
PY
)
wheels=()
for name in $missing; do
  found=("$carry"/wheels/"$name"-*.whl)
  [[ $name == tensorboard ]] && found+=("$carry"/wheels/tensorboard_data_server-*.whl)
  [[ -e ${found[0]} ]] || { note "install: $name is missing and $carry/wheels has no wheel of it (run gpu_prepare.sh)"; continue; }
  wheels+=("${found[@]}")
done
if (( ${#wheels[@]} )); then
  step install 120 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
    "${wheels[@]}"
  export PYTHONPATH="$work/site:$PYTHONPATH"
else
  note "install: nothing missing"
  echo "nothing missing" > "$work/status/install"
fi

cuda=$("$python" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [[ $cuda == 1 ]]; then mode=gpu; else mode=simulation; note "no CUDA: simulation (GPU checks skipped)"; fi

step env 30 "$python" - "$out/env.json" "$mode" <<'PY'
import json, subprocess, sys, importlib.metadata as md
import torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True) if torch.cuda.is_available() else None
env = dict(mode=sys.argv[2], python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
           gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           nvidia_smi=smi.stdout.strip() if smi else None,
           **{name: version(name) for name in ("megatron-core", "transformers", "protobuf", "tensorboard",
                                               "matplotlib", "transformer-engine")})
open(sys.argv[1], "w").write(json.dumps(env, indent=1) + "\n")
print(env)
PY

# the tiny model (prebuilt; built here if the carry lacks it) and a few prompts
model=$("$python" -c "import sys; sys.path.insert(0, 'tests'); from conftest import build_tiny_model; print(build_tiny_model('tiny_llama'))")
printf '{"prompt_ids": [5, 17, 99, 200]}\n{"prompt_ids": [1, 2, 3, 4, 5, 6, 7]}\n' > "$work/prompts.jsonl"

# 2. the gpu tests (on CPU they all skip: still collected, so an import error fails here too)
beside step pytest 170 bash -c "'$python' -m pytest tests/gpu -rs -q -p no:cacheprovider > '$out/pytest.txt' 2>&1; \
  rc=\$?; tail -25 '$out/pytest.txt'; exit \$rc"

# 3. check-sync, hf backend, fp32 and bf16; thresholds of tests/gpu (GPU kernels differ more than CPU ones)
check_sync() {
  step "check_sync_$1" 60 "$python" -m chatgen.cli check-sync --backend hf --hf-checkpoint "$model" \
    --input "$work/prompts.jsonl" --output "$out/check_sync_$1.json" --max-new-tokens 6 --validate \
    --dtype "$2" --threshold "$3"
}
check_sync fp32 float32 1e-3
settle
beside check_sync bf16 bfloat16 0.25

# 4. two GRPO episodes, hf backend, one GPU, bf16
"$python" -m chatgen.tasks --output "$work/data" --n-train 64 --n-eval 8 > /dev/null
gpu_keys=()
[[ $mode == gpu ]] && gpu_keys=(models.policy.num_gpu=1 models.policy_trainer.num_gpu=1 policy.dtype=bfloat16
                                policy_trainer.dtype=bfloat16)
step grpo 120 "$python" -m chatgen.cli train configs/grpo_tiny_hf.yaml "policy.load=$model" \
  "policy_trainer.load=$model" "runtime.data_path=$work/data/train.jsonl" "runtime.eval_data_path=$work/data/eval.jsonl" \
  "runtime.output_dir=$work/grpo" runtime.num_episode=2 runtime.sample_per_episode=32 \
  runtime.train_micro_batch_size=16 runtime.train_global_batch_size=16 runtime.save_episode_interval=2 \
  runtime.eval_episode_interval=2 runtime.max_bad_train_steps=100 policy.n=4 "${gpu_keys[@]}"
settle
[[ -f $work/grpo/metrics.jsonl ]] && cp "$work/grpo/metrics.jsonl" "$out/grpo_metrics.jsonl"
[[ -d $work/grpo/checkpoints/episode_000002 ]] && note "grpo: checkpoint episode_000002 written"

# 4b. the same two episodes with the trainer on fsdp (needs torch and transformers only); megatron-core and
# PEFT hidden too, so that an import of either fails here and not only where it is absent
beside step grpo_fsdp_hf 100 env CHATGEN_HIDE_PACKAGES="$CHATGEN_HIDE_PACKAGES,megatron,peft" \
  "$python" -m chatgen.cli train configs/grpo_tiny_fsdp_hf.yaml "policy.load=$model" \
  "policy_trainer.load=$model" "runtime.data_path=$work/data/train.jsonl" "runtime.eval_data_path=$work/data/eval.jsonl" \
  "runtime.output_dir=$work/grpo_fsdp_hf" runtime.num_episode=2 runtime.sample_per_episode=16 \
  runtime.train_micro_batch_size=16 runtime.train_global_batch_size=16 runtime.save_episode_interval=2 \
  runtime.eval_episode_interval=2 runtime.max_bad_train_steps=100 policy.n=4 "${gpu_keys[@]}"

# 5. the probe (the tiny model's size in simulation)
small=()
[[ $mode == simulation ]] && small=(--small)
step probe 150 "$python" scripts/gpu_probe.py --output "$out/probe.json" "${small[@]}"
settle

# summary: every step's status, the figures that matter
for f in "$work"/status/*; do echo "$(basename "$f")=$(cat "$f")"; done > "$work/status.txt"
"$python" - "$out" "$mode" "$budget" "$(( budget - (deadline - $(date +%s)) ))" "$work/status.txt" \
  "$work/grpo_fsdp_hf" "$work/grpo" <<'PY'
import json, sys
from pathlib import Path
out, mode, budget, used, status_file = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
fsdp_run, grpo_run = Path(sys.argv[6]), Path(sys.argv[7])
steps = dict(line.rstrip("\n").split("=", 1) for line in open(status_file) if "=" in line)
def read(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
figures = {}
for short in ("fp32", "bf16"):
    r = read(f"check_sync_{short}.json")
    if r:
        figures[f"check_sync_{short}"] = dict(max_abs_logprob_diff=r["max_abs_logprob_diff"], validated=r["validated"],
                                              sync_seconds=r["sync_seconds"], sync_bytes=r["sync_bytes"])
def episode_figures(line):
    return {k: v for k, v in json.loads(line).items() if k.startswith(("memory/", "time/", "mismatch/"))
            or k in ("episode", "reward/mean", "eval/reward", "policy/loss", "policy/grad_norm")}
metrics = out / "grpo_metrics.jsonl"
if metrics.exists():
    figures["grpo_last_episode"] = episode_figures(metrics.read_text().splitlines()[-1])
# the fsdp run's metrics live here (the output folder keeps to 8 files): every episode, and its checkpoint
# what the grpo run left besides its metrics: its plot, its tensorboard events, its checkpoints
if grpo_run.is_dir():
    figures["grpo_outputs"] = dict(
        files=sorted(p.name for p in grpo_run.iterdir()),
        tensorboard_files=sum(1 for _ in (grpo_run / "tensorboard").rglob("*")),
        checkpoints=sorted(p.name for p in (grpo_run / "checkpoints").glob("episode_*")))
if (fsdp_run / "metrics.jsonl").exists():
    checkpoint = fsdp_run / "checkpoints" / "episode_000002" / "policy_trainer"
    figures["grpo_fsdp_hf"] = dict(
        episodes=[episode_figures(line) for line in (fsdp_run / "metrics.jsonl").read_text().splitlines()],
        checkpoint=sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else None)
if (probe := read("probe.json")):
    figures["probe"] = probe
pytest_txt = out / "pytest.txt"
if pytest_txt.exists():
    figures["pytest"] = pytest_txt.read_text().strip().splitlines()[-1]
skipped = [] if mode == "gpu" else ["no CUDA: the gpu tests skip, the phases run on CPU at the tiny size"]
failed = sorted(k for k, v in steps.items() if not v.startswith(("ok", "nothing")))
summary = dict(mode=mode, budget_s=budget, used_s=used, steps=steps, failed=failed, skipped=skipped, figures=figures)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(dict(mode=mode, used_s=used, steps=steps, failed=failed)))
sys.exit(1 if failed else 0)
PY
rc=$?
note "done: exit $rc, results in $out ($(ls "$out" | wc -l) files)"
exit $rc
