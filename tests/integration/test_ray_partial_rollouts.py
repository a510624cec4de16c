"""Partial rollouts across processes: a vLLM engine in a Ray actor of its own takes weights between its
engine steps while a generation call runs (chatgen.rlhf.runtime: an engine actor apart serves calls
concurrently).

    python -m pytest tests/integration/test_ray_partial_rollouts.py   # ~40 s on 2 idle CPU cores

The short test drives the actor directly: one generation call of long samples, and a same-host shared-memory
weight load (mode keep) while it runs; every sample's tokens then come from two weight versions, the later
ones after the load. The slow one runs asynchronous GRPO (max_staleness 2) with the policy in an actor
of its own: samples span versions and no trained token is more than 2 versions stale.
"""

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _steps_run(worker, name):
    return worker.models[name].engine_loop.steps_run


def policy_only(cfg):
    """The run's config with only its policy, in a group of its own (an actor apart)."""
    runtime = dataclasses.replace(cfg.runtime, colocation=[], launcher="ray")
    return dataclasses.replace(cfg, runtime=runtime, models={"policy": cfg.models["policy"]})


def test_weights_land_while_a_ray_hosted_engine_generates(ray_session, tiny_llama_dir, data_dir):
    from safetensors.torch import load_file

    from chatgen.param_sync import ShmSender
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.runtime import Runtime, engines_apart

    cfg = load_config(
        REPO / "configs/grpo_tiny.yaml",
        [
            f"policy.load={tiny_llama_dir}",
            f"policy_trainer.load={tiny_llama_dir}",
            f"runtime.data_path={data_dir}/train.jsonl",
            "policy.n=2",
            "policy.max_new_tokens=48",
            "policy.ignore_eos=true",
            "policy.stop_token_list=''",  # EOS only, which ignore_eos ignores: 48 tokens each
        ],
    )
    cfg = policy_only(cfg)
    assert engines_apart(cfg, ["policy"])
    runtime = Runtime.start(cfg, log=lambda *_: None)
    try:
        policy = runtime["policy"]
        items = [{"input_ids": [1, 5 + i, 9, 12]} for i in range(4)]
        result = {}
        gen = threading.Thread(target=lambda: result.update(batch=policy.run_generation(items)))
        gen.start()
        # the actor answers while its generation call runs: it is past a few engine steps
        deadline = time.monotonic() + 120
        while policy.run(_steps_run, "policy")[0] < 8:
            assert gen.is_alive(), "the call finished before the update could land mid-generation"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sender = ShmSender.owned(policy.token)
        handles = sender.write(list(load_file(str(tiny_llama_dir / "model.safetensors")).items()))
        try:
            reports = policy.load_shared_weights(handles, mode="keep")
        finally:
            sender.close()
        assert gen.is_alive(), "the update waited for the generation call (one call at a time)"
        assert reports[0].tensors > 0 and policy.weight_versions() == [1]
        gen.join(timeout=300)
        versions = result["batch"].weight_versions  # (S, T): -1 past a sample's end
        assert versions.shape[0] == 8
        for row in versions.tolist():
            generated = [v for v in row if v >= 0]
            assert len(generated) == 48
            # one sample, two weight versions, in order: the first tokens before the load, the rest after
            assert generated[0] == 0 and generated[-1] == 1 and generated == sorted(generated)
    finally:
        runtime.shutdown()


@pytest.mark.slow
def test_async_grpo_with_the_policy_in_its_own_actor(
    ray_session, tiny_llama_dir, data_dir, tmp_path
):
    """max_staleness 2 with the policy disaggregated on Ray: the weights reach the engine actor while
    the batches ahead generate (handover_step 4 holds them for it), so samples span two versions, and
    no trained token is more than 2 versions stale (per token, as the update received them)."""
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.algorithms.grpo import loop
    from chatgen.rlhf.config import load_config

    # each episode's (per-token weight versions, loss mask, the engine's version) as the update got them
    seen, real = [], loop.update

    def spy(run, batch, rewards, n, **kw):
        seen.append(
            (
                batch.weight_versions.clone(),
                batch.loss_mask.clone(),
                run.policy.weight_versions()[0],
            )
        )
        return real(run, batch, rewards, n, **kw)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(loop, "update", spy)
    out = tmp_path / "ray_async"
    episodes = 4
    try:
        cfg = load_config(
            REPO / "configs/grpo_tiny.yaml",
            [
                f"{k}={v}"
                for k, v in {
                    "policy.load": tiny_llama_dir,
                    "policy_trainer.load": tiny_llama_dir,
                    "runtime.data_path": f"{data_dir}/train.jsonl",
                    "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
                    "runtime.output_dir": out,
                    "runtime.launcher": "ray",
                    "runtime.colocation": "[[policy_trainer, reward]]",  # the policy apart
                    "runtime.sample_per_episode": 32,
                    "runtime.train_micro_batch_size": 32,
                    "runtime.train_global_batch_size": 32,
                    "runtime.num_episode": episodes,
                    "runtime.eval_episode_interval": episodes,
                    "runtime.save_episode_interval": episodes,
                    "runtime.algorithm.max_staleness": 2,
                    "runtime.algorithm.handover_step": 4,
                    "runtime.algorithm.old_logprobs": "rollout",
                    "models.policy_trainer.num_cpu": 1,
                    "models.policy.num_cpu": 1,
                    "policy.n": 4,
                }.items()
            ],
        )
        grpo.train(cfg, log=lambda *_: None)
    finally:
        monkeypatch.undo()
    assert len(seen) == episodes
    worst = spanning = 0
    for versions, mask, current in seen:
        trained = (mask > 0) & (versions >= 0)
        worst = max(worst, int((current - versions[trained]).max()))
        generated = versions >= 0
        newest = torch.where(generated, versions, -1).max(dim=1).values
        oldest = torch.where(generated, versions, 10**9).min(dim=1).values
        spanning += int((generated.any(dim=1) & (newest > oldest)).sum())
    assert worst <= 2  # the bound, token by token
    assert spanning > 0  # partial rollouts across processes: samples of two weight versions
