"""Multi-turn GRPO through the verifiers and OpenEnv adapters, end to end on CPU with the real engine
and server: a verifiers environment (vf.MultiTurnEnv + vf.Rubric, this file's load_environment) and
the OpenEnv sort app served by uvicorn (chatgen/environments/openenv_sort.py), played by the tiny
Llama through the run's OpenAI server.

    .venv/bin/python -m pytest tests/integration/test_env_adapters_rl.py

Checked: every episode played its turns through the server (the env's observation between them);
the verifiers rubric's reward trains (gradient, trainer log-probs equal to the server's) and the
episodes whose rubric answers no number are counted (`env/errors`), the run going on.
"""

import itertools

import pytest
from test_agents_rl import run_calculator

pytestmark = pytest.mark.integration

_scored = itertools.count()


def load_environment():
    """A two-turn verifiers environment rewarded with a checksum of the last answer's text (the
    untrained tiny model never sorts: a reward its answers differ in gives every group a gradient);
    every fourth scoring answers the reward as text, which is no number."""
    import verifiers as vf
    from datasets import Dataset

    class AskTwice(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [vf.UserMessage(content="again: " + state["prompt"][-1].content)]

    def checksum(completion, parser):
        text = parser.parse_answer(completion) or ""
        value = sum((i + 1) * ord(c) for i, c in enumerate(text)) % 101 / 100
        return str(value) if next(_scored) % 4 == 0 else value

    rows = Dataset.from_list([{"question": "sort: 1 2 =", "answer": " 1 2"}])
    return AskTwice(max_turns=2, dataset=rows, rubric=vf.Rubric(funcs=[checksum]))


def test_a_verifiers_environment_trains_through_the_adapter(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed")
    metrics = run_calculator(tiny_llama_dir, tmp_path, monkeypatch, f"verifiers:{__name__}")
    assert [m["episode"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["response/turns"] == 2 and m["env/num_turns"] == 2.0
        assert m["env/errors"] == 0.25  # 2 of each episode's 8 rubrics answered text
        assert m["mismatch/logprob_max_abs"] < 1e-4 and m["policy/grad_norm"] > 0


def test_an_openenv_server_is_played_through_the_adapter(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("openenv", reason="the openenv extra (openenv-core) is not installed")
    metrics = run_calculator(
        tiny_llama_dir,
        tmp_path,
        monkeypatch,
        "openenv:chatgen.environments.openenv_sort:app",
        **{"runtime.num_episode": 1},
    )
    (m,) = metrics
    # the untrained model never sorts: every first answer gets the hint turn and a second try
    assert m["response/turns"] == 2 and m["env/errors"] == 0.0 and m["env/truncated"] == 0.0
    assert m["mismatch/logprob_max_abs"] < 1e-4
