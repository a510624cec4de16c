"""Length control as reward shapers (chatgen.rlhf.recipe.shaping; grpo's step.shaped_rewards) against
hand-computed values: Kimi k1.5's group length penalty, ProRL's stop-properly penalty, and both with
DAPO's overlong penalty, each logged as its own reward/<shaping> metric.

    pytest tests/unit/test_rlhf_length_shaping.py
"""

from types import SimpleNamespace

import pytest
import torch

from chatgen.rlhf.algorithms.grpo import Config, step
from chatgen.rlhf.recipe import shaping


def test_group_length_penalty_by_hand():
    lengths = torch.tensor([2, 4, 6, 3, 3, 3])
    correct = torch.tensor([False, True, False, True, False, True])
    # group 1: min 2, max 6: lambda = 0.5 - (len - 2) / 4 = [0.5, 0, -0.5]; wrong answers get
    # min(0, lambda): [0, 0, -0.5]; group 2: one length, no penalty
    out = shaping.group_length_penalty(lengths, correct, n=3)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, 0.0, 0.0, 0.0])
    out = shaping.group_length_penalty(lengths, torch.ones(6, dtype=torch.bool), n=3)
    assert out.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0, 0.0])


def test_stop_properly_penalty_by_hand():
    rewards = torch.tensor([1.0, -1.0, 0.5, 1.0])
    cut = torch.tensor([True, True, False, False])
    # a cut response keeps 0.2 of a positive reward; a negative one stays (no gain from the cut)
    assert shaping.stop_properly_penalty(rewards, cut, 0.2).tolist() == pytest.approx(
        [0.2, -1.0, 0.5, 1.0]
    )


def _cfg(**algo):
    return SimpleNamespace(
        runtime=SimpleNamespace(algorithm=Config(name="grpo", **algo), solved_reward=1.0),
        models={"policy": SimpleNamespace(config=SimpleNamespace(max_new_tokens=8, n=2))},
    )


def test_shaped_rewards_applies_each_shaping_and_logs_it():
    batch = SimpleNamespace(
        response_lengths=torch.tensor([8, 4, 2, 6]),
        finish_reasons=["length", "stop", "stop", "stop"],
    )
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    same, metrics = step.shaped_rewards(_cfg(), batch, rewards)
    assert same is rewards and metrics == {}  # defaults: today's rewards
    shaped, metrics = step.shaped_rewards(
        _cfg(
            overlong_buffer_length=2,
            length_penalty_coef=0.5,
            stop_properly_penalty_coef=0.0,
        ),
        batch,
        rewards,
    )
    # overlong (max 8, buffer 2): [-1, 0, 0, 0]; length (groups [8, 4], [2, 6]): lambda [-0.5, 0.5],
    # [0.5, -0.5], wrong answer 2 -> min(0, 0.5) = 0, times 0.5: [-0.25, 0.25, 0, -0.25];
    # sum [-0.25, 1.25, 0, 0.75]; stop-properly (coef 0): sample 0 is cut, its reward -0.25 <= 0 stays
    assert shaped.tolist() == pytest.approx([-0.25, 1.25, 0.0, 0.75])
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.25)
    assert metrics["reward/length_penalty"] == pytest.approx(-0.25 / 4)
    assert metrics["reward/stop_properly_penalty"] == 0.0
    shaped, metrics = step.shaped_rewards(_cfg(stop_properly_penalty_coef=0.25), batch, rewards)
    assert shaped.tolist() == pytest.approx([0.25, 1.0, 0.0, 1.0])
    assert metrics["reward/stop_properly_penalty"] == pytest.approx(-0.75 / 4)


@pytest.mark.parametrize(
    "key, value", [("length_penalty_coef", -1.0), ("stop_properly_penalty_coef", 1.5)]
)
def test_bad_coefficients_are_refused_naming_the_key(key, value):
    problems = dict(Config(name="grpo", **{key: value}).check())
    assert key in problems
