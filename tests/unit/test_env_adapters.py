"""The verifiers and OpenEnv adapters (chatgen/environments/verifiers_env.py, openenv_env.py) with
the libraries' real code: a verifiers environment (vf.MultiTurnEnv + vf.Rubric) and an OpenEnv
environment server (openenv-core's create_app, served by uvicorn on loopback), played by `play`
with the policy's replies scripted; their bad input as named errors.
tests/integration/test_agents_rl.py trains through both with the real engine.

    .venv/bin/python -m pytest tests/unit/test_env_adapters.py
"""

import sys

import httpx
import pytest

from chatgen import environments
from chatgen.environments.base import RewardNotANumber, play
from chatgen.rlhf.algorithms.grpo_multiturn import env_metrics

RECORD = {"prompt": "sort: 3 1 2 =", "answer": " 1 2 3"}
HINT = {"role": "user", "content": "hint: 1 2 3 sort: 3 1 2 ="}
VERIFIERS = "verifiers:chatgen.environments.verifiers_sort"
OPENENV = "openenv:chatgen.environments.openenv_sort:app"

BAD_RUBRIC = '''
import verifiers as vf
from datasets import Dataset


def load_environment(answer="0.5"):
    def reward(completion) -> float:
        return answer  # not a number: verifiers' own float() would make it 0.5

    rows = Dataset.from_list([{"question": "q", "answer": "a"}])
    return vf.SingleTurnEnv(dataset=rows, rubric=vf.Rubric(funcs=[reward]))
'''

TOOL_ENV = '''
import verifiers as vf
from datasets import Dataset


def load_environment():
    def add(a: int, b: int) -> str:
        """Adds two numbers.

        Args:
            a: the first
            b: the second
        """
        return str(a + b)

    def right(completion, answer, parser) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    rows = Dataset.from_list([{"question": "1+2?", "answer": "3"}])
    return vf.ToolEnv(tools=[add], max_turns=3, dataset=rows, rubric=vf.Rubric(funcs=[right]))
'''


def scripted(*replies):
    seen = []

    def chat(messages, tools):
        seen.append(list(messages))
        reply = replies[len(seen) - 1]
        if isinstance(reply, str):
            reply = {"role": "assistant", "content": reply}
        return {**reply, "prompt_token_ids": [1]}

    return chat, seen


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip("verifiers", reason="the verifiers extra is not installed")


def test_a_verifiers_environment_hints_then_its_rubric_rewards(vf):
    make, protocol = environments.factory(VERIFIERS, {})
    assert protocol
    chat, seen = scripted(" 3 2 1", " 1 2 3")
    episode, error = play(make(), chat, RECORD, 8, 30, VERIFIERS)
    assert error is None and episode.turn_rewards == [0.0, 1.0] and not episode.truncated
    assert seen[0] == [{"role": "user", "content": "sort: 3 1 2 ="}]
    assert seen[1][-1] == HINT  # the env's env_response, after the model's reply
    # its own stop condition ends it at once; the rubric's functions are logged
    right_away, _ = play(make(), scripted(" 1 2 3")[0], RECORD, 8, 30, VERIFIERS)
    assert right_away.turn_rewards == [1.0]
    assert right_away.metrics["sorted_right"] == 1.0 and right_away.metrics["num_turns"] == 1.0
    half, _ = play(make(), scripted(" 3 2 1", " 1 3 2")[0], RECORD, 8, 30, VERIFIERS)
    assert half.reward == pytest.approx(1 / 3)  # the sort_digits rule on the last answer


