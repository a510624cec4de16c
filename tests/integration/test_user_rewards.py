"""A reward as a user writes it, in a project of `chatgen init`, trained with (pytest
tests/integration/test_user_rewards.py):

- a plain function in its own file (`mytask/reward.py:ascending`, TRL's shape), named as the reward's model_class,
  run by the `chatgen` command from the project directory with no PYTHONPATH pointing there, 2 GRPO episodes,
  with the local launcher (one process) and with Ray (the reward in an actor, which imports it too);
- the same function as one weighted term of several (`chatgen.rlhf.rewards:Rewards`), each term logged.

The three runs are independent `chatgen train` processes, each mostly one busy core: `runs` starts them
when the module begins (the Ray run alone, then the other two at once), and each test asserts on its own
run's metrics.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

REWARD = '''"""My task's reward: 1.0 for the digits of the prompt in ascending order, else the share of places right."""

import os

# a log the module never flushes or closes (the run's output dir + .scored.log): chatgen's exit must keep it
LOG = open(os.environ.get("OUTPUT_DIR", "outputs/run") + ".scored.log", "a")


def ascending(completions, answer, **kwargs):
    scores = []
    for completion, want in zip(completions, answer):
        got, want = completion.split(), want.split()
        scores.append(sum(g == w for g, w in zip(got, want)) / max(len(want), 1))
        LOG.write(f"{scores[-1]}\\n")
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


TERMS = (
    "runtime.launcher=local",
    "models.reward.model_class=chatgen.rlhf.rewards:Rewards",
    "models.reward.config.terms={mine: {function: 'mytask/reward.py:ascending'}, "
    "rule: {function: sort_digits, weight: 0.5}}",
)
# run name -> its extra arguments (each writes outputs/<name>)
RUNS = {"local": ("runtime.launcher=local",), "ray": ("runtime.launcher=ray",), "terms": TERMS}


def selected(session) -> set:
    """The runs that the session's selected tests of this module assert on."""
    names = set()
    for item in session.items:
        if item.path != Path(__file__):
            continue
        if item.originalname == "test_a_plain_function_reward_of_the_project_trains":
            names.add(item.callspec.params["launcher"])
        elif item.originalname == "test_weighted_terms_of_the_project_train_each_logged":
            names.add("terms")
    return names


@pytest.fixture(scope="module")
def runs(request, project, tiny_llama_dir):
    """name -> Future of train()'s metrics: the Ray run alone first (Ray's start-up has a deadline
    that a loaded machine can miss), then the one-process runs two at a time (each keeps about one
    core busy)."""
    names = selected(request.session)
    pool = ThreadPoolExecutor(2, thread_name_prefix="user-reward-run")

    def ray_run():
        if "ray" in names:
            return train(project, tiny_llama_dir, "outputs/ray", *RUNS["ray"])

    alone = pool.submit(ray_run)

    def after_ray(name):
        alone.exception()  # waits; the Ray run's failure is its own test's
        return train(project, tiny_llama_dir, f"outputs/{name}", *RUNS[name])

    started = {name: pool.submit(after_ray, name) for name in ("local", "terms") if name in names}
    yield {"ray": alone, **started, "project": project}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_plain_function_reward_of_the_project_trains(runs, launcher):
    metrics = runs[launcher].result()
    assert sorted(metrics) == [0, 1, 2]
    for episode in (1, 2):
        # the function's term, logged by its name
        assert 0.0 <= metrics[episode]["reward/ascending"] <= 1.0
        assert metrics[episode]["reward/mean"] == pytest.approx(
            metrics[episode]["reward/ascending"], abs=1e-6
        )
    assert "eval/reward/ascending" in metrics[0] and "eval/reward/ascending" in metrics[2]
    # the local run's reward ran in `chatgen train`'s own process, which exits without teardown
    if launcher == "local":
        scored = (runs["project"] / "outputs" / "local.scored.log").read_text().splitlines()
        # 2 episodes x 16 samples, 3 evaluations (episodes 0-2) x 8 held-out prompts: every line kept
        assert len(scored) == 2 * 16 + 3 * 8 and all(0.0 <= float(x) <= 1.0 for x in scored)


def test_weighted_terms_of_the_project_train_each_logged(runs):
    metrics = runs["terms"].result()
    for episode in (1, 2):
        m = metrics[episode]
        assert m["reward/mean"] == pytest.approx(
            m["reward/mine"] + 0.5 * m["reward/rule"], abs=1e-5
        )
