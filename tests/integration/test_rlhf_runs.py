"""RLHF engines end to end on CPU with real Ray actors, vLLM, megatron-core and the tiny Llama.

    python -m pytest tests/integration/test_rlhf_runs.py

One Ray instance serves all tests. GRPO: a 3-episode run whose reward model fails in episode 3 (the run
stops with the actor's error; checkpoints 1 and 2 stay intact), then `--resume` runs episode 3 from checkpoint
2. PPO: 2 episodes with the policy and the trainers in separate processes (cross-process weight sync), the
Megatron models data parallel on 2 ranks, truncated importance sampling on; every socket the PPO run listens
on is loopback.
What is checked: parameters changed, vLLM's log-probs equal the trainer's after each sync (float noise),
metrics/TensorBoard/plot written, the resumed run continues the data position and optimizer state.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import is_loopback, listening_sockets

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYNC_TOL = 1e-4  # fp32: vLLM vs Megatron log-probs of the same weights differ by ~1e-6


from chatgen.module import Module  # noqa: E402


class FailingReward(Module):
    """The rule reward, except that its `fail_on_call`-th call raises (imported inside the Ray actor)."""

    def setup(self):
        from chatgen.rlhf.rewards import RuleReward

        config = dict(self.config)
        self.fail_on_call, self.calls = config.pop("fail_on_call"), 0
        self.inner = RuleReward(config).start()

    def score(self, data):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError(f"injected reward failure on call {self.calls}")
        return self.inner.score(data)


def overrides(model_dir, data_dir, out_dir, **extra):
    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out_dir),
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 1,
        "runtime.save_episode_interval": 1,
        "policy.load": model_dir,
        "policy.n": 4,
        "policy_trainer.load": model_dir,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def read_metrics(out_dir):
    return {
        r["episode"]: r
        for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines())
    }


def iteration(checkpoint_dir, model="policy_trainer"):
    return json.loads((Path(checkpoint_dir) / model / "chatgen_megatron.json").read_text())[
        "iteration"
    ]


def trainer_weights(checkpoint_dir, model="policy_trainer"):
    """A trainer's weights in an episode checkpoint, as HF tensors (its megatron distributed checkpoint read whole)."""
    from chatgen.models.convert import megatron_checkpoint_to_hf

    return megatron_checkpoint_to_hf(Path(checkpoint_dir) / model)[1]


def test_grpo_fails_cleanly_then_resumes(
    ray_session, tiny_llama_dir, data_dir, tmp_path, capsys, monkeypatch
):
    import ray

    from chatgen.cli import main
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    out = tmp_path / "grpo"
    # grpo_tiny plus a reference in the same process (kl_coef stays 0: it reports kl/reference)
    common = [
        *overrides(tiny_llama_dir, data_dir, out),
        "models.reference.backend=megatron",
        f"models.reference.model_config_file={REPO}/configs/grpo_tiny/trainer.yaml",
        f"reference.load={tiny_llama_dir}",
        "runtime.colocation=[[policy, policy_trainer, reference, reward]]",
    ]
    # Reward calls: eval at 0, then per episode the samples and the eval -> call 6 is episode 3's samples.
    failing = [
        "models.reward.model_class=test_rlhf_runs:FailingReward",
        "reward.fail_on_call=6",
        "runtime.num_episode=3",
    ]
    with listening_sockets() as seen:  # in this process (launcher auto -> local): loopback only too
        assert main(["train", str(REPO / "configs/grpo_tiny.yaml"), *common, *failing]) == 1
    assert seen and not [entry for entry in seen if not is_loopback(entry[1])], seen
    err = capsys.readouterr().err
    assert "injected reward failure on call 6" in err and "reward.score" in err
    # one group of one rank: the run ran in this process (runtime.launcher auto -> local), and it took its models
    # down on the way out (engine, Megatron groups, torch.distributed), without touching Ray
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]

    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]  # episode 3 died before logging
    for episode in (1, 2):
        m = metrics[episode]
        # vLLM sampled with exactly the trainer's weights
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["time/train"] > 0 and "eval/reward" in m
    assert metrics[2]["kl/reference"] > 1e-3  # the policy moved away from the reference...
    # ...and vLLM followed it: episode 2 sampled after the first sync, and matched the trainer to float noise.
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "episode_000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "episode_000001",
        "episode_000002",
        "latest",
    ]
    assert (
        iteration(checkpoints / "episode_000002")
        == 2 * iteration(checkpoints / "episode_000001")
        == 4
    )
    before, after = (
        trainer_weights(checkpoints / "episode_000001"),
        trainer_weights(checkpoints / "episode_000002"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in before)  # parameters changed
    assert (out / "metrics.png").exists() and any((out / "tensorboard").iterdir())
    saved_state = json.loads((checkpoints / "episode_000002" / "engine_state.json").read_text())

    # (The resumed run also evaluates with sampling, n=4 responses per held-out prompt.)
    cfg = load_config(
        REPO / "configs/grpo_tiny.yaml",
        [*common, "runtime.num_episode=3", "policy.eval_temperature=1.0"],
    )
    last = grpo.train(cfg, resume=True, log=lambda *_: None)
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2, 3]
    # resumed weights were synced into vLLM
    assert metrics[3]["mismatch/logprob_max_abs"] < SYNC_TOL
    # The trainer continued from checkpoint 2 (weights and optimizer), not from the initial model: its KL to
    # the reference is of the size reached by then, and its step counter went on from 4.
    assert metrics[3]["kl/reference"] > 0.3 * metrics[2]["kl/reference"]
    assert iteration(checkpoints / "episode_000003") == 6
    state3 = json.loads((checkpoints / "episode_000003" / "engine_state.json").read_text())
    prompts_per_episode = 32 // 4
    assert state3["sampler"]["index"] == saved_state["sampler"]["index"] + prompts_per_episode
    assert last["reward/mean"] == metrics[3]["reward/mean"] and 0 <= metrics[3]["eval/reward"] <= 1


