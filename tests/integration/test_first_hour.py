"""A new user's first hour, end to end on CPU (pytest tests/integration/test_first_hour.py):

- the README's main job, from a project that `chatgen init` made (in a directory with a space in its name, run
  from another directory), on a terminal: it makes the tiny model, the data and a short warm start, runs GRPO for
  2 episodes, and prints only chatgen's own lines (a live progress line, then the summary): no warning, leak dump
  or traceback of any library, and fewer lines than one screen;
- every other recipe of `chatgen init --list` runs from its own directory (1 episode, small batches, the cached
  tiny model as its warm start; GPU recipes on a GPU machine only), in a log (no terminal): one plain line per
  episode, the summary, nothing else.

The runs are independent subprocesses, each mostly one busy core (seconds of imports, then the tiny
model's Python): the module starts them two at a time when it begins (`runs`), and each test asserts
on its own run's result, so both of CI's two cores work.
"""

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from timeouts import scaled

from chatgen.cli.init import RECIPES

pytestmark = pytest.mark.integration

NOISE = re.compile(r"warning|leaked|traceback", re.IGNORECASE)  # what a library says about itself


def noise(out: str) -> list:
    """Lines of `out` that a library wrote about itself (chatgen's own "[chatgen] ..." lines are the run's news:
    an untrained model's zero gradient, for one)."""
    return [
        line for line in out.splitlines() if NOISE.search(line) and not line.startswith("[chatgen]")
    ]


SCREEN = 24  # lines of the classic terminal
TIMEOUT = scaled(600)


def environment(**extra) -> dict:
    """A user's shell: this environment's chatgen first on PATH, nothing of chatgen's verbosity set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CHATGEN_VERBOSE", "VLLM_LOGGING_LEVEL", "PYTHONPATH")
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return {**env, **{k: str(v) for k, v in extra.items()}}


def init(project: Path, recipe: str) -> Path:
    """`chatgen init PROJECT --from RECIPE` as a user types it; returns the launch script of the command it
    printed."""
    proc = subprocess.run(
        ["chatgen", "init", str(project), "--from", recipe],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    command = next(
        line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("bash ")
    )
    assert command == f"bash {project / RECIPES[recipe][1]}"
    return project / RECIPES[recipe][1]


def on_a_terminal(argv: list, cwd, env) -> tuple:
    """Run argv with stdout and stderr on a 100x40 pseudo-terminal; (exit code, everything it wrote)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=child, stderr=child
    )
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the child side closed: the process ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    return proc.wait(timeout=TIMEOUT), b"".join(chunks).decode(errors="replace").replace(
        "\r\n", "\n"
    )


def main_job(tmp_path) -> tuple:
    """The README's main job from a fresh project, run from elsewhere on a terminal: (project, exit
    code, what it wrote)."""
    project = tmp_path / "my project"
    script = init(project, "grpo_tiny")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out = on_a_terminal(
        ["bash", str(script), "runtime.num_episode=2", "runtime.eval_episode_interval=1"],
        elsewhere,
        environment(SFT_STEPS=10),
    )
    return project, code, out


def test_the_main_job_from_a_fresh_project_prints_only_chatgens_lines(runs):
    project, code, out = runs[MAIN_JOB].result()
    assert code == 0, out
    assert not noise(out), out
    before_summary, _, summary = out.partition("[chatgen] grpo: 2 episodes done")
    screen = before_summary.split("\n")  # each live line is one of these, redrawn in place with \r
    assert len(screen) < SCREEN, out
    # the warm start's live line
    assert re.search(r"\rsft step \|.*\| 10/10, loss [\d.]+ \[", before_summary)
    assert re.search(
        r"\repisode \|█+\| 2/2, eval/reward [\d.]+ · [\d.]+ s/episode \[", before_summary
    )
    # the config: a path, not printed
    assert "resolved_config.yaml" in before_summary and "runtime:" not in out
    rows = [line.split() for line in summary.splitlines()[2:5]]
    # before training: no train reward
    assert [row[0] for row in rows] == ["0", "1", "2"] and rows[0][2] == "-"
    runs = list((project / "outputs" / "grpo_tiny").iterdir())
    assert (
        len(runs) == 1
        and f"checkpoints  outputs/grpo_tiny/{runs[0].name}/checkpoints/episode_000002" in summary
    )
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in records] == [0, 1, 2] and all("eval/reward" in r for r in records)
    # made in the project
    assert (project / "outputs" / "tiny-llama-sft" / "model.safetensors").exists()


