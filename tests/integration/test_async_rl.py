"""Fully asynchronous GRPO (runtime.algorithm.max_staleness) on CPU, in process, with the real vLLM and
megatron-core and the tiny Llama.

    python -m pytest tests/integration/test_async_rl.py

- max_staleness: 0 is the synchronous loop bit for bit: the same metrics and the same trained weights as a
  run without the key.
- max_staleness: 2 with handover_step: 4 on the shipped job's warm start and episode shape (32 prompts x 8
  samples): every trained token is at most 2 versions older than the trainer's weights, read from the
  per-token weight versions the engine stamped (not from a counter); at least 10% of the trained samples
  span two versions (the batches ahead of the trainer wait for the next weights after 4 engine steps:
  partial rollouts by construction, on a quiet machine too); the held-out reward (32 prompts) rises by
  more than 0.3 (the learning rate decays over the run, so that the last evaluation is not one of a
  constant rate's swings).
- Checkpoint and resume: no batch is in flight at a checkpoint, so each checkpoint's data position is its own
  episode's, and a resumed async run continues from there as a synchronous resume does.
- A replica (Ray actor) killed while two batches generate: reported within seconds, checkpoint 2 intact,
  --resume continues.
"""

import json
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SAMPLES, N = 32, 4  # per episode: 8 prompts x 4 samples, one optimizer step (one weight version)


def overrides(model_dir, data_dir, out_dir, **extra):
    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out_dir),
        "runtime.sample_per_episode": SAMPLES,
        "runtime.train_micro_batch_size": SAMPLES,
        "runtime.train_global_batch_size": SAMPLES,
        "runtime.eval_episode_interval": 1,
        "runtime.save_episode_interval": 1,
        "policy.load": model_dir,
        "policy.n": N,
        "policy_trainer.load": model_dir,
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def read_metrics(out_dir) -> dict:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["episode"]: r for r in map(json.loads, lines)}


def iteration(checkpoint_dir, model="policy_trainer") -> int:
    return json.loads((Path(checkpoint_dir) / model / "chatgen_megatron.json").read_text())[
        "iteration"
    ]


def trainer_weights(checkpoint_dir, model="policy_trainer") -> dict:
    """A trainer's weights in an episode checkpoint, as HF tensors."""
    from chatgen.models.convert import megatron_checkpoint_to_hf

    return megatron_checkpoint_to_hf(Path(checkpoint_dir) / model)[1]


def config(model_dir, data_dir, out, **extra):
    from chatgen.rlhf.config import load_config

    return load_config(
        REPO / "configs/grpo_tiny.yaml", overrides(model_dir, data_dir, out, **extra)
    )


def comparable(metrics: dict) -> dict:
    """What two runs of the same samples must agree on: everything but times, memory and async/*."""
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(("time/", "memory/", "async/", "replica/"))
    }