def test_grpo_rollout_logprobs_and_overlapped_generation(
    tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    """old_logprobs: rollout skips the trainer's old log-prob pass (the mismatch is then measured in the first
    optimizer step); overlap_generation samples episode k+1 with the weights before episode k's update. The
    first run also has the engine release its weights and KV cache while the trainer trains
    (release_during_training): the engine's log-probs still match the trainer's in every episode."""
    from chatgen.generation.vllm.adapter import cpu_release
    from chatgen.rlhf import checkpoint as ckpt
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    releases = []
    real_release = cpu_release.release
    monkeypatch.setattr(cpu_release, "release", lambda llm: releases.append(1) or real_release(llm))

    monkeypatch.chdir(REPO)
    rollout = {
        "runtime.algorithm.old_logprobs": "rollout",
        "runtime.num_episode": 3,
        "runtime.eval_episode_interval": 3,
    }
    # two optimizer steps per episode (train_global_batch_size 16 of 32 samples)
    out = tmp_path / "rollout"
    grpo.train(
        load_config(
            REPO / "configs/grpo_tiny.yaml",
            overrides(
                tiny_llama_dir,
                data_dir,
                out,
                **rollout,
                **{"policy.release_during_training": True},
            ),
        ),
        log=lambda *_: None,
    )
    assert len(releases) == 3  # once an episode, when training began
    metrics = read_metrics(out)
    for episode in (1, 2, 3):
        m = metrics[episode]
        assert m.get("time/old_logprobs", 0.0) == 0.0  # no trainer pass
        # sampled with exactly the trainer's weights: the first step's log-probs match the engine's; the second
        # step's differ by the first update
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL < m["policy/old_logprob_diff_max"]
    assert metrics[3]["policy/grad_norm"] > 0

    one_step = {**rollout, "runtime.train_global_batch_size": 32}

    out = tmp_path / "overlap"
    grpo.train(
        load_config(
            REPO / "configs/grpo_tiny.yaml",
            overrides(
                tiny_llama_dir,
                data_dir,
                out,
                **one_step,
                **{"runtime.algorithm.overlap_generation": True},
            ),
        ),
        log=lambda *_: None,
    )
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2, 3] and "eval/reward" in metrics[3]
    # Episode 1 sampled with the starting weights, which the trainer still had; episodes 2 and 3 were sampled
    # while the trainer was one update ahead: the ratio sees that (and the clip bounds it).
    assert metrics[1]["policy/old_logprob_diff_max"] < SYNC_TOL
    for episode in (2, 3):
        assert metrics[episode]["policy/old_logprob_diff_max"] > 100 * SYNC_TOL
        # not measurable one step off-policy
        assert "mismatch/logprob_max_abs" not in metrics[episode]
    # A checkpoint records the data position of its own episode, not the prefetched next one.
    prompts_per_episode = 32 // 4
    for episode in (1, 2, 3):
        state = ckpt.load_state(out / "checkpoints" / f"episode_{episode:06d}")
        assert state["sampler"]["index"] == episode * prompts_per_episode


