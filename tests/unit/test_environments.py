"""The environment protocol (chatgen.environments): episodes played by `play` with the policy's replies
scripted (a pure unit test of the protocol's logic; tests/integration/test_agents_rl.py plays them
through the real server), the built-ins, the gymnasium adapter, and named errors that end one
episode without stopping the run.

    .venv/bin/python -m pytest tests/unit/test_environments.py
"""

import json
import time

import pytest

from chatgen import environments
from chatgen.environments.base import Environment, Step, play
from chatgen.environments.calculator import CalculatorEnv
from chatgen.environments.tools import PYTHON_TOOL, run_tool_calls
from chatgen.rlhf.algorithms.grpo_multiturn import env_metrics

RECORD = {"prompt": "sort: 3 1 2 =", "answer": " 1 2 3"}


def scripted(*replies):
    """A chat function answering with `replies` in order (dicts or plain texts), recording what it saw."""
    seen = []

    def chat(messages, tools):
        seen.append((list(messages), tools))
        reply = replies[len(seen) - 1]
        return {"role": "assistant", "content": reply} if isinstance(reply, str) else reply

    return chat, seen


def call(name, **arguments):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def test_the_calculator_episode_rewards_the_final_answer():
    chat, seen = scripted(" 3 2 1", " 1 2 3")
    episode, error = play(CalculatorEnv(), chat, RECORD, 8, 10, "calculator")
    assert error is None and episode.reward == 1.0 and episode.turn_rewards == [0.0, 1.0]
    assert episode.metrics["first_turn_reward"] == pytest.approx(1 / 3)
    assert not episode.truncated and episode.text == " 1 2 3"
    second_prompt = seen[1][0]
    assert [m["role"] for m in second_prompt] == ["user", "assistant", "tool", "user"]
    assert second_prompt[2]["content"] == " 1 2 3"


def test_max_turns_truncates_and_marks_it():
    class Endless(Environment):
        def reset(self, record):
            return [{"role": "user", "content": "go"}]

        def step(self, message):
            return Step(messages=[{"role": "user", "content": "again"}], reward=0.5)

    chat, _ = scripted("a", "b", "c")
    episode, error = play(Endless(), chat, {}, 3, 10, "endless")
    assert error is None and episode.truncated and episode.metrics["truncated"] == 1.0
    assert episode.reward == 1.5 and len(episode.turns) == 3


def test_the_python_tool_runs_parsed_calls_in_the_sandbox():
    tool_math = environments.factory("tool_math", {})[0]()
    chat, seen = scripted(call("python", code="print(37 * 12)"), "It is 444.")
    episode, error = play(tool_math, chat, {"prompt": "37 * 12?", "answer": "#### 444"}, 4, 30, "t")
    assert error is None and episode.reward == 1.0 and episode.metrics["tool_calls"] == 1.0
    assert seen[0][1][0]["function"]["name"] == "python"  # the tools reach the request
    tool_message = seen[1][0][-1]
    assert tool_message == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "python",
        "content": "444\n",
    }


def test_a_models_bad_call_is_an_observation():
    tools = {"python": PYTHON_TOOL}
    (unknown,) = run_tool_calls(tools, call("shell", cmd="ls"))
    assert unknown["content"].startswith("error: there is no tool 'shell'; the tools are python")
    (misfit,) = run_tool_calls(tools, call("python", source="print(1)"))
    assert misfit["content"].startswith("error:") and "source" in misfit["content"]
    broken = call("python")
    broken["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert run_tool_calls(tools, broken)[0]["content"].startswith(
        "error: the arguments are not JSON"
    )
    (bomb,) = run_tool_calls(tools, call("python", code="while True:\n    print('x' * 999)"))
    assert bomb["content"].startswith("error: killed at the output limit")


class Broken(Environment):
    def __init__(self, reward=1.0, sleep=0.0):
        self.reward, self.sleep = reward, sleep

    def reset(self, record):
        return [{"role": "user", "content": "hi"}]

    def step(self, message):
        time.sleep(self.sleep)
        return Step(reward=self.reward, done=True)


@pytest.mark.parametrize("reward", ["1.0", None, float("nan"), True])
def test_a_reward_that_is_not_a_number_ends_the_episode_named(reward):
    chat, _ = scripted("x")
    episode, error = play(Broken(reward), chat, {}, 4, 10, "broken")
    assert type(error).__name__ == "RewardNotANumber" and "broken.step returned the reward" in str(
        error
    )
    assert episode.reward == 0.0 and episode.metrics == {"errors": 1.0} and len(episode.turns) == 1


