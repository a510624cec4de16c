"""The hf backend with a Megatron trainer: `chatgen check-sync --backend hf` and configs/grpo_tiny_hf.yaml.

    .venv/bin/python -m pytest tests/integration/test_hf_runs.py

(Apart from test_hf_generation.py: a run in this process leaves torch.distributed as Megatron left it, which an
in-process vLLM engine of that file must not meet when it shuts down.)
"""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4  # fp32: the trainer and the hf model differ by ~1e-6


@pytest.mark.parametrize("family, train_tp", [("tiny_llama", 1), ("tiny_qwen2", 2)])
def test_check_sync_cli_hf_backend(make_tiny, tmp_path, family, train_tp):
    """`chatgen check-sync --backend hf`: Megatron's weights synced into a random hf model give the trainer's
    log-probs (colocated for TP 1; TP 2 streams from two trainer processes)."""
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in [[5, 17, 99, 200], [1, 2, 3, 4, 5]])
    )
    out = tmp_path / "check.json"
    rc = main(
        [
            "check-sync",
            "--backend",
            "hf",
            "--hf-checkpoint",
            str(make_tiny(family)),
            "--train-tp",
            str(train_tp),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "6",
            "--validate",
        ]
    )
    result = json.loads(out.read_text())
    assert (
        rc == 0
        and result["backend"] == "hf"
        and result["max_abs_logprob_diff"] < TOL
        and result["validated"]
    )
    assert result["mode"] == ("colocated" if train_tp == 1 else "cross-process")
    assert all(
        len(s["engine_logprobs"]) == len(s["trainer_logprobs"]) == 6 for s in result["samples"]
    )


def test_grpo_tiny_hf_runs_and_syncs_exactly(tiny_llama_dir, tmp_path, monkeypatch):
    """configs/grpo_tiny_hf.yaml, shortened: two episodes in one process; the policy's log-probs equal the
    trainer's after each sync (the first optimizer step's mismatch)."""
    from chatgen import tasks
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    out, data = tmp_path / "run", tmp_path / "data"
    tasks.write_task_data(str(data), n_train=32, n_eval=8)
    overrides = {
        "runtime.data_path": data / "train.jsonl",
        "runtime.eval_data_path": data / "eval.jsonl",
        "runtime.output_dir": out,
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 2,
        "runtime.save_episode_interval": 2,
        "policy.load": tiny_llama_dir,
        "policy.n": 4,
        "policy_trainer.load": tiny_llama_dir,
    }
    cfg = load_config(
        REPO / "configs/grpo_tiny_hf.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )
    assert type(cfg.models["policy"].config).__name__ == "HFConfig"
    grpo.train(cfg, log=lambda *_: None)
    metrics = {
        r["episode"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(metrics) == [0, 1, 2] and 0 <= metrics[2]["eval/reward"] <= 1
    for episode in (1, 2):
        assert (
            metrics[episode]["mismatch/logprob_max_abs"]
            < TOL
            < metrics[episode]["policy/old_logprob_diff_max"]
        )