def test_ppo_two_episodes_cross_process_sync(
    ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    from chatgen.rlhf.algorithms import ppo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    out = tmp_path / "ppo"
    cfg = load_config(
        REPO / "configs/ppo_tiny.yaml",
        [
            *overrides(
                tiny_llama_dir,
                data_dir,
                out,
                **{
                    "value_trainer.load": tiny_llama_dir,
                    "reference.load": tiny_llama_dir,
                    "runtime.num_episode": 2,
                    "runtime.save_episode_interval": 2,
                    "runtime.algorithm.importance_sampling_cap": 2.0,
                    # the Megatron models data parallel on 2 CPU
                    # ranks: each gets half of every batch
                    "policy_trainer.data_parallel_size": 2,
                    "reference.data_parallel_size": 2,
                    "value_trainer.data_parallel_size": 2,
                    "runtime.train_micro_batch_size": 8,
                },
            )
        ],
    )
    assert cfg.runtime.colocation == [
        ["policy", "reward"],
        ["policy_trainer", "reference", "value_trainer"],
    ]
    # truncated IS on, as a user would set it
    assert cfg.runtime.algorithm.importance_sampling_cap == 2.0
    # every socket the run's process tree listens on, while it trains
    with listening_sockets() as seen:
        ppo.train(cfg, log=lambda *_: None)
    assert any(name.startswith("ray::ModelWorker") for name, _, _ in seen), seen
    # loopback only (issue 13)
    assert not [entry for entry in seen if not is_loopback(entry[1])], seen
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]
    for episode in (1, 2):
        m = metrics[episode]
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL
        assert m["value/loss"] > 0 and m["policy/grad_norm"] > 0
        # Same weights on both sides: the importance weights pi_train / pi_infer are 1 up to float noise.
        assert (
            abs(m["mismatch/is_weight_mean"] - 1) < 1e-4 and m["mismatch/is_weight_min"] > 1 - 1e-4
        )
    # the policy vLLM sampled from in episode 2 is the trained one
    assert metrics[2]["kl/reference"] > 1e-4
    ckpt = out / "checkpoints" / "episode_000002"
    assert iteration(ckpt, "policy_trainer") == iteration(ckpt, "value_trainer") == 4
    saved = json.loads((ckpt / "policy_trainer" / "chatgen_megatron.json").read_text())
    assert saved["data_parallel_size"] == 2  # both DP ranks trained (and wrote their shards)
    # The critic's checkpoint holds the value head's row (token 0 of the output layer), trained away from the
    # policy's copy of it.
    policy_w, value_w = (
        trainer_weights(ckpt, "policy_trainer"),
        trainer_weights(ckpt, "value_trainer"),
    )
    assert not torch.equal(policy_w["lm_head.weight"][0], value_w["lm_head.weight"][0])


@pytest.mark.faults
def test_resume_continues_bit_for_bit_and_refuses_what_would_not(
    ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    """Stopped after episode 2 and resumed, a run's episode 3 equals an uninterrupted run's to the bit: data
    position, driver and actor RNGs (vLLM's sampling included: the evaluation samples too), trainer weights and
    optimizer. A resume that would change the data order, or a setting the checkpoint carries (the trainer's lr:
    it trained on at the old lr while resolved_config.yaml showed the new one), or from a damaged checkpoint, is
    refused; a metrics line torn by the kill does not stop it."""
    from chatgen.config import ConfigError
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.checkpoint import CheckpointError
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)

    def config(out, episodes, *extra):
        return load_config(
            REPO / "configs/grpo_tiny.yaml",
            [
                *overrides(tiny_llama_dir, data_dir, out),
                f"runtime.num_episode={episodes}",
                "policy.eval_temperature=1.0",
                *extra,
            ],
        )

    quiet = lambda *_: None  # noqa: E731
    grpo.train(config(tmp_path / "full", 3), log=quiet)
    part = tmp_path / "part"
    grpo.train(config(part, 2), log=quiet)
    with pytest.raises(FileExistsError, match="pass --resume"):
        grpo.train(config(part, 3), log=quiet)
    with pytest.raises(CheckpointError, match="seed: 1234 -> 7"):
        grpo.train(config(part, 3, "runtime.seed=7"), resume=True, log=quiet)
    resolved = (part / "resolved_config.yaml").read_text()
    with pytest.raises(
        ConfigError, match=r"models.policy_trainer.config.lr: 0.0005 -> 0.5: the checkpoint carries"
    ):
        grpo.train(config(part, 3, "policy_trainer.lr=0.5"), resume=True, log=quiet)
    # refused before anything was written
    assert (part / "resolved_config.yaml").read_text() == resolved
    with open(part / "metrics.jsonl", "ab") as f:
        f.write(b'{"episode": 3, "reward/m')  # what a kill in the middle of an append leaves
    grpo.train(config(part, 3), resume=True, log=quiet)
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(part)
    assert sorted(resumed) == [0, 1, 2, 3]
    for key, value in full[3].items():
        if not key.startswith(("time/", "memory/")):
            assert resumed[3][key] == value, key
    a = trainer_weights(tmp_path / "full" / "checkpoints" / "episode_000003")
    b = trainer_weights(part / "checkpoints" / "episode_000003")
    assert all(torch.equal(a[k], b[k]) for k in a)

    (part / "checkpoints" / "episode_000003" / "policy_trainer" / "__0_0.distcp").unlink()
    with pytest.raises(
        CheckpointError, match="__0_0.distcp is missing.*--resume-from episode_000002"
    ):
        grpo.train(config(part, 4), resume=True, log=quiet)


