"""Multi-turn GRPO over the environment protocol, end to end on CPU: the built-in calculator environment played
by chatgen.environments.Runner through the run's OpenAI server (the tiny Llama), with one environment in four
answering a reward that is not a number.

    .venv/bin/python -m pytest tests/integration/test_agents_rl.py

Checked: every episode played both turns through the server; the failing episodes are counted
(`env/errors`) and the run goes on; the trainer's log-probs equal the server's; the weights trained.
Then credit over turns: a reward on each turn, the step-wise `gigpo` advantage and a token budget
(`max_episode_tokens`) that cuts every episode: marked truncated, the sample cut at the budget, the
trainer's log-probs still the server's. Then the verifiers adapter (a vf.MultiTurnEnv and vf.Rubric:
this file's load_environment; one rubric in four answers no number, counted) and the OpenEnv adapter
(chatgen/environments/openenv_sort.py served by uvicorn), each played through the server.
"""

import itertools
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

from chatgen.environments.base import Step  # noqa: E402
from chatgen.environments.calculator import CalculatorEnv, write_template  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_made = itertools.count()


class ChecksumCalculator(CalculatorEnv):
    """The calculator episode, rewarded with a checksum of the final answer's text (the untrained tiny model
    never sorts: a reward its answers differ in gives every group a gradient); every fourth one made answers
    the reward as text, which is no number."""

    def __init__(self):
        self.broken = next(_made) % 4 == 0

    def step(self, message):
        step = super().step(message)
        if step.done:
            text = message.get("content") or ""
            reward = sum((i + 1) * ord(c) for i, c in enumerate(text)) % 101 / 100
            return Step(reward=str(reward) if self.broken else reward, done=True)
        return step


class TurnRewardCalculator(CalculatorEnv):
    """The calculator episode with a checksum reward on each of its turns."""

    def step(self, message):
        step = super().step(message)
        text = message.get("content") or ""
        step.reward = sum((i + 1) * ord(c) for i, c in enumerate(text)) % 101 / 100
        return step


def run_calculator(tiny_llama_dir, tmp_path, monkeypatch, environment, **more) -> list:
    """Two episodes of 2 prompts x 4 of `environment` (a class of this file, or any environment name
    with a colon) on the tiny Llama; the metrics lines."""
    from chatgen import tasks
    from chatgen.rlhf.algorithms import grpo_multiturn
    from chatgen.rlhf.config import load_config

    model = tmp_path / "tiny-llama-chat"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    write_template(model)
    monkeypatch.chdir(REPO)
    tasks.write_task_data(str(tmp_path / "data"), n_train=32, n_eval=4)
    out = tmp_path / "run"
    overrides = {
        "runtime.algorithm.environment": (
            environment if ":" in environment else f"{__name__}:{environment}"
        ),
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 8,
        "policy.n": 4,
        "runtime.train_micro_batch_size": 8,
        "runtime.train_global_batch_size": 8,
        "runtime.eval_episode_interval": "null",
        "runtime.save_episode_interval": "null",
        "runtime.data_path": tmp_path / "data/train.jsonl",
        "runtime.eval_data_path": tmp_path / "data/eval.jsonl",
        "runtime.output_dir": out,
        "policy.load": model,
        "policy_trainer.load": model,
        **more,
    }
    cfg = load_config(
        REPO / "configs/grpo_multiturn_tiny.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )
    grpo_multiturn.train(cfg, log=lambda *_: None)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_protocol_environment_trains_and_a_bad_episode_is_counted(
    tiny_llama_dir, tmp_path, monkeypatch
):
    metrics = run_calculator(tiny_llama_dir, tmp_path, monkeypatch, "ChecksumCalculator")
    assert [m["episode"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["response/turns"] == 2 and m["env/truncated"] == 0.0
        assert m["env/errors"] == 0.25  # 2 of each episode's 8 environments
        assert m["mismatch/logprob_max_abs"] < 1e-4 and m["policy/grad_norm"] > 0


def test_turn_rewards_reach_gigpo_and_a_token_budget_cuts_the_episodes(
    tiny_llama_dir, tmp_path, monkeypatch
):
    budget = 12  # below the calculator turn's own tokens: every episode is cut
    metrics = run_calculator(
        tiny_llama_dir,
        tmp_path,
        monkeypatch,
        "TurnRewardCalculator",
        **{
            "runtime.algorithm.advantage_estimator": "gigpo",
            "runtime.algorithm.max_episode_tokens": budget,
        },
    )
    assert [m["episode"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/truncated"] == 1.0 and m["env/errors"] == 0.0
        assert m["response/length"] <= budget
        assert m["mismatch/logprob_max_abs"] < 1e-4 and m["policy/grad_norm"] > 0


# the verifiers and OpenEnv adapters, trained through with the real engine and server
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
