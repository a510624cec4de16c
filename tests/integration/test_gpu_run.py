"""scripts/gpu_run.sh in its CPU simulation mode: every step of the offline GPU tier runs (the GPU tests skip with
the reason, the probe at the tiny model's size), within its budget, leaving at most 8 result files.

    .venv/bin/python -m pytest tests/integration/test_gpu_run.py

~1-2 minutes on a quiet machine (4 under a load of 25 on 2 cores). On the GPU machine the same script runs the
real checks (docs/gpu.md).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 450


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the simulation mode is what runs without CUDA"
)
def test_gpu_run_passes_end_to_end_in_simulation(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    # the tiny model where the fixture built it
    env = {
        **os.environ,
        "OUT": str(out),
        "CHATGEN_PYTHON": sys.executable,
        "CHATGEN_GPU_BUDGET_S": str(BUDGET_S),
        "CHATGEN_TEST_CACHE": str(tiny_llama_dir.parent),
    }
    run = subprocess.run(
        ["bash", "scripts/gpu_run.sh"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUDGET_S + 60,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.json", "run.log", "env.json", "probe.json"} <= set(
        files
    ), files
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["mode"] == "simulation"
        and summary["failed"] == []
        and summary["used_s"] <= BUDGET_S
    )
    assert all(
        summary["steps"][s] == "ok"
        for s in ("pytest", "check_sync_fp32", "check_sync_bf16", "grpo", "grpo_fsdp_hf", "probe")
    ), summary["steps"]
    # the GPU tests skipped, with the reason in pytest.txt
    assert "skipped" in summary["figures"]["pytest"]
    assert "needs a CUDA GPU" in (out / "pytest.txt").read_text()
    figures = summary["figures"]
    assert (
        figures["check_sync_fp32"]["validated"]
        and figures["check_sync_fp32"]["max_abs_logprob_diff"] < 1e-4
    )
    # the grpo run (configs/grpo_tiny_hf.yaml with vLLM, Ray, fastapi and uvicorn hidden: the
    # environment of `pip install chatgen` without extras, in CI too): every episode, its plot,
    # tensorboard events and last checkpoint
    grpo = [json.loads(line) for line in (out / "grpo_metrics.jsonl").read_text().splitlines()]
    assert [e["episode"] for e in grpo] == [0, 1, 2] and figures["grpo_last_episode"][
        "episode"
    ] == 2
    outputs = figures["grpo_outputs"]
    assert "metrics.png" in outputs["files"] and outputs["tensorboard_files"] > 0, outputs
    assert "episode_000002" in outputs["checkpoints"], outputs
    # the fsdp trainer with the hf engine (megatron-core hidden): both episodes, finite figures, the
    # engine scoring as the trainer after the sync (fp32 here; bf16 on a GPU), its checkpoint written
    fsdp = figures["grpo_fsdp_hf"]
    # episode 0 is the evaluation before training
    assert [e["episode"] for e in fsdp["episodes"]] == [0, 1, 2], fsdp
    assert all(math.isfinite(v) for e in fsdp["episodes"] for v in e.values()), fsdp
    assert fsdp["episodes"][2]["mismatch/logprob_max_abs"] < 1e-4, fsdp
    assert {"chatgen_fsdp.json", "dcp", "model.safetensors.index.json"} <= set(fsdp["checkpoint"])
    assert set(figures["probe"]["phases"]) == {
        "build_model",
        "trainer_start",
        "train_step",
        "offload",
        "onload",
        "sync",
        "generate",
    }