def test_max_staleness_zero_is_the_synchronous_loop(
    tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    from chatgen.rlhf.algorithms import grpo

    monkeypatch.chdir(REPO)
    runs = {}
    for name, extra in (("sync", {}), ("async0", {"runtime.algorithm.max_staleness": 0})):
        out = tmp_path / name
        grpo.train(
            config(tiny_llama_dir, data_dir, out, **{"runtime.num_episode": 2, **extra}),
            log=lambda *_: None,
        )
        runs[name] = out
    sync, async0 = read_metrics(runs["sync"]), read_metrics(runs["async0"])
    assert sorted(sync) == sorted(async0) == [0, 1, 2]
    for episode in (1, 2):
        assert comparable(async0[episode]) == comparable(sync[episode]), episode
        assert async0[episode]["async/staleness_max"] == 0.0
        assert async0[episode]["async/samples_spanning_versions"] == 0.0
    assert sync[2]["policy/grad_norm"] > 0  # it trained: the equality is of something that moved
    a = trainer_weights(runs["sync"] / "checkpoints" / "episode_000002")
    b = trainer_weights(runs["async0"] / "checkpoints" / "episode_000002")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def warm_model(tiny_llama_dir, tmp_path_factory):
    """The shipped GRPO job's warm start (examples/sft_warm_start.py, 300 steps; cached per machine): it
    sorts, mostly the wrong way, so rewards vary and GRPO can improve them; and the task's data."""
    from helpers import shipped_warm_start

    from chatgen import tasks

    out = tmp_path_factory.mktemp("task")
    tasks.write_task_data(str(out), n_train=256, n_eval=32, seed=1)
    return shipped_warm_start(tiny_llama_dir), out


def record_trained_versions(monkeypatch) -> list:
    """Each episode's (weight_versions, loss_mask, current version) as the update received them."""
    from chatgen.rlhf.algorithms.grpo import loop as async_rollout

    seen, real = [], async_rollout.update

    def spy(run, batch, rewards, n, **kw):
        current = run.policy.weight_versions()[0]
        seen.append((batch.weight_versions.clone(), batch.loss_mask.clone(), current))
        return real(run, batch, rewards, n, **kw)

    monkeypatch.setattr(async_rollout, "update", spy)
    return seen


def async_overrides(task_dir, **extra):
    return {
        "runtime.data_path": f"{task_dir}/train.jsonl",
        "runtime.eval_data_path": f"{task_dir}/eval.jsonl",  # 32 held-out prompts
        "runtime.algorithm.max_staleness": 2,
        "runtime.algorithm.old_logprobs": "recompute",
        "runtime.algorithm.importance_sampling_cap": 2.0,  # decoupled PPO
        "runtime.algorithm.handover_step": 4,  # answers are ~13 tokens: most span two versions
        **extra,
    }


def trained_staleness(seen) -> tuple:
    """(largest staleness of a trained token, samples spanning two or more weight versions, samples),
    from the per-token weight versions the update received (not from a counter)."""
    worst = spanning = total = 0
    for versions, mask, current in seen:
        trained = (mask > 0) & (versions >= 0)
        assert trained.any()
        staleness = current - versions[trained]
        assert staleness.min() >= 0
        worst = max(worst, int(staleness.max()))
        generated = versions >= 0
        newest = torch.where(generated, versions, -1).max(dim=1).values
        oldest = torch.where(generated, versions, 10**9).min(dim=1).values
        spanning += int((generated.any(dim=1) & (newest > oldest)).sum())
        total += len(versions)
    return worst, spanning, total


def test_async_k2_bounds_staleness_and_learns(warm_model, tmp_path, monkeypatch):
    from chatgen.rlhf.algorithms import grpo

    model, task = warm_model
    monkeypatch.chdir(REPO)
    seen = record_trained_versions(monkeypatch)
    out = tmp_path / "async2"
    episodes = 20  # ~1 s each at load 10
    cfg = config(
        model,
        task,
        out,
        **async_overrides(
            task,
            **{
                # the shipped job's episode (configs/grpo_tiny.yaml): 32 prompts x 8 samples, two
                # optimizer steps of 128, one weight version
                "runtime.sample_per_episode": 256,
                "runtime.train_micro_batch_size": 128,
                "runtime.train_global_batch_size": 128,
                "policy.n": 8,
                # cosine decay over the run's 2 x 20 steps: at a constant 5e-4 the held-out reward swung
                # between 0.59 and 0.85 from one evaluation to the next after its first rise (3 runs)
                "policy_trainer.lr_decay_iters": 2 * episodes,
                "policy_trainer.min_lr": 2e-5,
                "runtime.num_episode": episodes,
                "runtime.eval_episode_interval": episodes,
                "runtime.save_episode_interval": episodes,
            },
        ),
    )
    grpo.train(cfg, log=lambda *_: None)
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(episodes + 1))
    assert len(seen) == episodes
    worst, spanning, total = trained_staleness(seen)
    assert worst <= 2  # the bound, token by token
    # partial rollouts by construction (without handover_step: 4 of 512 on a quiet machine)
    assert spanning >= 0.1 * total, (spanning, total)
    assert max(metrics[e]["async/staleness_max"] for e in range(1, episodes + 1)) >= 1
    # it learns, as the issue asks: 0.416 -> 0.885-0.942 in 5 runs of 20 episodes (+0.47 to +0.53, load 7-8,
    # 2026-11-27); 14 episodes were not enough: +0.31 to +0.37 with the decay, and at a constant rate +0.28
    # and +0.30 in two suite runs
    assert metrics[episodes]["eval/reward"] > metrics[0]["eval/reward"] + 0.3


