"""chatgen without vLLM, Ray or fastapi (the GPU machine's environment, and `pip install chatgen` without extras):
`chatgen train configs/grpo_tiny_hf.yaml` runs to exit 0 on the hf backend and the Megatron trainer.

    .venv/bin/python -m pytest tests/integration/test_without_vllm.py

The packages are hidden from a subprocess by scripts/hide_packages (None in sys.modules), so the code paths really
run without them, in this venv, without network.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HIDDEN = "vllm,ray,fastapi,uvicorn"


def test_grpo_tiny_hf_trains_without_vllm_ray_or_fastapi(tiny_llama_dir, tmp_path):
    from chatgen import tasks

    data, out = tmp_path / "data", tmp_path / "run"
    tasks.write_task_data(str(data), n_train=32, n_eval=8)
    env = {
        **os.environ,
        "CHATGEN_HIDE_PACKAGES": HIDDEN,
        "PYTHONPATH": os.pathsep.join([str(REPO / "scripts" / "hide_packages"), str(REPO)]),
    }
    overrides = {
        "runtime.data_path": data / "train.jsonl",
        "runtime.eval_data_path": data / "eval.jsonl",
        "runtime.output_dir": out,
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 16,
        "runtime.train_micro_batch_size": 8,
        "runtime.train_global_batch_size": 8,
        "runtime.eval_episode_interval": 2,
        "runtime.save_episode_interval": 2,
        "runtime.max_bad_train_steps": 100,  # an untrained model: most groups all-zero, no gradient
        "policy.load": tiny_llama_dir,
        "policy.n": 4,
        "policy_trainer.load": tiny_llama_dir,
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "chatgen.cli",
            "train",
            "configs/grpo_tiny_hf.yaml",
            *[f"{k}={v}" for k, v in overrides.items()],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    episodes = [
        json.loads(line)["episode"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert episodes == [0, 1, 2] and (out / "checkpoints" / "episode_000002").is_dir()
    assert (out / "metrics.png").exists() and any((out / "tensorboard").iterdir())


def test_a_vllm_config_says_which_extra_to_install(tiny_llama_dir, tmp_path):
    """configs/grpo_tiny.yaml (backend: vllm) without vLLM: exit 2 before anything starts, naming chatgen[vllm]."""
    from chatgen import tasks

    tasks.write_task_data(str(tmp_path / "data"), n_train=64, n_eval=8)
    env = {
        **os.environ,
        "CHATGEN_HIDE_PACKAGES": HIDDEN,
        "PYTHONPATH": os.pathsep.join([str(REPO / "scripts" / "hide_packages"), str(REPO)]),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "chatgen.cli",
            "train",
            "configs/grpo_tiny.yaml",
            f"policy.load={tiny_llama_dir}",
            f"policy_trainer.load={tiny_llama_dir}",
            f"runtime.output_dir={tmp_path / 'run'}",
            f"runtime.data_path={tmp_path}/data/train.jsonl",
            f"runtime.eval_data_path={tmp_path}/data/eval.jsonl",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "models.policy (backend: vllm)" in run.stderr, run.stderr[-3000:]
    assert "pip install 'chatgen[vllm]'" in run.stderr and "Traceback" not in run.stderr
