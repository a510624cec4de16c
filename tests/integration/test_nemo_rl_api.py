"""NeMo RL's generation API (seeds 000-002) on chatgen, with the real vLLM on CPU and the tiny Llama: seed 000's
example over two workers, the refit sequence by collective and by IPC, every call by its seed name.

    python -m pytest tests/integration/test_nemo_rl_api.py        # ~30 s on 2 idle CPU cores
"""

import asyncio
import threading

import pytest
import torch
from helpers import completions, max_diff_vs_hf, perturbed, right_padded

# NeMo RL: nemo_rl.models...vllm
from chatgen.compat.nemo_rl import (
    VllmGeneration,
    VllmGenerationWorker,
)
from chatgen.param_sync import GroupSender, ShmSender, SyncError

pytestmark = pytest.mark.integration
SYNC_TOL = 1e-4  # fp32: vLLM vs transformers log-probs of the same weights differ by ~1e-6


def seed_000_config(model_dir):
    """Seed 000's VllmConfig; the model, its length (the tiny model has 512 positions), the pad id its input_data
    uses, and the CPU's KV-cache size changed."""
    return dict(
        backend="vllm",
        max_new_tokens=128,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        model_name=str(model_dir),
        stop_token_ids=[2],  # EOS token
        pad_token_id=0,
        vllm_cfg={"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_model_len": 512},
        vllm_kwargs={
            "kv_cache_memory_bytes": 64 << 20,
            "enforce_eager": True,
            "logprobs_mode": "raw",
        },
    )


@pytest.fixture(scope="module")
def generation(tiny_llama_dir):
    generation = VllmGeneration(seed_000_config(tiny_llama_dir), num_workers=2)
    yield generation
    assert generation.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def test_seed_000_example_over_two_workers_in_the_callers_order(generation):
    from chatgen.generation.batching import verify_right_padding

    # Seed 000's example, as it is
    input_data = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]),  # Right-padded sequence
        "input_lengths": torch.tensor([3, 5]),  # Actual lengths
    }
    output_data = generation.generate(input_data, greedy=False)
    generated_text = output_data["output_ids"]
    logprobs = output_data["logprobs"]
    assert generated_text.shape == logprobs.shape and generated_text.shape[0] == 2
    assert generated_text[1, :5].tolist() == [1, 2, 3, 4, 5] and generated_text[0, :3].tolist() == [
        1,
        2,
        3,
    ]
    assert verify_right_padding(input_data, pad_value=0)[0]
    generation.pop_metrics()

    # a larger batch: every row where the caller put it, each the same as one engine alone gives it
    rows = [[1, 2 + i, 7, 9][: 2 + i % 3] + [11 + i] for i in range(7)]
    out = generation.generate(right_padded(rows), greedy=True)
    served = generation.pop_metrics()
    assert served["worker/0/samples"] > 0 and served["worker/1/samples"] > 0
    assert served["worker/0/samples"] + served["worker/1/samples"] == len(rows)
    alone = generation.workers[0].generate(right_padded(rows), greedy=True)
    for (p, c, lp), (p1, c1, lp1), row in zip(completions(out), completions(alone), rows):
        assert p == p1 == row and c == c1 and lp == pytest.approx(lp1, abs=1e-5)

    async def stream():
        return [item async for item in generation.generate_async(right_padded(rows), greedy=True)]

    streamed = asyncio.run(stream())
    assert sorted(row for row, _ in streamed) == list(range(len(rows)))
    for row, one in streamed:
        assert completions(one)[0][:2] == completions(out)[row][:2]


def test_text_calls_and_the_lifecycle(generation):
    prompts = ["Once upon a time", "The cat", "hello", "sort: 3 1 2 ="]
    texts = generation.generate_text({"prompts": prompts}, greedy=True)["texts"]
    assert len(texts) == 4 and texts == generation.workers[1].generate_text(prompts, greedy=True)

    async def stream():
        return [item async for item in generation.generate_text_async(prompts, greedy=True)]

    assert sorted(asyncio.run(stream())) == sorted(enumerate(texts))
    assert generation.finish_generation() and all(w.is_sleeping() for w in generation.workers)
    with pytest.raises(RuntimeError, match="asleep"):
        generation.generate_text(prompts)
    assert generation.prepare_for_generation() and not any(
        w.is_sleeping() for w in generation.workers
    )
    assert len(generation.report_device_id()) == 2