def test_a_verifiers_tool_env_gets_the_parsed_tool_calls_and_runs_its_tool(
    vf, tmp_path, monkeypatch
):
    (tmp_path / "add_tool_env.py").write_text(TOOL_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    make, _ = environments.factory("verifiers:add_tool_env", {})
    env = make()
    (tool,) = env.tools  # verifiers' schema of its python function, as an OpenAI tool
    assert tool["function"]["name"] == "add"
    assert tool["function"]["parameters"]["required"] == ["a", "b"]
    function = {"name": "add", "arguments": '{"a": 1, "b": 2}'}  # as the server's parser gives it
    call = {"id": "call_1", "type": "function", "function": function}
    chat, seen = scripted({"role": "assistant", "content": None, "tool_calls": [call]}, "3")
    episode, error = play(env, chat, {"prompt": "1+2?", "answer": "3"}, 8, 30, "tools")
    assert error is None and episode.turn_rewards == [0.0, 1.0]
    assert seen[1][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    assert episode.metrics["add_calls"] == 1.0 and episode.metrics["right"] == 1.0


def test_a_verifiers_rubric_that_returns_no_number_ends_the_episode_named(
    vf, tmp_path, monkeypatch
):
    (tmp_path / "bad_rubric_env.py").write_text(BAD_RUBRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    make, _ = environments.factory("verifiers:bad_rubric_env", {})
    episode, error = play(make(), scripted("x")[0], RECORD, 8, 30, "bad")
    assert isinstance(error, RewardNotANumber) and "reward" in str(error) and "'0.5'" in str(error)
    assert episode.reward == 0.0 and env_metrics([episode], "env/")["env/errors"] == 1.0


def test_an_unknown_verifiers_environment_is_a_named_error(vf, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="verifiers:no_such_env.*load_environment"):
        environments.factory("verifiers:no_such_env", {})
    (tmp_path / "not_an_env.py").write_text(
        "import types\n\ndef load_environment():\n    return types.SimpleNamespace(env_id=None, env_args=None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="returned SimpleNamespace.*MultiTurnEnv"):
        environments.factory("verifiers:not_an_env", {})


@pytest.fixture(scope="module")
def openenv_app():
    pytest.importorskip("openenv", reason="the openenv extra (openenv-core) is not installed")
    from chatgen.environments import openenv_env

    make = environments.factory(OPENENV, {})[0]  # served once for the module
    yield make
    url = make().url
    openenv_env.stop_served()  # (else at exit) nothing left serving
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=5)


def test_an_openenv_server_plays_episodes_one_session_each(openenv_app):
    env = openenv_app()
    assert (env.action_field, env.observation_field) == ("answer", "prompt")  # from /schema
    chat, seen = scripted(" 3 2 1", " 1 2 3")
    episode, error = play(env, chat, RECORD, 8, 30, OPENENV)
    assert error is None and episode.turn_rewards == [0.0, 1.0] and not episode.truncated
    assert seen[1][-1] == HINT
    # concurrent sessions keep their own state
    envs = [openenv_app() for _ in range(3)]
    for e, record in zip(envs, [RECORD, {"prompt": "sort: 9 8 =", "answer": " 8 9"}, RECORD]):
        e.reset(record)
    rewards = [e.step({"content": " 1 2 3"}) for e in envs]
    assert [r.reward for r in rewards] == [1.0, 0.0, 1.0] and not rewards[1].done


def test_openenv_bad_names_are_named_errors(openenv_app, tmp_path):
    with pytest.raises(ValueError, match="openenv:no_such_module:app.*server exited"):
        environments.factory("openenv:no_such_module:app", {"startup_timeout_s": 60})
    with pytest.raises(ValueError, match="action_field 'code' is not a field"):
        environments.factory(OPENENV, {"action_field": "code"})
    with pytest.raises(ValueError, match="no OpenEnv schema at http://127.0.0.1:9"):
        environments.factory("openenv:http://127.0.0.1:9", {})


@pytest.mark.parametrize("name", [VERIFIERS, OPENENV])
def test_an_adapter_without_its_library_names_the_extra(name, monkeypatch):
    from chatgen.core.imports import MissingPackage

    adapter = name.split(":")[0]
    monkeypatch.setitem(sys.modules, adapter, None)  # Python's own "not importable" mark
    with pytest.raises(
        MissingPackage,
        match=rf"{adapter} environment adapter.*--no-deps -r requirements-verifiers.txt.*"
        rf"chatgen\[{adapter}\]",
    ):
        environments.factory(name, {})
