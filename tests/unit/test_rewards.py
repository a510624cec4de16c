"""Rewards as users write them (chatgen.rlhf.rewards): plain functions from the project directory, weighted terms,
a reward model, a remote reward, math-verify, and the one check of every reward output.

    pytest tests/unit/test_rewards.py
"""

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chatgen.config import ConfigError
from chatgen.rlhf.config import load_config
from chatgen.rlhf.health import RunHealthError
from chatgen.rlhf.rewards import Rewards
from chatgen.rlhf.run import Run

REPO = Path(__file__).resolve().parents[2]


def project(tmp_path, reward_line: str, files: dict) -> Path:
    """A project laid out as `chatgen init` lays it out (DIR/configs/grpo_tiny.yaml ...) with `files` added and the
    reward entry's model_class set by `reward_line`; returns the main YAML."""
    root = tmp_path / "proj"
    shutil.copytree(REPO / "configs" / "grpo_tiny", root / "configs" / "grpo_tiny")
    main = (REPO / "configs" / "grpo_tiny.yaml").read_text()
    rule = (
        "    model_class: chatgen.rlhf.rewards:RuleReward\n    config:\n      rule: sort_digits\n"
    )
    main = main.replace(rule, reward_line)
    (root / "configs" / "grpo_tiny.yaml").write_text(main)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "configs" / "grpo_tiny.yaml"


REWARD_PY = "def brevity(completions, answer, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n"