def test_refit_by_collective_with_the_seeds_world_size(generation, hf_model):
    """NeMo RL's sequence: init_collective -> prepare_refit_info -> update_weights_from_collective(info) ->
    generate; the engines' log-probs then equal the trainer's."""
    trainer = perturbed(hf_model, seed=1)
    train_world_size = 1
    world_size = train_world_size + generation.inference_world_size  # the seed's count: 1 + 2
    # the trainer hosts it
    sender = GroupSender(generation.token, 1 + generation.inference_world_size)
    futures_inference = generation.init_collective(sender.host, sender.port, world_size)
    sender.connect()
    assert all(f.result(timeout=120) is None for f in futures_inference)

    info = {name: (t.shape, t.dtype) for name, t in trainer.state_dict().items()}
    generation.prepare_refit_info(info)
    futures_inference = generation.update_weights_from_collective(info)
    sender.send(trainer)
    assert all(f.result(timeout=120) for f in futures_inference)

    rows = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6]]
    out = generation.generate(right_padded(rows), greedy=False)
    prompts, ids, logprobs = zip(*completions(out))
    assert max_diff_vs_hf(trainer, prompts, ids, logprobs) < SYNC_TOL

    # a sender without the group's token: refused on both ends before a byte is written
    versions = [w.weight_version for w in generation.workers]
    futures_inference = generation.update_weights_from_collective()
    sender.token = "not the group's token"
    with pytest.raises(SyncError, match="token"):
        sender.send(perturbed(hf_model, seed=7))
    for future in futures_inference:
        with pytest.raises(SyncError, match="token"):
            future.result(timeout=120)
    assert [w.weight_version for w in generation.workers] == versions

    bad = {**info, "lm_head.weight": (torch.Size([3, 3]), torch.float32)}
    with pytest.raises(SyncError, match="lm_head.weight"):
        generation.prepare_refit_info(bad)
    with pytest.raises(ValueError, match="training ranks"):
        generation.init_collective(sender.host, sender.port, 2)  # fewer than the inference world
    sender.close()


def test_refit_by_ipc_zmq_and_ipc_handles_are_signed(generation, hf_model):
    trainer = perturbed(hf_model, seed=2)
    futures = generation.update_weights_via_ipc_zmq()  # every worker waits for the trainer's write
    generation.ipc_stream().send(trainer)  # NeMo RL: policy.stream_weights_via_ipc_zmq()
    assert all(f.result(timeout=120) for f in futures)
    out = generation.generate(right_padded([[1, 5, 9], [1, 4]]), greedy=False)
    prompts, ids, logprobs = zip(*completions(out))
    assert max_diff_vs_hf(trainer, prompts, ids, logprobs) < SYNC_TOL

    versions = [w.weight_version for w in generation.workers]
    stranger = ShmSender.owned("not the group's token")
    try:
        handles = stranger.write(perturbed(hf_model, seed=3))
        with pytest.raises(SyncError, match="token"):
            generation.update_weights_from_ipc_handles(handles)
        # refused before any write
        assert [w.weight_version for w in generation.workers] == versions
    finally:
        stranger.close()
    handles = ShmSender.owned(generation.token).write(trainer)
    assert generation.update_weights(handles)  # the seed's group spelling
    assert [w.weight_version for w in generation.workers] == [v + 1 for v in versions]