def test_dpo_two_episodes(ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch):
    from chatgen.cli import main

    monkeypatch.chdir(REPO)
    out = tmp_path / "dpo"
    args = [
        f"runtime.data_path={data_dir}/preference_train.jsonl",
        f"runtime.eval_data_path={data_dir}/preference_eval.jsonl",
        f"runtime.output_dir={out}",
        "runtime.num_episode=2",
        "runtime.sample_per_episode=16",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=8",
        "runtime.eval_episode_interval=1",
        "runtime.save_episode_interval=1",
        f"policy_trainer.load={tiny_llama_dir}",
        f"reference.load={tiny_llama_dir}",
    ]
    assert main(["train", str(REPO / "configs/dpo_tiny.yaml"), *args]) == 0
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]
    # Before training the policy is the reference: every log-ratio is 0, every pair a tie counted 0.5
    assert metrics[0]["eval/preference_accuracy"] == 0.5 and metrics[0]["eval/reward_margin"] == 0.0
    for episode in (1, 2):
        m = metrics[episode]
        assert m["policy/loss"] > 0 and m["policy/grad_norm"] > 0 and 0 <= m["policy/accuracy"] <= 1
        assert 0 <= m["eval/preference_accuracy"] <= 1
    # the trained policy differs from the reference on held-out pairs
    assert metrics[2]["eval/reward_margin"] != 0.0
    checkpoints = out / "checkpoints"
    assert iteration(checkpoints / "episode_000002") == 4  # 8 pairs an episode, 4 per step
    before, after = (
        trainer_weights(checkpoints / "episode_000001"),
        trainer_weights(checkpoints / "episode_000002"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in before)  # parameters changed
    # the frozen reference is not saved
    assert not (checkpoints / "episode_000002" / "reference").exists()
    assert (out / "metrics.png").exists()


def test_online_dpo_two_episodes(ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch):
    from chatgen.rlhf.algorithms import online_dpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    out = tmp_path / "online_dpo"
    # 32 samples = 8 prompts x n=4 -> 8 (best, worst) pairs = 16 trainer rows, one optimizer step
    cfg = load_config(
        REPO / "configs/online_dpo_tiny.yaml",
        overrides(
            tiny_llama_dir,
            data_dir,
            out,
            **{
                "runtime.num_episode": 2,
                "runtime.train_micro_batch_size": 8,
                "reference.load": tiny_llama_dir,
            },
        ),
    )
    last = online_dpo.train(cfg, log=lambda *_: None)
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2]
    for episode in (1, 2):
        m = metrics[episode]
        # vLLM sampled with exactly the trainer's weights
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL
        assert (
            0 <= m["pairs/no_preference"] < 1 and m["policy/grad_norm"] > 0 and "eval/reward" in m
        )
    # the first step's pairs are scored by the policy = the reference: all log-ratios 0
    assert metrics[1]["policy/margin"] == 0.0 and metrics[1]["policy/loss"] == pytest.approx(
        math.log(2) * (1 - metrics[1]["pairs/no_preference"]), abs=1e-6
    )
    # episode 2's samples came from the trained, synced policy
    assert metrics[2]["policy/margin"] != 0.0
    checkpoints = out / "checkpoints"
    assert iteration(checkpoints / "episode_000002") == 2
    before, after = (
        trainer_weights(checkpoints / "episode_000001"),
        trainer_weights(checkpoints / "episode_000002"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert last["reward/mean"] == metrics[2]["reward/mean"]