def test_a_step_that_never_returns_times_out_named():
    chat, _ = scripted("x")
    start = time.monotonic()
    episode, error = play(Broken(sleep=30), chat, {}, 4, 0.5, "stuck")
    assert time.monotonic() - start < 5
    assert type(
        error
    ).__name__ == "StepTimeout" and "stuck.step did not return within 0.5 s" in str(error)
    assert episode.metrics["errors"] == 1.0
    # counted, next to the episodes that went well
    ok, _ = play(CalculatorEnv(), scripted("1", " 1 2 3")[0], RECORD, 8, 10, "calculator")
    metrics = env_metrics([episode, ok], "env/")
    # a key only the good episode reports is its mean over those that report it
    assert metrics["env/errors"] == 0.5 and metrics["env/first_turn_reward"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", [None, "", "nosuchenv", "gymnasium:"])
def test_an_unknown_environment_is_a_named_error(name):
    assert environments.check_name(name)
    with pytest.raises(ValueError, match="runtime.algorithm.environment"):
        environments.factory(name, {})


def test_built_ins_adapters_and_user_objects_resolve():
    for name in ("calculator", "tool_math", "gymnasium:chatgen/SortDigits-v0"):
        assert environments.check_name(name) is None
    make, protocol = environments.factory("examples.calculator_env:CalculatorEnv", {})
    assert not protocol and hasattr(make, "episode")  # the older class interface
    make, protocol = environments.factory("chatgen.environments.calculator:CalculatorEnv", {})
    assert protocol and isinstance(make(), CalculatorEnv)


def test_a_gymnasium_text_environment_through_the_adapter():
    env = environments.factory("gymnasium:chatgen/SortDigits-v0", {})[0]()
    chat, seen = scripted(" 3 2 1", " 1 2 3")
    episode, error = play(env, chat, RECORD, 8, 10, "gym")
    assert error is None and episode.turn_rewards == [0.0, 1.0] and not episode.truncated
    assert seen[1][0][-1] == {"role": "user", "content": "hint: 1 2 3 sort: 3 1 2 ="}
    right_away, _ = play(env, scripted(" 1 2 3")[0], RECORD, 8, 10, "gym")
    assert right_away.turn_rewards == [1.0]
    with pytest.raises(ValueError, match="gymnasium:NoSuch-v0"):
        environments.factory("gymnasium:NoSuch-v0", {})[0]()


def test_the_search_tool_finds_the_fact_it_was_asked_for(tmp_path):
    pytest.importorskip("bm25s")
    from chatgen.environments.search import SearchEnv, write_task

    write_task(tmp_path, n_entities=30, n_eval=6)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    record = train[0]
    env = SearchEnv(str(tmp_path / "corpus.jsonl"), k=1)
    query = record["prompt"].rstrip("?")
    chat, seen = scripted(call("search", query=query), f"It is {record['answer']}.")
    episode, error = play(env, chat, record, 4, 30, "search")
    assert error is None and episode.reward == 1.0 and episode.metrics["searches"] == 1.0
    assert record["answer"] in seen[1][0][-1]["content"]
    assert play(env, scripted("I do not know.")[0], record, 4, 30, "search")[0].reward == 0.0
    # Search-R1's text tags: any model, no tool-call parser
    chat, seen = scripted(f"<search>{query}</search>", f"{record['answer']}")
    assert play(env, chat, record, 4, 30, "search")[0].reward == 1.0
    information = seen[1][0][-1]
    assert information["role"] == "user" and record["answer"] in information["content"]
    assert information["content"].startswith("<information>[1] ")


def test_a_later_turn_the_server_refuses_ends_the_episode_truncated():
    seen = []

    def chat(messages, tools):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("400: the prompt is longer than seq_length")
        return {"role": "assistant", "content": " 3 2 1"}

    episode, error = play(CalculatorEnv(), chat, RECORD, 8, 10, "calculator")
    assert "seq_length" in str(error) and episode.truncated and len(episode.turns) == 1
    assert episode.metrics == {"errors": 1.0} and episode.turn_rewards == [0.0]

    def refused(messages, tools):
        raise RuntimeError("400: tool_choice auto needs --tool-call-parser")

    with pytest.raises(RuntimeError, match="tool-call-parser"):  # no turn: said as it is
        play(CalculatorEnv(), refused, RECORD, 8, 10, "calculator")


def test_tool_math_demonstrations_teach_both_turns_with_the_tools_output_unlearned():
    from chatgen.environments.tool_math import SYSTEM, demonstration_rows
    from chatgen.tasks import REWARDS

    def render(chat):  # a plain chat template, with the generation prompt
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in chat) + "<assistant>"

    question = "What is 17 - 9? Reply with only the result, as a number."
    first, second = demonstration_rows({"prompt": question, "answer": "8"}, render)
    assert first["prompt"] == f"<system>{SYSTEM}</system><user>{question}</user><assistant>"
    # the call as vLLM's hermes parser reads it (JSON between the tags), run by the real tool
    assert first["answer"].startswith("<tool_call>\n") and first["answer"].endswith(
        "\n</tool_call>"
    )
    body = json.loads(first["answer"][len("<tool_call>\n") : -len("\n</tool_call>")])
    (observed,) = run_tool_calls({"python": PYTHON_TOOL}, call(body["name"], **body["arguments"]))
    # the second turn's prompt holds the call and the tool's output exactly as the sandbox prints
    # it, so the SFT loss (on answers only) never trains on the output
    assert observed["content"] == "8\n"
    assert second["prompt"] == (
        first["prompt"] + first["answer"] + "</assistant><tool>8\n</tool><assistant>"
    )
    assert "8\n" not in first["answer"] + second["answer"]
    assert second["answer"] == "8" and REWARDS["final_number"](second["answer"], "8") == 1.0
    # an episode without the tool: the number, at once
    (direct,) = demonstration_rows({"prompt": question, "answer": "8"}, render, call=False)
    assert direct == {"prompt": first["prompt"], "answer": "8"}
