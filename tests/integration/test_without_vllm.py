"""chatgen without vLLM, Ray or fastapi (the GPU machine's environment, and `pip install chatgen` without extras):
a config that needs vLLM says which extra to install. (`chatgen train configs/grpo_tiny_hf.yaml` running to exit 0
so, on the hf backend and the Megatron trainer, with its metrics, plot, tensorboard events and checkpoint:
tests/integration/test_gpu_run.py, whose scripts/gpu_run.sh runs it with the same packages hidden.)

    .venv/bin/python -m pytest tests/integration/test_without_vllm.py

The packages are hidden from a subprocess by scripts/hide_packages (None in sys.modules), so the code paths really
run without them, in this venv, without network.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HIDDEN = "vllm,ray,fastapi,uvicorn"


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
