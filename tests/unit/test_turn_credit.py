"""Credit over turns in multi-turn GRPO: the step-wise `gigpo` advantage (chatgen/rlhf/recipe/gigpo.py)
against hand-computed values, the turns' token positions it reads, and max_episode_tokens (a budget
that truncates, marks and cuts an episode). Pure logic: scripted replies, no engine.

    .venv/bin/python -m pytest tests/unit/test_turn_credit.py
"""

import types

import pytest
import torch

from chatgen.core.rollout import RolloutBatch
from chatgen.environments.base import Environment, Step, play, state_key
from chatgen.rlhf import losses as L
from chatgen.rlhf import recipe
from chatgen.rlhf.algorithms import grpo
from chatgen.rlhf.algorithms.grpo_multiturn import (
    Config,
    Episode,
    episode_sample,
    turn_extras,
    with_turns,
)
from chatgen.rlhf.recipe.gigpo import gigpo_advantages, step_advantages, step_returns


def test_step_returns_discount_later_turns():
    assert step_returns([[0.0, 1.0], [1.0], [2.0, 0.0, 4.0]], 0.5) == [
        [0.5, 1.0],
        [1.0],
        [3.0, 2.0, 4.0],
    ]


def test_turns_are_compared_only_with_turns_that_answered_the_same_state():
    returns = [[0.5, 1.0], [0.0, 0.0]]  # a group of n=2 episodes
    # both opened on the prompt "p"; their second turns answered different observations
    apart = step_advantages(returns, [["p", "a"], ["p", "b"]], 2, normalize_std=False)
    assert apart == [[0.25, 0.0], [-0.25, 0.0]]  # "a" and "b" answered once: nothing to compare
    together = step_advantages(returns, [["p", "a"], ["p", "a"]], 2, normalize_std=False)
    assert together == [[0.25, 0.5], [-0.25, -0.5]]
    # over the (unbiased) std of the state's returns: 0.25 / std(0.5, 0) = 0.7071
    normed = step_advantages(returns, [["p", "a"], ["p", "a"]], 2)
    assert normed[0][0] == pytest.approx(0.5**0.5, rel=1e-4)
    # the same state in another prompt's group is another state
    four = step_advantages(returns * 2, [["p", "a"], ["p", "b"], ["p", "a"], ["p", "b"]], 2, False)
    assert four[0][1] == 0.0 and four[2][1] == 0.0


def test_each_token_carries_its_turns_step_advantage_plus_the_episodes():
    rewards = torch.tensor([1.0, 0.0])  # episode returns
    turn_index = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, -1, 1, -1]])
    adv = gigpo_advantages(
        rewards,
        2,
        turn_index,
        [[0.0, 1.0], [0.0, 0.0]],
        [["p", "a"], ["p", "a"]],
        weight=1.0,
        gamma=0.5,
        normalize_std=False,
    )
    # A_E = [0.5, -0.5]; returns [[0.5, 1], [0, 0]] -> A_S = [[0.25, 0.5], [-0.25, -0.5]]
    assert adv.tolist() == [[0.0, 0.75, 0.75, 0.0, 1.0], [0.0, -0.75, 0.0, -1.0, 0.0]]


def test_one_turn_episodes_get_grpo_scaled_by_one_plus_the_weight():
    torch.manual_seed(0)
    rewards = torch.rand(8)
    turn_index = torch.tensor([[-1, 0, 0, 0]] * 8)
    adv = gigpo_advantages(
        rewards, 4, turn_index, [[r] for r in rewards.tolist()], [["p"]] * 8, 0.5, 0.9
    )
    expected = 1.5 * L.group_advantages(rewards, 4, eps=1e-6)
    assert torch.allclose(adv[:, 1:], expected.unsqueeze(1).expand(8, 3), atol=1e-5)


def turn(prompt, generated):
    return {
        "role": "assistant",
        "content": "",
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-1.0] * len(generated),
    }


def two_turn_episode(reward=1.0, truncated=False):
    p1, g1 = [1, 10, 11], [20, 21, 2]
    p2 = p1 + g1 + [30, 31]
    return Episode(
        turns=[turn(p1, g1), turn(p2, [22, 2])],
        reward=reward,
        turn_rewards=[0.0, reward],
        turn_states=["p", "a"],
        truncated=truncated,
    )


