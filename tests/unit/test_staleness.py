"""chatgen.rlhf.staleness (per-token weight versions -> staleness), the async keys' checks, and what the async loop
does with groups past the bound (loop.enforce_bound, with a stand-in run)."""

import pytest
import torch

from chatgen.rlhf.algorithms.grpo import staleness as st

# 3 samples, 5 token columns; -1 = prompt / padding. Sample 0: all version 3; sample 1: started under 1,
# finished under 2 (a partial rollout); sample 2: no generated token.
VERSIONS = torch.tensor(
    [
        [-1, 3, 3, 3, -1],
        [-1, -1, 1, 1, 2],
        [-1, -1, -1, -1, -1],
    ]
)


def test_sample_staleness_is_the_oldest_tokens():
    assert st.sample_staleness(VERSIONS, 3).tolist() == [0, 2, 0]
    assert st.sample_staleness(VERSIONS, 5).tolist() == [2, 4, 0]


def test_spans_versions():
    assert st.spans_versions(VERSIONS).tolist() == [False, True, False]


def test_groups_over_the_bound():
    staleness = torch.tensor([0, 1, 3, 0])  # two groups of two
    assert st.groups_over(staleness, 2, 2).tolist() == [False, True]
    assert st.groups_over(staleness, 2, 3).tolist() == [False, False]


def test_staleness_metrics_count_trained_tokens_only():
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1],  # the version-1 token at column 2 is not trained on
            [0, 0, 0, 0, 0],
        ],
        dtype=torch.float32,
    )
    m = st.staleness_metrics(VERSIONS, mask, 3)
    # trained tokens: 0, 0, 0 (sample 0) and 2, 1 (sample 1)
    assert m["async/staleness_max"] == 2.0
    assert m["async/staleness_mean"] == pytest.approx(3 / 5)
    assert m["async/samples_spanning_versions"] == pytest.approx(1 / 3)


def test_on_policy_mismatch_ignores_stale_tokens():
    mask = (VERSIONS >= 0).float()
    old = torch.zeros(3, 5)
    # stale tokens differ a lot, fresh ones a little
    infer = torch.where(VERSIONS == 3, -0.001, -1.0)
    m = st.on_policy_mismatch(old, infer, mask, VERSIONS, 3)
    assert m["mismatch/logprob_max_abs"] == pytest.approx(0.001)
    assert m["mismatch/logprob_mean_abs"] == pytest.approx(0.001)
    assert st.on_policy_mismatch(old, infer, mask, VERSIONS, 7) == {}  # nothing that fresh


def test_on_policy_mismatch_leaves_out_partial_rollouts():
    """Issue 50, finding 6: a partial rollout's tokens of the current version were compared with the
    trainer's weights, though the engine computed them on KV of older weights: the metric fired on
    every partial rollout of a healthy run."""
    mask = (VERSIONS >= 0).float()
    old = torch.zeros(3, 5)
    infer = torch.where(VERSIONS == 3, -0.001, -1.0)  # sample 1's version-2 token differs by 1
    m = st.on_policy_mismatch(old, infer, mask, VERSIONS, 2)
    assert m == {}  # only sample 1 has version-2 tokens, and it began under version 1
    m = st.on_policy_mismatch(old, infer, mask, VERSIONS, 3)
    assert m["mismatch/logprob_max_abs"] == pytest.approx(0.001)


@pytest.mark.parametrize(
    "keys, problem",
    [
        ({"max_staleness": -1}, "must be >= 0"),
        (
            {"max_staleness": 2, "overlap_generation": True, "importance_sampling_cap": 2.0},
            "overlap",
        ),
        ({"max_staleness": 2, "dynamic_sampling": True, "importance_sampling_cap": 2.0}, "dynamic"),
        ({"max_staleness": 2, "old_logprobs": "recompute"}, "importance_sampling_cap"),
    ],
)
def test_async_keys_are_checked(keys, problem):
    from chatgen.rlhf.algorithms.grpo import Config

    found = [(key, text) for key, text in Config(**keys).check() if key == "max_staleness"]
    assert found and problem in found[0][1], found


