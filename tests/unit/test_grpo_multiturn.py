"""Multi-turn GRPO's pure pieces: an episode's turns -> one training Sample (no engine, no server)."""

import pytest

from chatgen.core.rollout import RolloutBatch
from chatgen.rlhf.algorithms.grpo_multiturn import Config, Episode, env_metrics, episode_sample

EOS = 2


def turn(prompt, generated, logprobs, versions=None):
    message = {
        "role": "assistant",
        "content": "",
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": logprobs,
    }
    if versions is not None:
        message["generation_weight_versions"] = versions
    return message


def test_two_turns_make_one_sample_trained_only_on_generated_tokens():
    p1, g1 = [1, 10, 11], [20, 21, EOS]
    tool = [30, 31, 32]  # the template's and the calculator's tokens between the two answers
    p2, g2 = p1 + g1 + tool, [22, EOS]
    episode = Episode(
        turns=[turn(p1, g1, [-0.1, -0.2, -0.3], [4, 4, 4]), turn(p2, g2, [-0.4, -0.5], [5, 5])],
        reward=1.0,
        text="final",
    )
    s = episode_sample(episode, prompt_index=3, metadata={"answer": "x"})
    assert s.prompt_ids == p1
    assert s.response_ids == g1 + tool + g2
    assert s.response_mask == [1, 1, 1, 0, 0, 0, 1, 1]
    assert s.response_logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert s.weight_versions == [4, 4, 4, -1, -1, -1, 5, 5]
    assert (s.prompt_index, s.text, s.metadata) == (3, "final", {"answer": "x"})

    # In the batch, entry t is about token t + 1: the loss sees exactly the generated tokens of both turns.
    batch = RolloutBatch.from_samples([s], pad_token_id=0)
    ids = batch.input_ids[0]
    trained = ids[1:][batch.loss_mask[0] > 0].tolist()
    assert trained == g1 + g2
    assert batch.infer_logprobs[0][batch.loss_mask[0] > 0].tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, -0.5]
    )
    assert batch.infer_logprobs[0][batch.loss_mask[0] == 0].abs().sum() == 0


def test_a_turn_cut_at_its_token_limit_still_lines_up():
    """No EOS at the end of turn 1 (max_tokens): the template's EOS after it is not trained on."""
    p1, g1 = [1, 10], [20, 21]
    p2 = p1 + g1 + [EOS, 30]
    s = episode_sample(
        Episode(turns=[turn(p1, g1, [-1.0, -1.0]), turn(p2, [22], [-1.0])], reward=0.0)
    )
    assert s.response_ids == [20, 21, EOS, 30, 22]
    assert s.response_mask == [1, 1, 0, 0, 1]
    assert s.weight_versions == [-1] * 5  # the server gave none


def test_a_turn_that_does_not_continue_the_previous_one_is_refused():
    p1, g1 = [1, 10], [20, EOS]
    retokenized = [1, 10, 99, EOS, 30]  # the history re-tokenized: the model's 20 became 99
    episode = Episode(
        turns=[turn(p1, g1, [-1.0, -1.0]), turn(retokenized, [22], [-1.0])], reward=0.0
    )
    with pytest.raises(
        ValueError, match="turn 2's prompt does not begin with turn 1's.*prompt_token_ids"
    ):
        episode_sample(episode)
    with pytest.raises(ValueError, match="no turns"):
        episode_sample(Episode(turns=[], reward=0.0))


def test_env_metrics_average_each_key():
    episodes = [
        Episode(turns=[], reward=0.0, metrics={"a": 1.0}),
        Episode(turns=[], reward=1.0, metrics={"a": 0.0}),
    ]
    assert env_metrics(episodes, "env/") == {"env/a": 0.5}


def test_config_needs_the_environment():
    for good in ("examples.calculator_env:CalculatorEnv", "calculator", "gymnasium:X-v0"):
        assert dict(Config(environment=good).check()) == {}
    for bad in (None, "examples.calculator_env"):
        (problem,) = [p for key, p in Config(environment=bad).check() if key == "environment"]
        assert "'package.module:Object'" in problem and "calculator" in problem


def test_calculator_sorts_the_prompts_digits():
    from chatgen.environments.calculator import calculator

    assert calculator("sort: 3 1 4 1 5 =") == " 1 1 3 4 5"


def test_the_served_policy_must_be_a_one_rank_engine():
    from pathlib import Path

    from chatgen.config import ConfigError
    from chatgen.rlhf.checks import check_run
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.registry import load

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(
        repo / "configs/grpo_multiturn_tiny.yaml",
        ["policy_trainer.tensor_model_parallel_size=2", "policy.tensor_parallel_size=2"],
    )
    with pytest.raises(
        ConfigError, match="runtime.colocation: the policy shares a group of 2 ranks"
    ):
        check_run(cfg, load("grpo_multiturn"))


def test_config_takes_an_agent_instead_of_an_environment():
    assert dict(Config(agent="examples.gateway_agent:solve").check()) == {}
    problems = [p for k, p in Config(agent="gateway_agent", environment="calculator").check()]
    assert any("'package.module:function'" in p for p in problems)
    assert any("remove environment, or agent" in p for p in problems)
    assert "agent_timeout_s" in dict(Config(agent="a:b", agent_timeout_s=0).check())
    # asynchronous multi-turn is GRPO's loop; overlap_generation and handover_step are refused
    assert (
        dict(Config(environment="calculator", max_staleness=2, old_logprobs="rollout").check())
        == {}
    )
    problems = dict(
        Config(
            environment="calculator", max_staleness=2, old_logprobs="rollout", handover_step=4
        ).check()
    )
    assert "server's threads" in problems["handover_step"]


def test_a_dropped_episode_trains_on_nothing_and_is_counted():
    from chatgen.rlhf.algorithms.grpo_multiturn import episodes_batch

    played = [
        Episode([turn([1, 5, 6], [7, EOS], [-0.5, -0.1], [0, 0])], reward)
        for reward in (1.0, 0.0, 0.5)
    ]
    dropped = Episode([], 0.0, dropped=True)
    batch, rewards, metrics = episodes_batch([played[0], dropped, *played[1:]], [{}], 4, "agent")
    assert metrics["env/dropped_episodes"] == 1.0
    assert batch.loss_mask[:3].sum(dim=1).tolist() == [2.0, 2.0, 2.0]
    assert batch.loss_mask[3].sum() == 0 and rewards[3] == 0.5  # the group's mean: no signal


def test_a_record_starts_on_the_engine_with_the_fewest_sessions_in_flight():
    import threading

    from chatgen.rlhf.algorithms.grpo_multiturn import run_episodes

    release, started = threading.Event(), threading.Semaphore(0)

    class Engine:  # an environment of one engine; records which records played on it
        def __init__(self):
            self.played = []

        def episode(self, record, temperature, max_tokens):
            self.played.append(record["prompt"])
            if record["prompt"] == "long":  # a long-tailed session of an earlier batch
                started.release()
                release.wait(10)
            return Episode(turns=[], reward=0.0)

    a, b = Engine(), Engine()
    earlier = threading.Thread(target=run_episodes, args=([a, b], [{"prompt": "long"}], 2, 1, 8))
    earlier.start()
    started.acquire(timeout=10), started.acquire(timeout=10)  # both of its sessions on a
    run_episodes([a, b], [{"prompt": p} for p in "xyz"], 1, 1.0, 8)
    release.set()
    earlier.join()
    # a holds 2 sessions: x and y go to b (0, then 1 < 2), z to the first of a tie (2, 2)
    assert a.played == ["long", "long", "z"] and b.played == ["x", "y"]