# recipe -> what makes its one episode small (runtime.num_episode=1 for all)
# the SmolLM2 recipes' one small episode, no held-out evaluation (grpo_smollm2 evaluates once)
SMOLLM2_SMALL = [
    "runtime.sample_per_episode=8",
    "policy.n=4",
    "runtime.train_micro_batch_size=4",
    "runtime.train_global_batch_size=8",
    "runtime.generation_batch_size=8",
    "policy.max_new_tokens=8",
    "runtime.eval_episode_interval=null",
]
# the tiny GRPO-family recipes' one small episode
TINY_SMALL = [
    "runtime.sample_per_episode=16",
    "policy.n=4",
    "runtime.train_micro_batch_size=8",
    "runtime.train_global_batch_size=16",
    "runtime.generation_batch_size=16",
]
SMALL = {
    "grpo_tiny_lora": TINY_SMALL,
    "online_dpo_tiny": [
        "runtime.sample_per_episode=32",
        "policy.n=4",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=16",
    ],
    "dpo_tiny": [
        "runtime.sample_per_episode=16",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=8",
    ],
    "multiturn": [
        "runtime.sample_per_episode=8",
        "policy.n=4",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=8",
    ],
    # grpo_smollm2 keeps its one held-out evaluation
    "grpo_smollm2": [o for o in SMOLLM2_SMALL if not o.startswith("runtime.eval_episode_interval")],
    "grpo_smollm2_lora": SMOLLM2_SMALL,
    "grpo_smollm2_fsdp": SMOLLM2_SMALL,
    "grpo_smollm2_math": SMOLLM2_SMALL,
    **{
        f"{name}_tiny": TINY_SMALL
        for name in (
            *("dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "cispo", "sapo", "gmpo"),
            *("length_penalty", "stop_properly"),
        )
    },
    "grpo_tiny_fsdp": TINY_SMALL,
    "opd_tiny": TINY_SMALL,  # its teacher: the warm start (TEACHER_LOAD), not a 20-episode run
    "gymnasium_tiny": [
        "runtime.sample_per_episode=8",
        "policy.n=4",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=8",
    ],
    "verifiers_tiny": [
        "runtime.sample_per_episode=8",
        "policy.n=4",
        "runtime.train_micro_batch_size=8",
        "runtime.train_global_batch_size=8",
    ],
    # the agentic SmolLM2 recipes: one small episode of short turns
    "search_tiny": SMOLLM2_SMALL,
    "tool_math_smollm2": SMOLLM2_SMALL,
    "dapo_smollm2": SMOLLM2_SMALL,
    "grpo_llama": ["policy.n=4", "runtime.generation_batch_size=8"],
    "ppo_llama": ["policy.n=4", "runtime.generation_batch_size=8"],
}
GPU = {"grpo_llama", "ppo_llama"}
# Recipes whose one episode takes a code path that another run here already takes (a loss or an
# estimator of the same GRPO loop, a SmolLM2 variant of grpo_smollm2 or search_tiny): they run with
# the slow tests. Every recipe's configs still load in the fast tier (tests/unit/test_cli_init.py).
SLOW = {
    *(
        f"{name}_tiny"
        for name in ("dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "sapo", "gmpo")
    ),
    "length_penalty_tiny",
    "stop_properly_tiny",
    "grpo_smollm2_math",
    "grpo_smollm2_lora",
    "dapo_smollm2",
    "tool_math_smollm2",
    "grpo_smollm2_fsdp",  # grpo_smollm2's episode with the trainer of grpo_tiny_fsdp
    # the config run in-process by another test: test_lora's GRPO with LoRA, test_fsdp_backend's
    # GRPO from the warm start, test_rl_recipes' distillation with a teacher
    "grpo_tiny_lora",
    "grpo_tiny_fsdp",
    "opd_tiny",
    # and test_rlhf_runs' DPO and online DPO runs (their scripts: prepare_tiny.sh, then the config)
    "dpo_tiny",
    "online_dpo_tiny",
    # gymnasium_tiny's episode with the verifiers adapter (trained on in test_agents_rl.py)
    "verifiers_tiny",
}


def marks(recipe: str) -> tuple:
    return (pytest.mark.gpu,) if recipe in GPU else (pytest.mark.slow,) if recipe in SLOW else ()


def test_every_listed_recipe_has_a_run_here():
    assert set(SMALL) | {"grpo_tiny"} == set(RECIPES)  # grpo_tiny: the main-job test above


@pytest.fixture(scope="module")
def sort_digits(tmp_path_factory, make_tiny):
    """A small sort-digits data directory and a warm start to copy (the cached tiny Llama itself)."""
    from chatgen import tasks

    data = tmp_path_factory.mktemp("sort_digits")
    tasks.write_task_data(str(data), n_train=64, n_eval=8)
    return data, make_tiny("tiny_llama")


SMOLLM2 = (
    "grpo_smollm2",
    "grpo_smollm2_math",
    "dapo_smollm2",
    "grpo_smollm2_lora",
    "grpo_smollm2_fsdp",
    "search_tiny",
    "tool_math_smollm2",
)


def recipe_env(recipe, tmp_path, sort_digits, smollm2) -> dict:
    """The variables that point a recipe at small data and a ready model (its preparation steps then skip)."""
    from chatgen import tasks

    if recipe == "search_tiny":  # its script writes the task; SmolLM2 itself is the warm start
        return environment(MODEL=smollm2, POLICY_LOAD=smollm2, DATA_DIR=tmp_path / "search")
    if recipe in SMOLLM2:
        data = tmp_path / "data"
        if (
            recipe == "grpo_smollm2_math"
        ):  # its script's default level (MIN_STEPS, MAX_STEPS, MAX_OPERAND)
            level = {"task": "math_words", "min_steps": 1, "max_steps": 2, "max_operand": 12}
        else:
            level = {"task": "arithmetic"}
        tasks.write_task_data(str(data), n_train=32, n_eval=4, **level)
        return environment(POLICY_LOAD=smollm2, DATA_DIR=data)
    data, tiny = sort_digits
    # a copy: the multi-turn recipe writes a chat template into it
    warm_start = tmp_path / "warm-start"
    shutil.copytree(tiny, warm_start)
    if recipe in GPU:  # GSM8K's format, from the arithmetic task; the tiny model on one GPU
        gsm = tmp_path / "gsm"
        tasks.write_task_data(str(gsm), task="arithmetic", n_train=32, n_eval=4)
        (gsm / "eval.jsonl").rename(gsm / "test.jsonl")
        return environment(
            POLICY_LOAD=warm_start,
            DATASET_PATH=gsm,
            NUM_GPU=1,
            TP=1,
            NUM_CPU=2,
            MAX_NEW_TOKENS=8,
            SEQ_LENGTH=64,
            STOP_TOKENS="</s>",
            SAMPLE_PER_EPISODE=8,
            MICRO_BATCH_SIZE=4,
            GLOBAL_BATCH_SIZE=8,
        )
    # opd_tiny's teacher: the warm start itself (its script would otherwise train one for 20 episodes)
    teacher = {"TEACHER_LOAD": warm_start} if recipe == "opd_tiny" else {}
    return environment(MODEL=tiny, DATA_DIR=data, POLICY_LOAD=warm_start, **teacher)


def run_recipe(recipe, tmp_path, sort_digits, smollm2=None) -> tuple:
    """`recipe`'s launch script from its own project, one small episode, output to a log: (project,
    the finished process)."""
    project = tmp_path / recipe
    script = init(project, recipe)
    proc = subprocess.run(
        ["bash", str(script), "runtime.num_episode=1", *SMALL[recipe]],
        cwd=tmp_path,
        env=recipe_env(recipe, tmp_path, sort_digits, smollm2),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return project, proc


MAIN_JOB = "main job"
AT_ONCE = 2  # runs at a time: each keeps about one core busy; CI has two
FIRST = (*SMOLLM2, MAIN_JOB, "multiturn")  # the longest first, so that the last two end together


def selected(session) -> set:
    """The CPU runs that the session's selected tests of this module assert on."""
    names = set()
    for item in session.items:
        if item.path != Path(__file__) or item.get_closest_marker("skip"):  # slow, not asked for
            continue
        if item.originalname == "test_the_main_job_from_a_fresh_project_prints_only_chatgens_lines":
            names.add(MAIN_JOB)
        elif item.originalname == "test_a_recipe_runs_from_its_own_directory":
            names.add(item.callspec.params["recipe"])
    return names - GPU


@pytest.fixture(scope="module")
def runs(request, sort_digits, tmp_path_factory):
    """name -> Future of its run (MAIN_JOB: main_job's result, a recipe: run_recipe's), started
    AT_ONCE at a time when the module begins; "smollm2": the SmolLM2 directory, or why it is
    missing. (GPU recipes run in their own test.)"""
    names = selected(request.session)
    smollm2 = None
    if names & set(SMOLLM2):
        try:
            smollm2 = request.getfixturevalue("smollm2_dir")
        except pytest.skip.Exception as e:  # their tests skip with this reason; the others run
            names -= set(SMOLLM2)
            smollm2 = e
    order = sorted(names, key=lambda n: FIRST.index(n) if n in FIRST else len(FIRST))
    pool = ThreadPoolExecutor(AT_ONCE, thread_name_prefix="first-hour-run")
    started = {}
    for name in order:
        tmp = tmp_path_factory.mktemp(name.replace(" ", "_"))
        if name == MAIN_JOB:
            started[name] = pool.submit(main_job, tmp)
        else:
            started[name] = pool.submit(run_recipe, name, tmp, sort_digits, smollm2)
    yield {"smollm2": smollm2, **started}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=marks(r)) for r in SMALL])
def test_a_recipe_runs_from_its_own_directory(recipe, tmp_path, sort_digits, request):
    if recipe in GPU:
        project, proc = run_recipe(recipe, tmp_path, sort_digits)
    else:
        runs = request.getfixturevalue("runs")
        if recipe in SMOLLM2 and not isinstance(runs["smollm2"], Path):
            pytest.skip(str(runs["smollm2"]))
        project, proc = runs[recipe].result()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not noise(out), out
    # no terminal: one plain line per episode
    assert re.search(r"^episode 1/1: ", proc.stdout, re.MULTILINE)
    assert ": 1 episode done in" in proc.stdout and "  metrics " in proc.stdout  # the summary
    # under the project
    (run,) = [p for p in (project / "outputs").glob("*/*") if (p / "metrics.jsonl").exists()]
    assert 1 in [
        json.loads(line)["episode"] for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
