"""NeMo RL's VllmGeneration with its workers as Ray actors (placement="ray"), as NeMo RL places them: a batch over
two actors in the caller's order, streamed rows, and the refit sequence waited on with `ray.get`, as NeMo RL's
code waits; real vLLM, Ray and the tiny Llama on CPU.

    python -m pytest tests/integration/test_nemo_rl_ray.py        # ~1 min on 2 idle CPU cores (Ray's start)
"""

import asyncio

import pytest
import torch
from helpers import completions, max_diff_vs_hf, perturbed, right_padded

from chatgen.compat.nemo_rl import VllmGeneration
from chatgen.param_sync import GroupSender

pytestmark = pytest.mark.integration
SYNC_TOL = 1e-4


def test_two_ray_workers_in_order_then_the_refit_sequence(ray_session, tiny_llama_dir):
    import ray
    from transformers import AutoModelForCausalLM

    config = {
        "backend": "vllm",
        "model_name": str(tiny_llama_dir),
        "max_new_tokens": 8,
        "temperature": 1.0,
        "pad_token_id": 0,
        "vllm_cfg": {"max_model_len": 256},
        "vllm_kwargs": {"kv_cache_memory_bytes": 64 << 20, "enforce_eager": True},
    }
    generation = VllmGeneration(config, num_workers=2, placement="ray")
    try:
        rows = [[1, 5 + i, 9, 13][: 2 + i % 3] for i in range(6)]
        out = generation.generate(right_padded(rows), greedy=True)
        served = generation.pop_metrics()
        assert served["worker/0/samples"] > 0 and served["worker/1/samples"] > 0
        # each row the engine's own answer to it
        for row, (prompt, ids, _) in zip(rows, completions(out)):
            alone = completions(generation.generate(right_padded([row]), greedy=True))[0]
            assert prompt == row and ids == alone[1]

        async def stream():
            return [r async for r, _ in generation.generate_async(right_padded(rows), greedy=True)]

        assert sorted(asyncio.run(stream())) == list(range(len(rows)))

        trainer = perturbed(
            AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32), seed=5
        )
        sender = GroupSender(generation.token, 1 + generation.inference_world_size)
        futures_inference = generation.init_collective(sender.host, sender.port, 1 + 2)
        sender.connect()
        ray.get(futures_inference)
        info = {name: (t.shape, t.dtype) for name, t in trainer.state_dict().items()}
        generation.prepare_refit_info(info)
        futures_inference = generation.update_weights_from_collective(info)
        sender.send(trainer)
        assert all(ray.get(futures_inference))
        out = generation.generate(right_padded(rows), greedy=False)
        assert max_diff_vs_hf(trainer.eval(), *zip(*completions(out))) < SYNC_TOL
        assert len(generation.report_device_id()) == 2
        sender.close()
    finally:
        assert generation.shutdown()


def test_in_process_workers_hand_out_ray_waitable_refit_handles(ray_session, tiny_llama_dir):
    """NeMo RL's code waits on refit calls with `ray.get`: with Ray up, workers in this process hand out
    ObjectRefs too; a failed refit raises through ray.get; an unawaited one still precedes the next generate."""
    import ray
    from transformers import AutoModelForCausalLM

    from chatgen.param_sync import SyncError

    config = {
        "backend": "vllm",
        "model_name": str(tiny_llama_dir),
        "max_new_tokens": 6,
        "pad_token_id": 0,
        "vllm_cfg": {"max_model_len": 256, "logprobs_mode": "raw_logprobs"},
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "enforce_eager": True},
    }
    generation = VllmGeneration(config, num_workers=2)
    try:
        trainer = perturbed(
            AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32), seed=6
        )
        refs = generation.update_weights_via_ipc_zmq()
        assert all(isinstance(ref, ray.ObjectRef) for ref in refs)
        generation.ipc_stream().send(trainer)
        out = generation.generate(right_padded([[1, 5, 9], [1, 4]]), greedy=True)  # not waited on
        assert max_diff_vs_hf(trainer.eval(), *zip(*completions(out))) < SYNC_TOL
        assert ray.get(refs) == [True, True]

        sender = GroupSender(generation.token, 1 + generation.inference_world_size)
        refs = generation.init_collective(sender.host, sender.port, 1 + 2)
        sender.connect()
        assert ray.get(refs) == [None, None]
        refs = generation.update_weights_from_collective()
        sender.token = "not the group's token"
        with pytest.raises(SyncError, match="token"):
            sender.send(trainer)
        with pytest.raises(SyncError, match="token"):
            ray.get(refs)
        sender.close()
    finally:
        assert generation.shutdown()