@pytest.mark.parametrize("spec", ["mytask/reward.py:brevity", "mytask.reward:brevity"])
def test_a_plain_function_in_the_project_runs_as_the_reward_from_any_directory(
    tmp_path, data, monkeypatch, spec
):
    main = project(
        tmp_path,
        f"    model_class: {spec}\n",
        {"mytask/__init__.py": "", "mytask/reward.py": REWARD_PY},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the project: found through the main YAML's project directory
    monkeypatch.delenv("CHATGEN_PROJECT_DIRS", raising=False)
    cfg = load_config(main, data)
    entry = cfg.models["reward"]
    assert entry.model_class == "chatgen.rlhf.rewards:Rewards"
    assert entry.config.terms == {"brevity": {"function": spec}}
    # for the actors
    assert os.environ["CHATGEN_PROJECT_DIRS"].split(os.pathsep)[0] == str(tmp_path / "proj")
    reward = Rewards(entry.config).start()
    out = reward.score({"texts": ["ab", "abcd"], "answer": ["1", "2"], "prompt": ["p", "q"]})
    assert torch.allclose(out["rewards"], torch.tensor([1 / 3, 1 / 5]))
    assert torch.equal(out["terms"]["brevity"], out["rewards"])


def test_an_unimportable_reward_names_the_file_and_the_directories_searched_once(
    tmp_path, data, monkeypatch
):
    main = project(
        tmp_path, "    model_class: mytask/rewrd.py:brevity\n", {"mytask/reward.py": REWARD_PY}
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(main, data)
    message = str(e.value)
    assert (
        "mytask/rewrd.py not found" in message
        and str(tmp_path / "proj") in message
        and str(tmp_path) in message
    )
    assert "colocation" not in message  # no second, misleading error about the entry that failed


def test_chatgen_config_refuses_an_unimportable_reward_in_seconds(tmp_path, data):
    main = project(tmp_path, "    model_class: mytask.nothere:brevity\n", {})
    proc = subprocess.run(
        [sys.executable, "-m", "chatgen.cli", "config", str(main), *data],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no module 'mytask.nothere'" in proc.stderr and "mytask/nothere.py" in proc.stderr, (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
    # no model, no engine: the config's own checks (timeout=120)
    assert "started" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "code, expected",
    [
        ("def brevity(texts):\n    return [0.0]\n", "takes `completions`"),
        ("brevity = 3\n", "not a function"),
        (
            "import not_a_package_anywhere\ndef brevity(completions, **kw):\n    return []\n",
            "importing it failed: ModuleNotFoundError",
        ),
    ],
)
def test_a_reward_that_cannot_be_one_is_refused_at_load(
    tmp_path, data, monkeypatch, code, expected
):
    main = project(
        tmp_path, "    model_class: mytask/reward.py:brevity\n", {"mytask/reward.py": code}
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=expected):
        load_config(main, data)


def test_weighted_terms_unknown_names_and_bad_keys_are_config_errors(tmp_path, data, monkeypatch):
    terms = (
        "    model_class: chatgen.rlhf.rewards:Rewards\n    config:\n      terms:\n"
        "        acc: {function: math_verfy}\n        fmt: {function: math_format, wieght: 2}\n"
        "        two: {function: math_format, url: 'http://127.0.0.1:9'}\n"
    )
    main = project(tmp_path, terms, {})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(main, data)
    message = str(e.value)
    assert "did you mean 'math_verify'?" in message
    assert "fmt.wieght: unknown key; did you mean 'weight'?" in message
    assert "two.function: give exactly one of function, model, url" in message


def test_weighted_terms_sum_and_each_is_logged_as_its_own_metric(tmp_path):
    config = {
        "terms": {
            "acc": {"function": "math_verify"},
            "fmt": {"function": "math_format", "weight": 0.5},
            "digits": {"function": "sort_digits", "weight": 0.0},
        }
    }
    reward = Rewards(config).start()
    data = {
        "texts": ["so #### 57", "\\boxed{3}", "57"],
        "answer": ["#### 57", "#### 4", "#### 57"],
        "prompt": ["a", "b", "c"],
    }
    out = reward.score(data)
    assert out["terms"]["acc"].tolist() == [1.0, 0.0, 1.0] and out["terms"]["fmt"].tolist() == [
        1.0,
        1.0,
        0.0,
    ]
    assert out["rewards"].tolist() == [1.5, 0.5, 1.0]
    # the run logs each term's mean under reward/<name> at the next log, eval/reward/<name> for the held-out set
    run = SimpleNamespace(
        cfg=SimpleNamespace(models={"reward": SimpleNamespace(model_class="x:Rewards")}),
        runtime={"reward": SimpleNamespace(first=lambda method, d: reward.score(d))},
        pending_metrics={},
        _evaluating=False,
    )
    batch = SimpleNamespace(
        metadata=[{"answer": a, "prompt": p} for a, p in zip(data["answer"], data["prompt"])],
        texts=data["texts"],
    )
    rewards = Run.score(run, batch)
    assert rewards.tolist() == [1.5, 0.5, 1.0]
    assert run.pending_metrics == {
        f"reward/{name}": pytest.approx(v.mean().item()) for name, v in out["terms"].items()
    }
    # unweighted: the term's own mean
    assert run.pending_metrics["reward/acc"] == pytest.approx(2 / 3)
    # the batch keeps each term and its weight (GDPO normalises them one by one)
    assert batch.reward_terms["fmt"].tolist() == [1.0, 1.0, 0.0]
    assert batch.reward_weights == {"acc": 1.0, "fmt": 0.5, "digits": 0.0}


@pytest.mark.parametrize(
    "returned, expected",
    [
        ("None", "returned NoneType None"),
        ("'1.0'", "returned str '1.0'"),
        ("[1.0]", "returned 1 values for 2 completions"),
        ("[1.0, 'x']", "returned a list of float, str"),
        ("[1.0, float('nan')]", "returned NaN/inf for samples [1]"),
    ],
)
def test_a_reward_of_the_wrong_type_is_refused_naming_it_and_what_it_returned(
    tmp_path, monkeypatch, returned, expected
):
    (tmp_path / "bad.py").write_text(f"def bad(completions, **kwargs):\n    return {returned}\n")
    monkeypatch.chdir(tmp_path)
    reward = Rewards({"terms": {"mine": {"function": "bad.py:bad"}}}).start()
    with pytest.raises((TypeError, ValueError, RunHealthError)) as e:
        reward.score({"texts": ["a", "b"], "answer": ["1", "2"]})
    assert "reward 'mine' (bad.py:bad)" in str(e.value) and expected in str(e.value)
    assert "one per completion" in str(e.value) or "finite" in str(e.value)


def test_a_module_reward_of_the_wrong_type_is_refused_by_the_run():
    run = SimpleNamespace(
        cfg=SimpleNamespace(models={"reward": SimpleNamespace(model_class="my.mod:Judge")}),
        runtime={"reward": SimpleNamespace(first=lambda method, d: None)},
        pending_metrics={},
        _evaluating=False,
    )
    batch = SimpleNamespace(metadata=[{"prompt": "p"}], texts=["r"])
    with pytest.raises(
        TypeError, match=r"models.reward \(my.mod:Judge\).score returned NoneType None"
    ):
        Run.score(run, batch)


@pytest.mark.parametrize(
    "completion, reference, right",
    [
        ("3 + 4 = 7\n#### 7", "#### 7", 1.0),
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("so \\boxed{\\frac{3}{4}}", "#### 0.75", 1.0),
        ("#### 1,250", "#### 1250", 1.0),
        ("#### 8", "#### 7", 0.0),
        ("I do not know", "#### 7", 0.0),
        (
            "She has 12 - 5 = 7 pencils left.",
            "#### 7",
            1.0,
        ),  # no "####": the last number, as GSM8K graders read it
        ("7 apples, then 2 more: 9", "#### 7", 0.0),
    ],
)
def test_math_verify_reads_latex_fractions_boxed_and_gsm8k_answers(completion, reference, right):
    from chatgen.tasks.math_words import math_format_reward, math_verify_reward

    assert math_verify_reward([completion], [reference]) == [right]
    assert math_format_reward([completion]) == [
        float("####" in completion or "boxed" in completion)
    ]


@pytest.mark.parametrize("steps", [(2, 4), (1, 1), (1, 2), (3, 4)])
def test_the_math_word_problems_take_the_asked_steps_with_checkable_answers(steps):
    from chatgen.tasks.math_words import math_verify_reward, records

    problems = records(200, seed=3, min_steps=steps[0], max_steps=steps[1])
    assert len({r["prompt"] for r in problems}) > 150
    counts = {r["answer"].count("=") for r in problems}  # one "a op b = c." per step
    assert counts == set(range(steps[0], steps[1] + 1)) and all(
        "\n#### " in r["answer"] for r in problems
    )
    final = [r["answer"].rpartition("#### ")[2] for r in problems]
    assert (
        math_verify_reward([f"#### {f}" for f in final], [r["answer"] for r in problems])
        == [1.0] * 200
    )
    for r in problems:  # each worked step is true arithmetic
        for step in r["answer"].split("\n")[0].split(". "):
            lhs, _, rhs = step.rstrip(".").partition(" = ")
            assert eval(lhs) == float(rhs.split()[0])  # noqa: S307 - our own generated "a op b"


def test_math_words_max_operand_bounds_every_number_of_a_question():
    from chatgen.tasks.math_words import records

    problems = records(100, seed=5, min_steps=1, max_steps=2, max_operand=12)
    numbers = [int(x) for r in problems for x in re.findall(r"\d+", r["prompt"])]
    assert (
        max(numbers) == 12
        and max(
            int(x)
            for r in records(100, seed=5, min_steps=1, max_steps=2)
            for x in re.findall(r"\d+", r["prompt"])
        )
        > 12
    )


def test_a_math_words_difficulty_no_problem_has_is_refused_naming_the_keys():
    from chatgen.tasks.math_words import records

    with pytest.raises(ValueError, match="no math_words problem takes 5 to 6 steps.*--min-steps"):
        records(4, seed=0, min_steps=5, max_steps=6)
    with pytest.raises(ValueError, match="max_operand=1 \\(--max-operand\\): raise it"):
        records(4, seed=0, min_steps=1, max_steps=1, max_operand=1)


# ---- a remote reward: a real HTTP server on loopback -------------------------------------------------------


class Scorer(http.server.BaseHTTPRequestHandler):
    """Scores len(completion); `mode` (class attribute) makes it answer 500 or hang instead."""

    mode, hits = "ok", []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Scorer.hits.append(body)
        if Scorer.mode == "hang":
            time.sleep(2)
        if Scorer.mode in ("500", "hang"):
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def scorer():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Scorer.mode, Scorer.hits = "ok", []
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_a_remote_reward_is_batched_and_gets_the_columns(scorer):
    reward = Rewards({"terms": {"remote": {"url": scorer, "batch_size": 2}}}).start()
    out = reward.score(
        {"texts": ["a", "bb", "ccc"], "answer": ["1", "2", "3"], "prompt": ["p", "q", "r"]}
    )
    assert out["rewards"].tolist() == [1.0, 2.0, 3.0] and out["metrics"] == {"remote/errors": 0}
    # two requests of at most batch_size
    assert sorted(len(h["completions"]) for h in Scorer.hits) == [
        1,
        2,
    ]
    assert {"answer", "prompts", "prompt"} <= set(Scorer.hits[0])
    reward.shutdown()


@pytest.mark.parametrize("mode", ["500", "hang"])
def test_a_failing_remote_reward_follows_its_policy_and_is_counted(scorer, mode):
    Scorer.mode = mode
    term = {"url": scorer, "retries": 1, "timeout": 0.5, "batch_size": 2}
    zero = Rewards(
        {"terms": {"remote": {**term, "on_error": "zero"}, "fmt": {"function": "math_format"}}}
    ).start()
    out = zero.score({"texts": ["#### 1", "b", "c"], "answer": ["1", "2", "3"]})
    assert out["terms"]["remote"].tolist() == [0.0, 0.0, 0.0] and out["metrics"] == {
        "remote/errors": 3
    }
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]  # the other terms go on
    assert len(Scorer.hits) == 4  # 2 requests x (1 try + 1 retry)
    fail = Rewards({"terms": {"remote": {**term, "on_error": "fail"}}}).start()
    with pytest.raises(
        ConnectionError,
        match=r"reward remote: http://127.0.0.1:\d+/score failed after 2 tries .*"
        r"on_error: fail",
    ):
        fail.score({"texts": ["a"], "answer": ["1"]})
    zero.shutdown()
    fail.shutdown()


def test_an_unreachable_reward_url_is_refused_before_anything_starts(tmp_path, data, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    main = project(
        tmp_path,
        "    model_class: chatgen.rlhf.rewards:Rewards\n    config:\n      terms:\n"
        f"        remote: {{url: 'http://127.0.0.1:{port}/score'}}\n",
        {},
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=rf"remote: url: http://127.0.0.1:{port}/score is unreachable"
    ):
        load_config(main, data)


# ---- a reward model: an HF sequence-classification checkpoint ---------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's config and tokenizer as a LlamaForSequenceClassification with one label (random head)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("reward-model")
    config = AutoConfig.from_pretrained(tiny_llama_dir, num_labels=1)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def test_a_reward_model_scores_a_batch_as_running_it_by_hand(reward_model_dir):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    prompts = ["sort: 3 1 2 =", "sort: 9 8 =", "sort: 5 =", "sort: 4 4 1 7 ="]
    texts = [" 1 2 3", " 8 9 9 9", " 5", " 1 4"]
    reward = Rewards({"terms": {"rm": {"model": str(reward_model_dir), "batch_size": 3}}}).start()
    scores = reward.score({"texts": texts, "prompt": prompts})["rewards"]
    model = LlamaForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():  # one sequence at a time, no padding: the score at its last token
        by_hand = [
            model(**tokenizer(p + t, return_tensors="pt")).logits[0, 0].item()
            for p, t in zip(prompts, texts)
        ]
    assert scores.tolist() == pytest.approx(by_hand, abs=1e-5)
    assert len(set(by_hand)) == 4  # distinct sequences, distinct scores: a mix-up would show


def test_a_record_without_a_field_a_reward_takes_is_refused_before_anything_starts(
    tmp_path, capsys
):
    """Issue 50, finding 13: a data file without the `answer` RuleReward scores against (or the
    column a reward function takes) failed in the first scoring, after every model started, naming
    no file or record."""
    from chatgen import cli

    (tmp_path / "train.jsonl").write_text(
        '{"prompt": "3 1 2", "answer": "1 2 3"}\n{"prompt": "2 1"}\n'
    )
    rule = REPO / "configs" / "grpo_tiny.yaml"
    base = [
        f"runtime.data_path={tmp_path}/train.jsonl",
        "runtime.eval_data_path=null",
        "runtime.eval_episode_interval=null",
    ]
    assert cli.main(["config", str(rule), *base]) == 2
    err = capsys.readouterr().err
    assert f"runtime.data_path: {tmp_path}/train.jsonl, record 2 has no field 'answer'" in err
    assert "models.reward (RuleReward) takes" in err
    main = project(
        tmp_path,
        "    model_class: mytask/reward.py:brevity\n",
        {"mytask/reward.py": REWARD_PY.replace("answer", "solution")},
    )
    assert cli.main(["config", str(main), *base]) == 2
    err = capsys.readouterr().err
    assert "record 1 has no field 'solution', which models.reward.config.terms.brevity" in err
