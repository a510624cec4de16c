"""The trainer's memory handoff on CPU, as far as its logic goes without a GPU (chatgen/training/memory.py): the
optimizer's state moves to host copies and back while views of the weights stay shared with them, Adam's step
counters stay put, and the expert-parallel weight buffers are among the ones moved.

    .venv/bin/python -m pytest tests/integration/test_offload_state.py

On a GPU the same functions run with pinned host memory (tests/gpu: test_trainer_offload_and_onload_round_trip).
"""

import pytest
import torch

pytestmark = pytest.mark.integration


def nll(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


def start(model_dir, **kw):
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return MegatronModule(dict(load=str(model_dir), **kw)).start()


def test_optimizer_state_round_trip_keeps_fp32_weights_shared(tiny_llama_dir):
    """bf16 model (its RMSNorm weights fp32): after moving the optimizer out and back, an optimizer step still
    updates the model's fp32 weights (megatron's own offload_to_cpu copies their masters apart)."""
    from chatgen.training.memory import move_optimizer_state, weight_storages

    module = start(tiny_llama_dir, dtype="bfloat16", lr=1e-2, clip_grad=0.0)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    module.train_step({"input_ids": ids}, nll)
    inner = [chained.optimizer for chained in module.optimizer.chained_optimizers]
    shared = weight_storages(module.ddp)
    params = [p for opt in inner for g in opt.param_groups for p in g["params"]]
    views = [p for p in params if p.untyped_storage().data_ptr() in shared]
    # the fp32 norms' masters are views; the bf16 weights' are not
    assert views and len(views) < len(params)
    states = [opt.state[p] for opt in inner for g in opt.param_groups for p in g["params"]]
    steps = [s["step"] for s in states if "step" in s]
    before = [s["exp_avg"].clone() for s in states]
    host = {}
    move_optimizer_state(inner, host, True, shared, "cpu", pin=False)
    assert all(p.untyped_storage().data_ptr() in shared for p in views)
    moved = [s["exp_avg"] for s in states]
    assert all(torch.equal(a, b) for a, b in zip(moved, before))
    assert all(
        m.untyped_storage().data_ptr() == host[k].untyped_storage().data_ptr()
        for m, k in zip(moved, [k for k in host if len(k) == 4 and k[3] == "exp_avg"])
    )
    assert [s["step"] for s in states if "step" in s] == steps and all(
        a is b for a, b in zip([s["step"] for s in states if "step" in s], steps)
    )
    move_optimizer_state(inner, host, False, shared, "cpu", pin=False)
    norms = {n: p for n, p in module.model.named_parameters() if p.dtype == torch.float32}
    assert norms
    start_values = {n: p.detach().clone() for n, p in norms.items()}
    module.train_step({"input_ids": ids}, nll)
    changed = [n for n, p in norms.items() if not torch.equal(p, start_values[n])]
    assert len(changed) == len(norms), sorted(set(norms) - set(changed))


def _expert_buffers(model_dir):
    from chatgen.training.memory import _all_buffers, weight_storages

    module = start(model_dir, expert_model_parallel_size=2)
    shared = weight_storages(module.ddp)
    experts = [p for n, p in module.model.named_parameters() if ".experts." in n]
    return (
        len(module.ddp.expert_parallel_buffers),
        len(_all_buffers(module.ddp)) - len(module.ddp.buffers),
        len(experts),
        all(p.untyped_storage().data_ptr() in shared for p in experts),
    )


def test_expert_parallel_buffers_are_weight_buffers(make_tiny):
    """A mixture-of-experts model under EP 2 keeps its experts in DDP's expert-parallel buffers (not `buffers`):
    offload and onload move those too."""
    from chatgen.training.launcher import run_distributed

    for ep_buffers, extra, experts, all_shared in run_distributed(
        _expert_buffers, 2, args=(make_tiny("tiny_qwen3_moe"),)
    ):
        assert ep_buffers > 0 and extra == ep_buffers and experts > 0 and all_shared