def test_async_keys_that_fit():
    from chatgen.rlhf.algorithms.grpo import Config

    for keys in (
        {"max_staleness": 0},
        {"max_staleness": 2, "importance_sampling_cap": 2.0},
        {"max_staleness": 3, "old_logprobs": "rollout"},
    ):
        assert not [key for key, _ in Config(**keys).check() if key == "max_staleness"], keys


@pytest.mark.parametrize(
    "keys, problem",
    [
        ({"max_staleness": 2, "handover_step": 0}, "must be >= 1"),
        ({"max_staleness": 1, "handover_step": 4}, "set max_staleness >= 2"),
        ({"handover_step": 4}, "set max_staleness >= 2"),
    ],
)
def test_handover_step_is_checked(keys, problem):
    from chatgen.rlhf.algorithms.grpo import Config

    keys = {"importance_sampling_cap": 2.0, **keys}
    found = [text for key, text in Config(**keys).check() if key == "handover_step"]
    assert found and problem in found[0], found
    assert not [
        key
        for key, _ in Config(max_staleness=2, handover_step=4, importance_sampling_cap=2.0).check()
    ]


def test_batches_ahead_of_the_trainers_are_marked_for_the_handover():
    """Rollouts.fill: the batch of the episode being trained generates unmarked (its update is what a
    marked batch waits for); the batches ahead of it carry (handover_step, the version now)."""
    import threading
    import types

    from chatgen.generation import handover
    from chatgen.rlhf.algorithms.grpo.loop import Rollouts

    marks, lock = {}, threading.Lock()

    def generate(index):
        with lock:
            marks[index[0]] = handover.requested()
        return index

    prompts = iter(range(100))
    run = types.SimpleNamespace(
        generate=generate,
        next_prompts=lambda: [next(prompts)],
        sampler=types.SimpleNamespace(state_dict=dict),
    )
    with Rollouts(run, 2, generate, handover_step=4) as rollouts:
        rollouts.fill(1, limit=10, version=0)  # batches 1, 2, 3 (prompts 0, 1, 2)
        assert rollouts.take(1)[1] == [0]
        rollouts.fill(2, limit=10, version=1)  # batch 4 (prompt 3)
        for episode in (2, 3, 4):
            rollouts.take(episode)
    assert marks == {0: None, 1: (4, 0), 2: (4, 0), 3: (4, 1)}
    assert handover.requested() is None  # the mark stays with the call
    with Rollouts(run, 2, generate) as rollouts:  # handover_step null: nothing marked
        rollouts.fill(1, limit=1, version=0)
        rollouts.take(1)
    assert marks[4] is None


def test_hold_after_marks_the_block_only():
    from chatgen.generation import handover

    with handover.hold_after(3, version=5):
        assert handover.requested() == (3, 5)
        with handover.hold_after(None):
            assert handover.requested() is None
        assert handover.requested() == (3, 5)
    assert handover.requested() is None
    with pytest.raises(ValueError, match="steps must be >= 1"):
        with handover.hold_after(0):
            pass


class FakeRun:
    """What enforce_bound uses of a Run: the algorithm's keys, generate (fresh samples at version 9), score."""

    def __init__(self, stale_samples):
        import contextlib
        import types

        algo = types.SimpleNamespace(max_staleness=2, stale_samples=stale_samples)
        self.cfg = types.SimpleNamespace(
            runtime=types.SimpleNamespace(algorithm=algo),
            models={"policy": types.SimpleNamespace(config=types.SimpleNamespace(pad_token_id=0))},
        )
        self.timer = lambda phase: contextlib.nullcontext()
        self.generated = []

    def generate(self, index):
        self.generated.append(index)
        return batch_of([9] * (2 * len(index)), first_prompt=100)

    def score(self, batch):
        return torch.full((len(batch),), 0.5)


