"""The replay of informative groups (chatgen.rlhf.algorithms.grpo.replay): zero-variance groups swapped
for the stored groups of highest reward std, bounded by age and capacity, counted; replayed groups
keep their weight versions, so the staleness metrics and bound see them.

    pytest tests/unit/test_grpo_replay.py
"""

from types import SimpleNamespace

import pytest
import torch

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf.algorithms.grpo import Config, replay
from chatgen.rlhf.algorithms.grpo import staleness as st

N = 2


def _batch(tag: int, rewards: list, version: int = 0):
    """len(rewards) samples; sample i's response is [tag, i] (so a test can tell where it came from),
    sampled at weight `version`."""
    samples = [
        Sample(
            prompt_ids=[1],
            response_ids=[tag, i],
            response_logprobs=[-0.1, -0.2],
            prompt_index=i // N,
            weight_versions=[version, version],
        )
        for i in range(len(rewards))
    ]
    return RolloutBatch.from_samples(samples, pad_token_id=0), torch.tensor(rewards)


def _cfg():
    return SimpleNamespace(
        runtime=SimpleNamespace(algorithm=Config(name="grpo"), solved_reward=1.0),
        models={
            "policy": SimpleNamespace(config=SimpleNamespace(max_new_tokens=8, n=N, pad_token_id=0))
        },
    )


def tags(batch):
    return batch.input_ids[:, 1].tolist()


def test_flat_groups_are_replaced_by_the_highest_std_stored_groups():
    buffer, cfg = replay.ReplayBuffer(capacity=2, max_age=3), _cfg()
    # episode 1: groups [0, 1] (std 0.71), [1, 1] (flat), [0, 0.5] (std 0.35): nothing stored yet
    batch, rewards = _batch(7, [0.0, 1.0, 1.0, 1.0, 0.0, 0.5], version=0)
    out, out_rewards, m = replay.refill(buffer, cfg, batch, rewards, N, episode=1)
    assert out is batch and m["replay/replaced_groups"] == 0
    assert m["replay/unreplaced_groups"] == 1 and m["replay/buffer_groups"] == 2
    # episode 2: two flat groups; the buffer gives its best (std 0.71) then the next (0.35)
    batch, rewards = _batch(8, [1.0, 1.0, 0.0, 3.0, 0.0, 0.0], version=1)
    out, out_rewards, m = replay.refill(buffer, cfg, batch, rewards, N, episode=2)
    assert m["replay/replaced_groups"] == 2 and m["replay/age_mean"] == 1.0
    assert tags(out) == [7, 7, 8, 8, 7, 7]  # group order kept: replayed ones where the flat were
    assert out_rewards.tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.5]
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    # each replayed once; episode 2's varied group (std 2.1) is stored
    assert m["replay/buffer_groups"] == 1
    # replayed tokens keep their version: staleness counts them (current version 2)
    metrics = st.staleness_metrics(out.weight_versions, out.loss_mask, current=2)
    assert metrics["async/staleness_max"] == 2.0
    assert metrics["async/staleness_mean"] == pytest.approx((2 * 4 + 1 * 2) / 6)


def test_age_and_capacity_bound_the_buffer():
    buffer, cfg = replay.ReplayBuffer(capacity=2, max_age=2), _cfg()
    batch, rewards = _batch(1, [0.0, 1.0, 0.0, 2.0, 0.0, 4.0])  # stds 0.71, 1.41, 2.83
    replay.refill(buffer, cfg, batch, rewards, N, episode=1)
    assert [round(g[0], 2) for g in buffer.groups] == [2.83, 1.41]  # capacity 2: lowest std out
    batch, rewards = _batch(2, [1.0, 1.0, 5.0, 5.0])  # two flat groups, 4 episodes later
    out, out_rewards, m = replay.refill(buffer, cfg, batch, rewards, N, episode=5)
    assert m["replay/expired_groups"] == 2 and m["replay/replaced_groups"] == 0
    assert out is batch and m["replay/unreplaced_groups"] == 2


@pytest.mark.parametrize(
    "keys, problem",
    [
        ({"replay_buffer_size": 4}, "importance_sampling_cap"),
        ({"replay_buffer_size": 4, "old_logprobs": "rollout", "dynamic_sampling": True}, "one"),
        (
            {
                "replay_buffer_size": 4,
                "importance_sampling_cap": 2.0,
                "max_staleness": 2,
                "stale_samples": "regenerate",
            },
            "stale_samples: drop",
        ),
        ({"replay_max_age": 0}, ">= 1"),
    ],
)
def test_bad_combinations_are_refused_naming_the_key(keys, problem):
    problems = dict(Config(name="grpo", **keys).check())
    key = "replay_max_age" if "replay_max_age" in keys else "replay_buffer_size"
    assert problem in problems[key]
    ok = Config(name="grpo", replay_buffer_size=4, importance_sampling_cap=2.0)
    assert not [k for k, _ in ok.check() if k.startswith("replay")]
