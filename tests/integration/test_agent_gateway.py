"""The agent gateway (chatgen.serving.gateway) on CPU, with the real vLLM, megatron-core, uvicorn and the
official `openai` client.

    python -m pytest tests/integration/test_agent_gateway.py

- An unmodified openai-SDK agent (examples/gateway_agent.py: ask, read the reply, send a follow-up with a
  calculator's result) trains for 2 episodes of multi-turn GRPO through the gateway
  (runtime.algorithm.agent). Against what the engine generated (read at the server's engine call): every
  recorded turn is an engine generation, token for token, with its log-probs; every trained row is its
  session's last prompt + generation, trained exactly on the generated tokens; turn 1's prompt is the chat
  template's rendering of the agent's messages, and turn 2's is the template's after turn 1's exact
  tokens. Half the sessions are closed by the agent's return value, half by a harness POSTing the reward.
- Bad input, against one served engine: a chat request without a session id is a 400 naming the fix; a
  reward for an unknown session a 404 naming it; a request that does not continue its session a 409; a
  reward without the API key a 401; the server keeps serving. An agent that never closes its session is
  dropped after agent_timeout_s, its late requests refused, and the dropped episode trains on nothing and
  is counted.
"""

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.environments.calculator import write_template  # noqa: E402
from examples import gateway_agent  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "gateway-key"