def batch_of(versions: list, first_prompt=0):
    """A RolloutBatch of len(versions) one-token samples (2 per group), token versions as given."""
    from chatgen.core.rollout import RolloutBatch

    s = len(versions)
    return RolloutBatch(
        input_ids=torch.arange(s * 2).view(s, 2) + first_prompt,
        prompt_lengths=torch.ones(s, dtype=torch.long),
        response_lengths=torch.ones(s, dtype=torch.long),
        loss_mask=torch.ones(s, 1),
        infer_logprobs=torch.zeros(s, 1),
        prompt_index=torch.arange(s) // 2,
        texts=[""] * s,
        prompt_texts=[None] * s,
        finish_reasons=["stop"] * s,
        metadata=[{}] * s,
        weight_versions=torch.tensor(versions).view(s, 1),
    )


@pytest.mark.parametrize("stale_samples", ["drop", "regenerate"])
def test_groups_past_the_bound_are_dropped_or_regenerated(stale_samples):
    from chatgen.rlhf.algorithms.grpo.loop import enforce_bound, generated

    run = FakeRun(stale_samples)
    batch = batch_of([9, 8, 6, 9, 7, 7])  # at version 9, k = 2: group 1 (a sample at 6) is past it
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    out, out_rewards, keep, metrics = enforce_bound(
        run, generated(run), [10, 11, 12], batch, rewards, 9, 2
    )
    assert metrics == {"async/stale_groups": 1}
    if stale_samples == "drop":
        assert out is batch and keep.tolist() == [1, 1, 0, 0, 1, 1] and run.generated == []
    else:
        assert keep is None and run.generated == [[11]]  # group 1's prompt, generated again
        assert out.weight_versions.flatten().tolist() == [9, 8, 9, 9, 7, 7]  # in its place
        assert out_rewards.tolist() == [1.0, 0.0, 0.5, 0.5, 0.0, 1.0]
        assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]


def test_a_token_newer_than_the_trainer_is_a_bug():
    from chatgen.rlhf.algorithms.grpo.loop import enforce_bound

    with pytest.raises(RuntimeError, match="newer than the trainer"):
        enforce_bound(FakeRun("drop"), None, [0], batch_of([3, 5]), torch.zeros(2), 4, 2)


def test_an_async_policy_sharing_gpus_with_its_trainer_is_refused(tmp_path, monkeypatch, capsys):
    """It would sleep while the trainer trains: nothing could generate ahead (chatgen config says so)."""
    from chatgen import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    (tmp_path / "policy.yaml").write_text("load: /models/tiny\nn: 4\n")
    (tmp_path / "trainer.yaml").write_text("load: /models/tiny\n")
    (tmp_path / "main.yaml").write_text(
        "runtime:\n"
        "  sample_per_episode: 16\n"
        "  data_path: train.jsonl\n"
        "  colocation: [[policy, policy_trainer]]\n"
        "  algorithm: {name: grpo, max_staleness: 2, importance_sampling_cap: 2.0}\n"
        "models:\n"
        "  policy: {backend: vllm, model_config_file: policy.yaml, num_gpu: 1}\n"
        "  policy_trainer: {backend: megatron, trainable: true, model_config_file: trainer.yaml,"
        " num_gpu: 1}\n"
        "  reward: {backend: python, model_class: chatgen.module:Module}\n"
    )
    assert cli.main(["config", "main.yaml"]) == 2
    assert (
        "max_staleness: the policy shares its GPUs with policy_trainer" in capsys.readouterr().err
    )
    assert (
        cli.main(
            ["config", "main.yaml", "models.policy.num_gpu=0", "models.policy_trainer.num_gpu=0"]
        )
        == 0
    )
    capsys.readouterr()
    # handover_step needs engine steps apart: refused where the policy shares Ray actors
    on_cpu = ["models.policy.num_gpu=0", "models.policy_trainer.num_gpu=0"]
    handover = ["runtime.algorithm.handover_step=4", *on_cpu]
    assert cli.main(["config", "main.yaml", *handover, "runtime.launcher=ray"]) == 2
    assert "handover_step: the policy shares Ray actors" in capsys.readouterr().err
    local = "runtime.colocation=[[policy, policy_trainer, reward]]"
    assert cli.main(["config", "main.yaml", *handover, local]) == 0