def test_a_broadcast_refit_issued_while_both_workers_generate(generation, hf_model):
    """The update waits for the generate calls in flight (engines of one process never load beside a step, and
    a broadcast half the workers load while the others still generate would wait forever); the next generate
    runs on the new weights."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    trainer = perturbed(hf_model, seed=8)
    sender = GroupSender(generation.token, 1 + generation.inference_world_size)
    futures = generation.init_collective(
        sender.host, sender.port, 1 + generation.inference_world_size
    )
    sender.connect()
    assert all(f.result(timeout=120) is None for f in futures)
    rows = [[1, 5, 9, 13], [1, 7], [1, 2, 3]]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generation.generate, right_padded(rows), False)
        while not generation._in_flight[False]:  # the workers' calls in flight
            time.sleep(0.005)
        futures = generation.update_weights_from_collective()
        sender.send(trainer)
        assert all(f.result(timeout=120) for f in futures)
        assert len(running.result(timeout=120)["output_ids"]) == 3
    out = generation.generate(right_padded(rows), greedy=False)
    assert max_diff_vs_hf(trainer, *zip(*completions(out))) < SYNC_TOL
    sender.close()


def test_one_worker_by_the_seeds_calls(tiny_llama_dir, hf_model):
    """Seed 002's VllmGenerationWorker: init_collective(rank_prefix, ip, port, world_size) with a training world
    of 2 ranks (the seed's count), update_weights_from_collective(info), report_device_id, shutdown."""
    trainer = perturbed(hf_model, seed=4)
    worker = VllmGenerationWorker(seed_000_config(tiny_llama_dir), seed=0)
    try:
        sender = GroupSender(worker.token, 2)
        joined = threading.Thread(target=sender.connect)
        joined.start()
        worker.init_collective(2, sender.host, sender.port, 3, train_world_size=2)
        joined.join()
        info = {name: (t.shape, t.dtype) for name, t in trainer.state_dict().items()}
        sent = threading.Thread(target=sender.send, args=(trainer,))
        sent.start()
        assert worker.update_weights_from_collective(info)
        sent.join()
        out = worker.generate(right_padded([[1, 8, 8, 2 + 1]]), greedy=True)
        assert max_diff_vs_hf(trainer, *zip(*completions(out))) < SYNC_TOL
        assert worker.report_device_id()[0].startswith(("cpu@", "GPU-")) and worker.is_alive()
        sender.close()

        async def the_async_twins():  # seed 002's `_async` calls, on an event loop as NeMo RL's async engine
            assert await worker.report_device_id_async() == worker.report_device_id()
            assert await worker.reset_prefix_cache_async()
            await worker.sleep_async()
            assert worker.is_sleeping()
            await worker.wake_up_async()
            assert not worker.is_sleeping()
            # (perturbed in place: the trainer)
            handles = ShmSender.owned(worker.token).write(hf_model)
            return await worker.update_weights_from_ipc_handles_async(handles)

        version = worker.weight_version
        assert asyncio.run(the_async_twins()) and worker.weight_version == version + 1
        out = worker.generate(right_padded([[1, 8, 8, 3]]), greedy=True)
        assert max_diff_vs_hf(hf_model, *zip(*completions(out))) < SYNC_TOL
        assert worker.llm() is worker.engine
        worker.start_gpu_profiling()
        worker.stop_gpu_profiling()
    finally:
        assert worker.shutdown()


def test_n_samples_per_prompt_come_prompt_major_over_the_workers(tiny_llama_dir):
    """NeMo RL keeps n = 1 (it repeats prompts); with chatgen's `n` key, sample j of row i is row i * n + j."""
    config = seed_000_config(tiny_llama_dir)
    config["vllm_kwargs"] = {**config["vllm_kwargs"], "n": 3}
    config["max_new_tokens"] = 6
    generation = VllmGeneration(config, num_workers=2)
    try:
        rows = [[1, 4 + i, 9][: 2 + i % 2] for i in range(5)]
        out = generation.generate(right_padded(rows), greedy=False)
        assert generation.pop_metrics()["worker/1/samples"] > 0
        assert [p for p, _, _ in completions(out)] == [row for row in rows for _ in range(3)]
        texts = generation.generate_text(["a b", "c d e"], greedy=False)
        assert len(texts) == 6
        assert len(generation.generate(right_padded(rows), greedy=True)["output_ids"]) == 5
    finally:
        generation.shutdown()
