"""Multi-turn episodes over two engines: the policy's two replicas (Ray actors apart, one server each) serve
one batch of sessions, each session pinned to one engine, and the sessions come out token for token as one
engine plays them (sampling seeded per request).

    python -m pytest tests/integration/test_multiturn_replicas.py   # ~1 min on 2 idle CPU cores
"""

import os
import threading

import openai
import pytest

from chatgen.environments.base import Episode

pytestmark = pytest.mark.integration

TURNS = 3


class SeededChat:
    """Three model turns with a tool turn between, every request seeded by (prompt, turn); records which
    server (engine) answered each turn of each session."""

    turns_by_session, lock = {}, threading.Lock()

    def __init__(self, base_url, api_key, model):
        self.client, self.model, self.url = (
            openai.OpenAI(base_url=base_url, api_key=api_key),
            model,
            base_url,
        )

    def episode(self, record, temperature, max_tokens):
        messages, turns = [{"role": "user", "content": record["prompt"]}], []
        for turn in range(TURNS):
            r = self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=sum(map(ord, record["prompt"])) * 10 + turn,
            )
            with self.lock:
                self.turns_by_session.setdefault(record["prompt"], []).append(self.url)
            message = r.choices[0].message.model_dump(exclude_none=True)
            turns.append(message)
            messages += [message, {"role": "tool", "content": " 1 2 3"}]
        return Episode(turns=turns, reward=0.0)


def _steps_run(worker, name):
    return worker.models[name].engine_loop.steps_run


def _cores(worker):
    return sorted(os.sched_getaffinity(0))


def test_two_replicas_serve_pinned_sessions_like_one(
    ray_session, tiny_llama_dir, data_dir, tmp_path
):
    from helpers import chat_model, served_replicas

    from chatgen.core.jsonl import read_prompt_records
    from chatgen.rlhf.algorithms.grpo_multiturn import episode_sample, run_episodes

    model = chat_model(tiny_llama_dir, tmp_path / "tiny-llama-chat")
    overrides = [f"runtime.data_path={data_dir}/train.jsonl"]
    with served_replicas(model, 2, "key", overrides, log=lambda *_: None) as (rt, urls):
        assert len(set(urls)) == 2  # one server per engine
        envs = [SeededChat(url, "key", "policy") for url in urls]
        records = read_prompt_records(data_dir / "train.jsonl")[:8]
        two = run_episodes(envs, records, 1, 1.0, 8)
        both = dict(SeededChat.turns_by_session)
        SeededChat.turns_by_session.clear()
        one = run_episodes(envs[:1], records, 1, 1.0, 8)
        assert all(
            steps > 0 for steps in rt["policy"].run(_steps_run, "policy")
        )  # both engines worked
        cores = rt["policy"].run(_cores)
    if len(os.sched_getaffinity(0)) >= 2:  # a core of its own for each engine
        assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores
    # every session's turns went to one engine; the batch used both
    assert all(len(turns) == TURNS and len(set(turns)) == 1 for turns in both.values())
    assert {turns[0] for turns in both.values()} == set(urls)
    # the same sessions, token for token, as one engine plays them
    for a, b in zip(two, one):
        sa, sb = episode_sample(a), episode_sample(b)
        assert sa.prompt_ids == sb.prompt_ids and sa.response_ids == sb.response_ids
        assert sa.response_mask == sb.response_mask