def mixed_agent(base_url, api_key, task):
    """The example agent, closed by its return value for even prompts and by a harness POSTing the
    reward for odd ones (the session id is the base_url's)."""
    reward = gateway_agent.solve(base_url, api_key, task)
    if sum(map(ord, task["prompt"])) % 2 == 0:
        return reward
    root, sid = base_url.split("/sessions/")[0], base_url.split("/sessions/")[1].split("/")[0]
    r = httpx.post(
        f"{root}/sessions/{sid}/reward",
        json={"reward": reward},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert r.status_code == 200, r.text
    return None


@pytest.fixture(scope="module")
def warm_chat_model(tiny_llama_dir, tmp_path_factory):
    """The shipped warm start (it sorts, mostly the wrong way: rewards differ) with the calculator's
    plain-text chat template."""
    from helpers import shipped_warm_start

    out = tmp_path_factory.mktemp("warm-chat")
    for f in shipped_warm_start(tiny_llama_dir).iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    write_template(out)
    return out


def engine_spy(monkeypatch) -> list:
    """(prompt ids, generated ids, log-probs) of every engine call the server makes."""
    from chatgen.serving.endpoints import OpenAIServer
    from chatgen.serving.responses import sampled_logprobs

    calls, real = [], OpenAIServer.run

    async def run(self, job, stream):
        async for i, output in real(self, job, stream):
            for s in output.outputs:
                calls.append((list(job.prompts[i]), list(s.token_ids), sampled_logprobs(s)))
            yield i, output

    monkeypatch.setattr(OpenAIServer, "run", run)
    return calls


def test_an_unmodified_openai_agent_trains_through_the_gateway(
    warm_chat_model, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from chatgen import tasks
    from chatgen.environments.agent import AgentRunner
    from chatgen.rlhf.algorithms import grpo_multiturn
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.run import Run

    monkeypatch.chdir(REPO)
    tasks.write_task_data(str(tmp_path / "data"), n_train=32, n_eval=4)
    engine = engine_spy(monkeypatch)
    played, trained = [], []
    real_episode, real_train = AgentRunner.episode, Run.train

    def episode(self, record, temperature, max_tokens):
        e = real_episode(self, record, temperature, max_tokens)
        played.append((record, e))
        return e

    def train(run, name, data, loss_fn, group_size=1, per_step=False):
        trained.append({k: v.clone() for k, v in data.items()})
        return real_train(run, name, data, loss_fn, group_size, per_step)

    monkeypatch.setattr(AgentRunner, "episode", episode)
    monkeypatch.setattr(Run, "train", train)
    out = tmp_path / "run"
    overrides = {
        "runtime.algorithm.environment": "null",
        "runtime.algorithm.agent": f"{__name__}:mixed_agent",
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 16,
        "policy.n": 4,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": "null",
        "runtime.save_episode_interval": "null",
        "runtime.data_path": tmp_path / "data/train.jsonl",
        "runtime.eval_data_path": tmp_path / "data/eval.jsonl",
        "runtime.output_dir": out,
        "policy.load": warm_chat_model,
        "policy_trainer.load": warm_chat_model,
    }
    cfg = load_config(
        REPO / "configs/grpo_multiturn_tiny.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )
    metrics = grpo_multiturn.train(cfg, log=lambda *_: None)

    assert len(played) == 2 * 16 and not any(e.dropped for _, e in played)
    assert len(engine) == 2 * len(played)  # two chat requests per session, each one engine call
    tokenizer = AutoTokenizer.from_pretrained(warm_chat_model)
    eos = tokenizer.eos_token_id

    def rendered(messages):  # the chat template's rendering, as token ids
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    calls = {}  # two sessions may generate the same tokens (with log-probs of other batches)
    for p, g, lp in engine:
        calls.setdefault((tuple(p), tuple(g)), []).append(lp)
    for record, e in played:
        t1, t2 = e.turns
        for t in (t1, t2):  # recorded = generated by the engine, with its log-probs
            key = (tuple(t["prompt_token_ids"]), tuple(t["generation_token_ids"]))
            assert key in calls and t["generation_log_probs"] in calls[key]
        user = {"role": "user", "content": record["prompt"]}
        assert t1["prompt_token_ids"] == rendered([user])
        follow_up = rendered(
            [
                user,
                {"role": "assistant", "content": t1["content"]},
                {"role": "tool", "content": gateway_agent.calculator_result(record["prompt"])},
                user,
            ]
        )
        g1 = t1["generation_token_ids"]
        exact = t1["prompt_token_ids"] + (g1[:-1] if g1[-1] == eos else g1)
        assert t2["prompt_token_ids"] == exact + follow_up[follow_up.index(eos) :]
        assert e.reward == gateway_agent.score(t2["content"], record["answer"])

    # each trained row: a session's last prompt + generation, trained on exactly the generated tokens
    assert len(trained) == 2
    for k, data in enumerate(trained):
        rows = []
        for ids, attention, loss_mask in zip(
            data["input_ids"], data["attention_mask"], data["loss_mask"]
        ):
            n = int(attention.sum())
            rows.append(
                (
                    tuple(ids[:n].tolist()),
                    tuple((loss_mask[: n - 1].nonzero() + 1).flatten().tolist()),
                )
            )
        sessions = []
        for _, e in played[16 * k : 16 * (k + 1)]:
            (p1, g1), (p2, g2) = [
                (t["prompt_token_ids"], t["generation_token_ids"]) for t in e.turns
            ]
            generated = [*range(len(p1), len(p1) + len(g1)), *range(len(p2), len(p2) + len(g2))]
            sessions.append((tuple(p2 + g2), tuple(generated)))
        assert sorted(rows) == sorted(sessions)
    assert metrics["env/dropped_episodes"] == 0 and metrics["policy/grad_norm"] > 0
    assert metrics["mismatch/logprob_max_abs"] < 1e-4


@pytest.fixture(scope="module")
def gateway_server(warm_chat_model):
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.serving.embedded import EmbeddedServer

    module = VLLMModule(
        dict(
            load=str(warm_chat_model),
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            seq_length=128,
            block_size=32,
            max_new_tokens=16,
            logprobs_mode="raw",
            seed=0,
        )
    ).start()
    server = EmbeddedServer(module, api_key=KEY, model_name="policy", gateway=True)
    yield server
    server.close()
    module.shutdown()


def test_bad_input_gets_named_errors_and_the_gateway_keeps_serving(gateway_server):
    root = gateway_server.url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "sort: 3 1 2 ="}]}

    r = httpx.post(f"{root}/v1/chat/completions", json=chat, headers=auth, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert (
        "/sessions/{id}/v1" in message and "X-Session-Id" in message and "POST /sessions" in message
    )

    r = httpx.post(f"{root}/sessions/nope/reward", json={"reward": 1.0}, headers=auth)
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]

    sid = httpx.post(f"{root}/sessions", json={}, headers=auth).json()["session_id"]
    r = httpx.post(
        f"{root}/sessions/{sid}/reward", json={"reward": 1.0}
    )  # no key: it changes training
    assert r.status_code == 401
    # the header alternative; the agent's model name is ignored
    r = httpx.post(
        f"{root}/v1/chat/completions", json=chat, headers={**auth, "X-Session-Id": sid}, timeout=60
    )
    assert r.status_code == 200, r.text
    # the same request again (an SDK retrying a lost answer): answered anew, in place of that turn
    r = httpx.post(
        f"{root}/sessions/{sid}/v1/chat/completions", json=chat, headers=auth, timeout=60
    )
    assert r.status_code == 200, r.text
    retried = r.json()["choices"][0]["message"]["generation_token_ids"]
    wrong = {**chat, "messages": chat["messages"] + [{"role": "assistant", "content": "not it"}]}
    r = httpx.post(
        f"{root}/sessions/{sid}/v1/chat/completions", json=wrong, headers=auth, timeout=60
    )
    assert r.status_code == 409 and "does not continue" in r.json()["error"]["message"]
    r = httpx.post(f"{root}/sessions/{sid}/reward", json={"reward": "high"}, headers=auth)
    assert r.status_code == 400 and "reward" in r.json()["error"]["message"]
    assert (
        httpx.post(f"{root}/sessions/{sid}/reward", json={"reward": 0.5}, headers=auth).status_code
        == 200
    )
    state = httpx.get(f"{root}/sessions/{sid}", headers=auth).json()
    assert state["status"] == "closed" and state["reward"] == 0.5 and len(state["turns"]) == 1
    assert state["turns"][0]["generation_token_ids"] == retried
    assert httpx.get(f"{root}/health", headers=auth).status_code == 200  # still serving


