"""chatgen's shortcuts through vLLM's per-step work give vLLM's own results (adapter/patches.py).

    .venv/bin/python -m pytest tests/integration/test_vllm_fast_paths.py

`decode_slots_fast_path`: a running request whose KV blocks already hold the step's tokens skips vLLM's
allocate_slots. The same prompts generate the same tokens and log-probs with and without it, across KV
block boundaries and with prompts sharing cached prefix blocks, and it is taken for most steps.
A batch of prompts gets internal request ids of vLLM's form (split_step._submit draws their suffix).
"""

import re

import pytest

pytestmark = pytest.mark.integration

from chatgen.generation.vllm.adapter.split_step import engine_core  # noqa: E402
from chatgen.generation.vllm.module import VLLMModule  # noqa: E402

# two prompts over one 32-token block share it in the prefix cache; 40 new tokens cross blocks
PROMPTS = ["one two three " * 12 + "four", "one two three " * 12 + "five", "hello", "Once upon a"]


@pytest.fixture(scope="module")
def module(tiny_llama_dir):
    m = VLLMModule(
        dict(
            load=str(tiny_llama_dir),
            kv_cache_memory_bytes=64 << 20,
            block_size=32,
            enforce_eager=True,
            seq_length=128,
            new_token_limit=True,
            max_new_tokens=40,
            logprobs_mode="raw",
            ignore_eos=True,
            seed=0,
        )
    ).start()
    yield m
    m.shutdown()


def generated(module) -> list:
    module.reset_prefix_cache()
    outputs = module.finished(module.build_dataset(PROMPTS), greedy=True)
    return [
        (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs.token_logprobs)) for o in outputs
    ]


def test_fast_path_generates_what_vllms_path_does(module, monkeypatch):
    scheduler = engine_core(module.engine).scheduler
    manager = scheduler.kv_cache_manager
    assert "allocate_slots" in vars(manager)  # installed by the engine's build
    # vLLM's schedule, which asks allocate_slots for every running request (fast_step's skips it)
    monkeypatch.delitem(vars(scheduler), "schedule")
    slow_calls = []
    coordinator = manager.coordinator
    counted = coordinator.get_num_blocks_to_allocate  # vLLM's path asks it once per call

    def counting(*args, **kwargs):
        slow_calls.append(1)
        return counted(*args, **kwargs)

    monkeypatch.setattr(coordinator, "get_num_blocks_to_allocate", counting)
    fast = generated(module)
    steps_fast = len(slow_calls)
    monkeypatch.delitem(vars(manager), "allocate_slots")  # vLLM's own method again
    slow_calls.clear()
    slow = generated(module)
    assert fast == slow
    assert all(len(tokens) == 40 for tokens, _ in fast)
    # vLLM's path: every request at every step; the fast path's fall-throughs: prefill and new blocks
    assert len(slow_calls) >= 4 * 40 and steps_fast < len(slow_calls) / 4, (steps_fast, slow_calls)


def test_a_call_gets_each_finished_request_once_in_order(module, monkeypatch):
    """The engine loop hands a call each step's finished outputs as one list: every request still
    reaches `on_finished` once and the call returns them all, sorted by request id."""
    seen = []
    monkeypatch.setattr(module, "on_finished", seen.append)
    items = module.build_dataset(PROMPTS * 3)
    first = [o.outputs[0].token_ids for o in module.finished(items[:4], greedy=True)]
    for i, item in enumerate(items[4:]):  # stopping at their 1st or 5th token: different steps
        item["stop_token_ids"] = [first[i % 4][0 if i < 4 else 4]]
    seen.clear()
    outputs = module.finished(items, greedy=True)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths[:4] == [40] * 4 and max(lengths[4:8]) == 1 and max(lengths[8:]) <= 5
    ids = [int(o.request_id) for o in outputs]
    assert ids == sorted(ids) and len(ids) == 12
    assert sorted(int(o.request_id) for o in seen) == ids and all(o.finished for o in seen)


def test_a_batch_gets_internal_ids_of_vllms_form(module, monkeypatch):
    """Every request added through the batched path gets the id "<request id>-<8 hex digits>"
    (vLLM's `assign_request_id`), distinct within the call, with its own id kept as external."""
    client = module.engine.llm_engine.engine_core
    added = []

    def recording(request):
        added.append((request.request_id, request.external_req_id))
        return vllm_add(request)

    vllm_add = client.add_request
    monkeypatch.setattr(client, "add_request", recording)
    outputs = module.finished(module.build_dataset(PROMPTS * 8), greedy=True)
    assert len(added) == len(outputs) == 32
    assert sorted(external for _, external in added) == sorted(o.request_id for o in outputs)
    assert all(re.fullmatch(re.escape(e) + "-[0-9a-f]{8}", i) for i, e in added), added
    assert len({i for i, _ in added}) == 32