def test_turn_index_lines_up_with_the_trained_tokens():
    episodes = [two_turn_episode(), two_turn_episode(0.0)]
    samples = [episode_sample(e, 0, with_turns({}, e)) for e in episodes]
    batch = RolloutBatch.from_samples(samples, pad_token_id=0)
    extras = turn_extras(batch)
    index = extras["turn_index"]
    assert torch.equal(index >= 0, batch.loss_mask[:, : index.shape[1]] > 0)
    # entry t is about token t + 1: turn 0 made 20 21 EOS, turn 1 made 22 EOS
    ids = batch.input_ids[0, 1:]
    assert ids[index[0] == 0].tolist() == [20, 21, 2] and ids[index[0] == 1].tolist() == [22, 2]
    assert extras["turn_rewards"] == [[0.0, 1.0], [0.0, 0.0]]
    algo = types.SimpleNamespace(
        step_advantage_weight=1.0, step_discount=1.0, normalize_advantage_std=False
    )
    view = types.SimpleNamespace(extras=extras)
    adv = recipe.advantage.get("gigpo")(torch.tensor([1.0, 0.0]), 2, view, algo)
    assert adv[0][index[0] == 1].tolist() == [1.0, 1.0]  # 0.5 + (1 - 0.5)
    assert adv[1][index[1] == 1].tolist() == [-1.0, -1.0]
    assert adv[index < 0].abs().sum() == 0


def test_an_unknown_tool_call_parser_is_refused_before_the_run_starts():
    assert dict(Config(environment="tool_math", tool_call_parser="hermes").check()) == {}
    problems = dict(Config(environment="tool_math", tool_call_parser="hermess").check())
    assert (
        "'hermess' is no vLLM tool-call parser; did you mean 'hermes'?"
        in problems["tool_call_parser"]
    )


def test_gigpo_is_refused_outside_multiturn():
    problems = dict(grpo.Config(advantage_estimator="gigpo").check())
    assert "grpo_multiturn" in problems["advantage_estimator"]
    assert dict(Config(environment="calculator", advantage_estimator="gigpo").check()) == {}
    bad = dict(Config(environment="calculator", max_episode_tokens=0, step_discount=2.0).check())
    assert "max_episode_tokens" in bad and "step_discount" in bad
    with pytest.raises(ValueError, match="gigpo needs the turns of multi-turn episodes"):
        recipe.advantage.get("gigpo")(torch.zeros(2), 2, types.SimpleNamespace(extras={}), None)


class Counter(Environment):
    """Shows 'left' or 'right' after the first turn, by the reply; never ends by itself."""

    def reset(self, record):
        return [{"role": "user", "content": "go"}]

    def step(self, message):
        side = "left" if "l" in message["content"] else "right"
        return Step(messages=[{"role": "user", "content": side}], reward=1.0)


def token_chat(replies, per_turn=3, between=2):
    """Replies with token ids: each turn generates `per_turn` ids (or what max_tokens allows) and
    the environment's messages take `between` ids; records each request's max_tokens."""
    asked, state = [], {"ids": [1, 5]}

    def chat(messages, tools, max_tokens=None):
        asked.append(max_tokens)
        ids = state["ids"] + ([9] * between if len(asked) > 1 else [])
        generated = [7] * min(per_turn, max_tokens or per_turn)
        state["ids"] = ids + generated
        reply = turn(ids, generated)
        reply["content"] = replies[len(asked) - 1]
        return reply

    return chat, asked


def test_anchor_states_are_the_observations_before_each_turn():
    chat, _ = token_chat(["l", "l", "r"])
    first, _ = play(Counter(), chat, {}, 3, 10, "c")
    chat, _ = token_chat(["r", "l", "l"])
    second, _ = play(Counter(), chat, {}, 3, 10, "c")
    assert (
        first.turn_states[0]
        == second.turn_states[0]
        == state_key([{"role": "user", "content": "go"}])
    )
    # after "l": the same observation in both episodes (turn 2 of the first, turn 3 of the second)
    assert first.turn_states[1] == second.turn_states[2] != second.turn_states[1]


def test_max_episode_tokens_asks_for_what_is_left_then_truncates():
    chat, asked = token_chat(["l", "l", "l", "l"])
    episode, error = play(Counter(), chat, {}, 8, 10, "c", max_episode_tokens=10)
    # used after each turn: 3, 3 + 2 + 3 = 8, then 8 + 2 + 2 (capped at 10 - 8) = 12 >= 10: stop
    assert error is None and asked == [10, 7, 2]
    assert episode.truncated and episode.metrics["truncated"] == 1.0 and len(episode.turns) == 3
    sample = episode_sample(episode, max_tokens=10)
    assert len(sample.response_ids) == 10 and sample.finish_reason == "length"
    assert sample.response_mask == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]  # turn 3's tokens cut
    assert episode_sample(two_turn_episode()).finish_reason == "stop"
    unlimited, _ = play(Counter(), token_chat(["l"] * 3)[0], {}, 3, 10, "c")
    assert unlimited.truncated and len(unlimited.turns) == 3  # max_turns
