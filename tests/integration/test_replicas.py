"""Generation replicas on a local Ray, end to end with the real vLLM, megatron-core and Ray on the tiny Llama.

    python -m pytest tests/integration/test_replicas.py        # ~30 s on 2 idle CPU cores (~3 min under load 15-20)

Colocated: a TP 2 trainer whose two ranks each host one replica of the policy (vLLM TP 1, independent of the
trainer's TP): both replicas generate, and each samples exactly what the trainer computes after every in-place
sync. Disaggregated: two replicas in a group of their own, fed by one broadcast from the trainer's rank 0; then
one replica's process dies in the middle of an episode: the run stops within seconds naming it, and the last
checkpoint stays whole. Also a same-host shared-memory weight load (`update_weights_via_ipc`) into a real engine.
"""

import json
import time
from pathlib import Path

import pytest
from helpers import TASK_N_EVAL

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYNC_TOL = 1e-4  # fp32: vLLM vs Megatron log-probs of the same weights differ by ~1e-6


@pytest.fixture(scope="module")
def warm_model(tiny_llama_dir, data_dir, tmp_path_factory):
    """The tiny Llama after a few SFT steps: it writes digits, so rewards vary within a group and GRPO's steps
    are not zero."""
    from helpers import quick_warm_start

    from chatgen.core.jsonl import read_prompt_records

    return quick_warm_start(
        tiny_llama_dir,
        read_prompt_records(data_dir / "sft.jsonl"),
        tmp_path_factory.mktemp("warm") / "model",
    )


def overrides(model, data_dir, out_dir, **extra):
    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out_dir),
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 1,
        "runtime.save_episode_interval": 1,
        "runtime.algorithm.old_logprobs": "recompute",
        "models.policy.num_replicas": 2,
        "policy.load": model,
        "policy.n": 4,
        "policy_trainer.load": model,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def read_metrics(out_dir):
    return {
        r["episode"]: r
        for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines())
    }


def test_colocated_replicas_tile_a_tp2_trainer(
    ray_session, warm_model, data_dir, tmp_path, monkeypatch
):
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    out = tmp_path / "colocated"
    cfg = load_config(
        REPO / "configs/grpo_tiny.yaml",
        overrides(
            warm_model,
            data_dir,
            out,
            **{"runtime.num_episode": 2, "policy_trainer.tensor_model_parallel_size": 2},
        ),
    )
    grpo.train(cfg, log=lambda *_: None)
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]
    for episode in (1, 2):
        m = metrics[episode]
        # every sample of both replicas (recomputed old log-probs: all of them) scored by the TP 2 trainer
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL and m["policy/grad_norm"] > 0
        # 32 samples (8 prompts x n=4) plus 8 greedy held-out ones, over both replicas
        assert m["replica/0/samples"] + m["replica/1/samples"] == 32 + TASK_N_EVAL
        assert m["replica/0/samples"] > 0 and m["replica/1/samples"] > 0
        assert m["replica/0/tokens_per_s"] > 0 and m["replica/1/tokens_per_s"] > 0


@pytest.mark.faults
def test_disaggregated_replicas_then_one_dies_mid_episode(
    ray_session, warm_model, data_dir, tmp_path, monkeypatch, capsys
):
    from chatgen.cli import main
    from chatgen.rlhf import checkpoint as ckpt

    monkeypatch.chdir(REPO)
    out, stamp = tmp_path / "disaggregated", tmp_path / "died_at"
    # The policy's replicas on their own ranks, the trainer on another: weights go by broadcast. Generation calls
    # of each replica: eval 0 (1), episode 1 (2, 3), episode 2 (4, 5), episode 3 (6): replica 1 dies in
    # episode 3's sampling, after checkpoints 1 and 2.
    args = overrides(
        warm_model,
        data_dir,
        out,
        **{
            "runtime.num_episode": 3,
            "runtime.colocation": "[[policy, reward]]",
            "models.policy_trainer.num_cpu": 1,
            "models.policy.model_class": "dying_policy:DyingPolicy",
            "policy.args.die_on_rank": 1,
            "policy.args.die_on_call": 6,
            "policy.args.stamp": stamp,
        },
    )
    assert main(["train", str(REPO / "configs/grpo_tiny.yaml"), *args]) == 1
    stopped = time.time()
    err = capsys.readouterr().err
    assert "an actor died during policy.run_generation (replica 1, rank 1)" in err, err[-3000:]
    # reported (and every actor stopped) within seconds
    assert stopped - float(stamp.read_text()) < 20
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]
    # episode 2 sampled after the first broadcast: both replicas hold exactly the trainer's weights
    assert metrics[2]["mismatch/logprob_max_abs"] < SYNC_TOL
    assert metrics[2]["replica/0/samples"] > 0 and metrics[2]["replica/1/samples"] > 0
    # whole, by its manifest
    assert ckpt.resume_point(out / "checkpoints", None).name == "episode_000002"


def test_weights_through_shared_memory_into_an_engine(tiny_llama_dir):
    """update_weights_via_ipc's engine end: the trainer's signed file in /dev/shm, mapped and loaded by a real
    engine (started on random weights: only the load can make it the model); a wrong token is refused first."""
    from helpers import engine, generate, generated_diff_vs_hf
    from safetensors.torch import load_file

    from chatgen.param_sync import ShmSender, SyncError, load_shm

    llm = engine(tiny_llama_dir)
    try:
        state = load_file(str(tiny_llama_dir / "model.safetensors"))
        sender = ShmSender.owned("secret")
        handles = sender.write(list(state.items()))
        with pytest.raises(SyncError, match="not signed with this run's token"):
            load_shm(llm, handles, "another")
        assert generated_diff_vs_hf(tiny_llama_dir, generate(llm)) > 1e-2
        report = load_shm(llm, handles, "secret")
        assert report.tensors == len(state) and llm.weight_version == 1
        assert generated_diff_vs_hf(tiny_llama_dir, generate(llm)) < SYNC_TOL
        sender.close()
        assert not Path(handles["path"]).exists()
    finally:
        llm.shutdown()
