"""A reward as a user writes it, in a project of `chatgen init`, trained with (pytest
tests/integration/test_user_rewards.py):

- a plain function in its own file (`mytask/reward.py:ascending`, TRL's shape), named as the reward's model_class,
  run by the `chatgen` command from the project directory with no PYTHONPATH pointing there, 2 GRPO episodes,
  with the local launcher (one process) and with Ray (the reward in an actor, which imports it too);
- the same function as one weighted term of several (`chatgen.rlhf.rewards:Rewards`), each term logged.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

REWARD = '''"""My task's reward: 1.0 for the digits of the prompt in ascending order, else the share of places right."""


def ascending(completions, answer, **kwargs):
    scores = []
    for completion, want in zip(completions, answer):
        got, want = completion.split(), want.split()
        scores.append(sum(g == w for g, w in zip(got, want)) / max(len(want), 1))
    return scores
'''


def environment(**extra) -> dict:
    """A user's shell: this checkout's chatgen (PYTHONPATH = the checkout only, never the project)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("CHATGEN_VERBOSE", "CHATGEN_PROJECT_DIRS")
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    return {**env, **{k: str(v) for k, v in extra.items()}}


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama_dir):
    """`chatgen init` a grpo_tiny project, add mytask/reward.py, point the reward at it; small data."""
    from chatgen import tasks

    root = tmp_path_factory.mktemp("user") / "my project"
    proc = subprocess.run(
        [sys.executable, "-m", "chatgen.cli", "init", str(root), "--from", "grpo_tiny"],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (root / "mytask").mkdir()
    (root / "mytask" / "reward.py").write_text(REWARD)
    main = root / "configs" / "grpo_tiny.yaml"
    text = main.read_text()
    rule = (
        "    model_class: chatgen.rlhf.rewards:RuleReward\n    config:\n      rule: sort_digits\n"
    )
    assert rule in text
    main.write_text(text.replace(rule, "    model_class: mytask/reward.py:ascending\n"))
    tasks.write_task_data(str(root / "outputs" / "data"), n_train=32, n_eval=8)
    return root


SMALL = [
    "runtime.num_episode=2",
    "runtime.sample_per_episode=16",
    "policy.n=4",
    "runtime.train_micro_batch_size=8",
    "runtime.train_global_batch_size=16",
    "runtime.generation_batch_size=16",
    "runtime.eval_episode_interval=1",
    "runtime.save_episode_interval=null",
]


def train(project, tiny, out: str, *extra) -> dict:
    proc = subprocess.run(
        ["chatgen", "train", "configs/grpo_tiny.yaml", *SMALL, f"runtime.output_dir={out}", *extra],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
        env=environment(POLICY_LOAD=tiny, DATA_DIR="outputs/data", OUTPUT_DIR=out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [
        json.loads(line) for line in (project / out / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["episode"]: r for r in records}


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_plain_function_reward_of_the_project_trains(project, tiny_llama_dir, launcher):
    metrics = train(project, tiny_llama_dir, f"outputs/{launcher}", f"runtime.launcher={launcher}")
    assert sorted(metrics) == [0, 1, 2]
    for episode in (1, 2):
        # the function's term, logged by its name
        assert 0.0 <= metrics[episode]["reward/ascending"] <= 1.0
        assert metrics[episode]["reward/mean"] == pytest.approx(
            metrics[episode]["reward/ascending"], abs=1e-6
        )
    assert "eval/reward/ascending" in metrics[0] and "eval/reward/ascending" in metrics[2]


def test_weighted_terms_of_the_project_train_each_logged(project, tiny_llama_dir):
    terms = (
        "runtime.launcher=local",
        "models.reward.model_class=chatgen.rlhf.rewards:Rewards",
        "models.reward.config.terms={mine: {function: 'mytask/reward.py:ascending'}, "
        "rule: {function: sort_digits, weight: 0.5}}",
    )
    metrics = train(project, tiny_llama_dir, "outputs/terms", *terms)
    for episode in (1, 2):
        m = metrics[episode]
        assert m["reward/mean"] == pytest.approx(
            m["reward/mine"] + 0.5 * m["reward/rule"], abs=1e-5
        )
