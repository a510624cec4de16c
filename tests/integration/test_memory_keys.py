"""The trainer's memory-at-scale keys on CPU: `activation_recompute`, `sequence_parallel`, `grad_reduce_dtype`.

    .venv/bin/python -m pytest tests/integration/test_memory_keys.py

Recompute and sequence parallelism change where activations live, not the math: the losses of two optimizer steps
(the second one after an update, so the gradients matched too) equal the plain run's within 1e-6 relative, and
the peak of activation memory held for the backward is lower. That peak is measured with autograd's saved-tensor
hooks (live bytes of the distinct storages saved for backward, weights excluded; a storage is released when
autograd drops it), which is what the keys act on; the process's RSS on CPU is dominated by the allocator.
"""

import weakref

import pytest
import torch

pytestmark = pytest.mark.integration

REL = 1e-6  # recompute runs the same kernels on the same inputs: CPU gives the same bits; the margin is for GPUs


def nll(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


class SavedActivationPeak:
    """Peak bytes of the tensors autograd holds for the backward (distinct storages, the model's weights left out)."""

    def __init__(self, model):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.now, self.peak = {}, 0, 0

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[ptr]

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.weights:
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += self.live[ptr][0]
            self.peak = max(self.peak, self.now)
        self.live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def two_steps(model_dir, **keys):
    """(loss of step 1, its grad norm, loss of step 2, activation peak of step 1 in bytes) on this rank."""
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    module = MegatronModule(dict(load=str(model_dir), lr=1e-3, **keys)).start()
    ids = torch.randint(0, 500, (4, 256), generator=torch.Generator().manual_seed(0))
    with SavedActivationPeak(module.model) as saved:
        first = module.train_step({"input_ids": ids}, nll)
    second = module.train_step({"input_ids": ids}, nll)
    return first["loss"], first["grad_norm"], second["loss"], saved.peak


def test_activation_recompute_same_loss_less_activation_memory(tiny_llama_dir):
    """Measured (tiny Llama, 4 x 256 tokens, fp32): none 35.6 MiB, selective 28.1 MiB, full 16.6 MiB."""
    plain, selective, full = (
        two_steps(tiny_llama_dir, activation_recompute=m) for m in ("none", "selective", "full")
    )
    for run in (selective, full):
        assert run[:3] == pytest.approx(plain[:3], rel=REL), (run, plain)
    assert full[3] < selective[3] < plain[3], (plain[3], selective[3], full[3])
    assert full[3] < 0.6 * plain[3]  # only each layer's input is kept


def test_recompute_num_layers_recomputes_only_that_many_layers(tiny_llama_dir):
    """activation_recompute: full with recompute_num_layers: 1 of the tiny Llama's 2 layers: the
    same losses, an activation peak between none's and full's."""
    plain, full = (two_steps(tiny_llama_dir, activation_recompute=m) for m in ("none", "full"))
    half = two_steps(tiny_llama_dir, activation_recompute="full", recompute_num_layers=1)
    assert half[:3] == pytest.approx(plain[:3], rel=REL), (half, plain)
    assert full[3] < half[3] < plain[3], (plain[3], half[3], full[3])


def _tp2_without_and_with_sequence_parallel(model_dir):
    """Rank body: two_steps at TP 2 without, then with sequence parallelism, in the same two ranks
    (one job: each start of ranks is seconds of imports; two_steps starts each model afresh)."""
    return [
        two_steps(model_dir, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        for sequence_parallel in (False, True)
    ]


def test_sequence_parallel_same_loss_less_activation_memory(tiny_llama_dir):
    """TP 2 on gloo with and without sequence parallelism (the norms' activations split over the two ranks).
    Measured per rank: 21.7 MiB without, 18.0 MiB with."""
    from chatgen.training.launcher import run_distributed

    for a, b in run_distributed(_tp2_without_and_with_sequence_parallel, 2, args=(tiny_llama_dir,)):
        assert b[:3] == pytest.approx(a[:3], rel=REL), (a, b)
        assert b[3] < a[3], (a[3], b[3])


def test_grad_reduce_dtype_sets_the_gradient_buffers_dtype(tiny_llama_dir):
    """bf16 weights: gradient buffers fp32 by default, bf16 with grad_reduce_dtype=bfloat16 (half the memory)."""
    from chatgen.training.megatron_module import MegatronModule

    for key, dtype in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        module = MegatronModule(
            dict(load=str(tiny_llama_dir), dtype="bfloat16", grad_reduce_dtype=key)
        ).start()
        bf16_buffers = [b for b in module.ddp.buffers if b.param_dtype == torch.bfloat16]
        assert bf16_buffers and all(b.grad_dtype == dtype for b in bf16_buffers), key
        loss = module.train_step({"input_ids": torch.randint(0, 500, (2, 32))}, nll)["loss"]
        assert (
            loss == loss
            and module.train_step({"input_ids": torch.randint(0, 500, (2, 32))}, nll)["grad_norm"]
            > 0
        )
        module.shutdown()
