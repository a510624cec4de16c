"""Multi-turn GRPO through the OpenAI endpoint, end to end on CPU: the tiny Llama served over HTTP by the run,
examples/calculator_env.py's environment talking to it with the official `openai` client, GRPO training on
what the server returned.

    .venv/bin/python -m pytest tests/integration/test_multiturn_rl.py

One 2-episode run (one process: runtime.launcher auto runs a one-rank run in the driver). What is checked,
against what the environment received over HTTP: every call went over HTTP through the openai client; the
trained token ids are the server's; the loss sees exactly the generated tokens of every turn (the template's
and the calculator's tokens are masked); the trainer's log-probs equal the server's within 1e-4 on every
generated token of every turn; episode 2 was served by the weights trained in episode 1; the weights changed;
the server is gone after the run.
"""

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.environments.calculator import write_template  # noqa: E402
from examples.calculator_env import CalculatorEnv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SYNC_TOL = 1e-4  # fp32: vLLM vs Megatron log-probs of the same weights differ by ~1e-6


class RecordingEnv(CalculatorEnv):
    """The calculator environment, recording each HTTP exchange of its openai client and each episode; its
    reward is one the untrained model's answers differ in."""

    requests, episodes, lock = [], [], threading.Lock()

    def __init__(self, base_url, api_key, model):
        super().__init__(base_url, api_key, model)

        def record(response):
            with self.lock:
                self.requests.append(
                    (response.request.method, str(response.request.url), response.status_code)
                )

        # the same openai client, given an httpx client that reports every response it receives
        self.client = self.client.with_options(
            http_client=httpx.Client(event_hooks={"response": [record]})
        )

    def episode(self, record, temperature, max_tokens):
        episode = super().episode(record, temperature, max_tokens)
        # The untrained tiny model never sorts (reward 0 everywhere, so no gradient): reward instead a number that
        # differs between any two different final answers (a position-weighted checksum of their tokens), so every
        # group has distinct rewards and a gradient. (The count of distinct tokens used before tied within a group
        # about one run in four: a zero gradient and a failed grad_norm check.)
        ids = episode.turns[-1]["generation_token_ids"]
        episode.reward = sum((i + 1) * t for i, t in enumerate(ids)) % 101 / 100
        with self.lock:
            self.episodes.append(episode)
        return episode


@pytest.fixture
def multiturn_model_dir(tiny_llama_dir, tmp_path):
    out = tmp_path / "tiny-llama-chat"
    out.mkdir()
    for f in tiny_llama_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    write_template(out)
    return out


def test_multiturn_grpo_trains_on_the_servers_tokens(multiturn_model_dir, tmp_path, monkeypatch):
    from chatgen import tasks
    from chatgen.rlhf.algorithms import grpo_multiturn
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.run import Run

    monkeypatch.chdir(REPO)
    tasks.write_task_data(str(tmp_path / "data"), n_train=32, n_eval=4)
    out = tmp_path / "run"
    overrides = {
        "runtime.algorithm.environment": f"{__name__}:RecordingEnv",
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 8,
        "policy.n": 4,
        "runtime.train_micro_batch_size": 8,
        "runtime.train_global_batch_size": 8,
        "runtime.eval_episode_interval": "null",
        "runtime.save_episode_interval": 1,
        "runtime.data_path": tmp_path / "data/train.jsonl",
        "runtime.eval_data_path": tmp_path / "data/eval.jsonl",
        "runtime.output_dir": out,
        "policy.load": multiturn_model_dir,
        "policy_trainer.load": multiturn_model_dir,
    }
    cfg = load_config(
        REPO / "configs/grpo_multiturn_tiny.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )
    trained, original_train = [], Run.train

    # what each episode trains on
    def recording_train(run, name, data, loss_fn, group_size=1, per_step=False):
        trained.append((len(RecordingEnv.episodes), {k: v.clone() for k, v in data.items()}))
        return original_train(run, name, data, loss_fn, group_size, per_step)

    monkeypatch.setattr(Run, "train", recording_train)
    RecordingEnv.requests.clear(), RecordingEnv.episodes.clear()
    grpo_multiturn.train(cfg, log=lambda *_: None)

    # Every call: a chat completion over HTTP on loopback, through the openai client; 2 turns per episode.
    assert len(RecordingEnv.episodes) == 2 * 8 and all(
        len(e.turns) == 2 for e in RecordingEnv.episodes
    )
    assert len(RecordingEnv.requests) == 2 * len(RecordingEnv.episodes)
    assert {(method, status) for method, _, status in RecordingEnv.requests} == {("POST", 200)}
    urls = {url for _, url, _ in RecordingEnv.requests}
    assert len(urls) == 1 and urls.pop().startswith("http://127.0.0.1:")

    metrics = {
        r["episode"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(metrics) == [1, 2]
    for k, (served_before, data) in enumerate(trained):
        episodes = RecordingEnv.episodes[served_before - 8 : served_before]
        # Each trained row is one episode exactly as served: its tokens, trained on exactly the generated ones.
        rows = []
        for ids, attention, loss_mask in zip(
            data["input_ids"], data["attention_mask"], data["loss_mask"]
        ):
            length = int(attention.sum())
            rows.append(
                (
                    tuple(ids[:length].tolist()),
                    tuple((loss_mask[: length - 1].nonzero().flatten() + 1).tolist()),
                )
            )
        served = []
        for e in episodes:
            (p1, g1), (p2, g2) = [
                (t["prompt_token_ids"], t["generation_token_ids"]) for t in e.turns
            ]
            # token-exact: turn 2 continues turn 1's tokens
            assert p2[: len(p1) + len(g1)] == p1 + g1
            # the template's end of turn, the calculator's answer, the question
            between = p2[len(p1) + len(g1) :]
            assert len(between) > 5
            generated = [*range(len(p1), len(p1) + len(g1)), *range(len(p2), len(p2) + len(g2))]
            served.append((tuple(p2 + g2), tuple(generated)))
        assert sorted(rows) == sorted(served)
        # The trainer's log-probs (before the update) vs the server's, on every generated token of both turns.
        worst = 0.0
        for e in episodes:
            full = e.turns[1]["prompt_token_ids"] + e.turns[1]["generation_token_ids"]
            row = next(i for i, (ids, _) in enumerate(rows) if ids == tuple(full))
            for t in e.turns:
                start = len(t["prompt_token_ids"])
                ours = data["old_logprobs"][
                    row, start - 1 : start - 1 + len(t["generation_token_ids"])
                ]
                worst = max(
                    worst, (ours - torch.tensor(t["generation_log_probs"])).abs().max().item()
                )
            # the server sampled episode k + 1 with the weights after k updates (k syncs)
            assert {v for t in e.turns for v in t["generation_weight_versions"]} == {k}
        assert worst < SYNC_TOL
        assert metrics[k + 1]["mismatch/logprob_max_abs"] < SYNC_TOL
        assert metrics[k + 1]["response/turns"] == 2 and metrics[k + 1]["policy/grad_norm"] > 0

    from chatgen.models.convert import megatron_checkpoint_to_hf

    before, after = [
        megatron_checkpoint_to_hf(out / "checkpoints" / f"episode_00000{i}" / "policy_trainer")[1]
        for i in (1, 2)
    ]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights changed
    with pytest.raises(httpx.ConnectError):  # the run took its server down with the engine
        httpx.get(RecordingEnv.requests[0][1].replace("/chat/completions", "/models"), timeout=5)