def test_async_resume_continues_from_its_checkpoint(
    tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    from chatgen.rlhf import checkpoint as ckpt
    from chatgen.rlhf.algorithms import grpo

    monkeypatch.chdir(REPO)
    out = tmp_path / "resume"
    seen = record_trained_versions(monkeypatch)

    def run(episodes, resume):
        keys = {
            "runtime.num_episode": episodes,
            "runtime.eval_episode_interval": "null",
            "runtime.algorithm.max_staleness": 2,
            "runtime.algorithm.importance_sampling_cap": 2.0,
        }
        grpo.train(
            config(tiny_llama_dir, data_dir, out, **keys), resume=resume, log=lambda *_: None
        )

    def data_position(episode):
        return ckpt.load_state(out / "checkpoints" / f"episode_{episode:06d}")["sampler"]

    prompts = SAMPLES // N  # 64 training records: one pass is 8 episodes
    run(3, False)
    for episode in (1, 2, 3):  # nothing in flight at a checkpoint: its own episode's data position
        assert data_position(episode) == {"epoch": 0, "index": episode * prompts}
    run(5, True)
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    for episode in (4, 5):  # neither replayed nor skipped: the prompts a synchronous resume draws
        assert data_position(episode) == {"epoch": 0, "index": episode * prompts}
    assert iteration(out / "checkpoints" / "episode_000005") == 5  # from 3, one step per episode
    assert len(seen) == 5
    for versions, mask, current in seen:
        trained = (mask > 0) & (versions >= 0)
        assert 0 <= (current - versions[trained]).min() and (current - versions[trained]).max() <= 2
    # the resumed run's first batch was generated by the weights it resumed with
    assert metrics[4]["async/staleness_max"] == 0.0


@pytest.mark.faults
# the resume (a second Ray run) with the slow tests: a failed run's resume is test_rlhf_runs.py's
# test_grpo_fails_cleanly_then_resumes, an async run's test_async_resume_continues_from_its_checkpoint
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_async_replica_dies_mid_run(
    ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch, capsys, resume
):
    """Two disaggregated replicas (Ray actors), max_staleness 2: replica 1's process ends while two batches
    generate. Its generation calls: eval 0 (1), batches 1 and 2 submitted together (2, 3), evals 1 and 2
    (4, 5), batch 3 (6): it dies there, after checkpoint 2, with batch 4 submitted beside it. --resume then
    continues from checkpoint 2 (`resume`)."""
    from chatgen.cli import main
    from chatgen.rlhf import checkpoint as ckpt

    monkeypatch.chdir(REPO)
    out, stamp = tmp_path / "dies", tmp_path / "died_at"
    args = overrides(
        tiny_llama_dir,
        data_dir,
        out,
        **{
            "runtime.num_episode": 4,
            "runtime.save_episode_interval": 2,
            "runtime.colocation": "[[policy, reward]]",
            "runtime.algorithm.max_staleness": 2,
            "runtime.algorithm.importance_sampling_cap": 2.0,
            "models.policy.num_replicas": 2,
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
    assert sorted(read_metrics(out)) == [0, 1, 2]
    assert ckpt.resume_point(out / "checkpoints", None).name == "episode_000002"  # whole
    assert (
        ckpt.load_state(out / "checkpoints" / "episode_000002")["sampler"]["index"]
        == 2 * SAMPLES // N
    )
    if not resume:
        return
    # --resume continues from checkpoint 2 as a synchronous resume does: episodes 3 and 4, the data on from 2
    dying = ("models.policy.model_class", "policy.args.")
    healthy = [a for a in args if not a.startswith(dying)]
    assert main(["train", str(REPO / "configs/grpo_tiny.yaml"), *healthy, "--resume"]) == 0
    assert sorted(read_metrics(out)) == [0, 1, 2, 3, 4]
    state = ckpt.load_state(out / "checkpoints" / "episode_000004")
    assert state["sampler"]["index"] == 4 * SAMPLES // N
    assert iteration(out / "checkpoints" / "episode_000004") == 4