LATE = {}


def stuck_agent(base_url, api_key, task):
    """Asks once, then outlives its session's timeout; its late request is refused."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["prompt"]}]
    )
    time.sleep(3)
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    except openai.APIStatusError as e:
        LATE["status"], LATE["message"] = e.status_code, str(e)
    return 1.0


def test_a_session_never_closed_is_dropped_and_counted(gateway_server):
    from chatgen.environments.agent import AgentRunner
    from chatgen.rlhf.algorithms.grpo_multiturn import episodes_batch

    late = LATE
    runner = AgentRunner(f"{__name__}:stuck_agent", gateway_server.url, KEY, timeout_s=1.0)
    record = {"prompt": "sort: 3 1 2 =", "answer": " 1 2 3"}
    dropped = runner.episode(record, temperature=1.0, max_tokens=8)
    assert dropped.dropped and dropped.turns == []
    deadline = time.time() + 30
    while "status" not in late and time.time() < deadline:
        time.sleep(0.1)
    assert late["status"] == 409 and "dropped" in late["message"]

    runner = AgentRunner("examples.gateway_agent:solve", gateway_server.url, KEY, timeout_s=120)
    played = [runner.episode(record, 1.0, 8) for _ in range(3)]
    batch, rewards, metrics = episodes_batch(played + [dropped], [record], 4, "agent")
    assert metrics["env/dropped_episodes"] == 1.0
    assert batch.loss_mask[3].sum() == 0  # the dropped row trains on nothing
    assert batch.loss_mask[:3].sum(dim=1).min() > 0
    assert torch.isclose(rewards[3], rewards[:3].mean())  # no signal of its own
