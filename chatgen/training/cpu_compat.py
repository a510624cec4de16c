"""Run megatron-core 0.16 on a CPU-only machine (gloo): every patch chatgen needs, in one place.

Megatron-core is written for CUDA. On a machine without a GPU (CI, laptops) `apply()` patches, once
per process and only when CUDA is absent:

1. `torch.cuda.current_device()` answers "cpu": megatron allocates gather buffers, RoPE frequencies,
   pipeline receive buffers and its DDP's contiguous param / grad buffers with
   `device=torch.cuda.current_device()`.
2. `torch.cuda.synchronize()` is a no-op: pipeline p2p calls it after `batch_isend_irecv`.
3. While a model is built (`building_model()`), `Tensor.cuda()` returns the tensor itself: with tied
   embeddings and PP > 1, megatron moves the last stage's embedding copy with `.cuda()` before the
   all-reduce that makes it equal to the first stage's.
4. Tensors megatron allocates with a hard-coded `device="cuda"` (the pipeline schedules' token
   counter; the optimizer's found-inf / overflow flags; clip_grads' and megatron.core.utils'
   grad-norm results): those modules see a `torch` whose tensor factories put "cuda" on the CPU
   (every other name is torch's).
5. The RNG tracker: megatron's `CudaRNGStatesTracker` stores CUDA generator states; on CPU chatgen
   installs the inference tracker, whose `fork()` is a no-op (dropout draws from torch's CPU
   generator).
6. While megatron's optimizer is built or steps (`cuda_type_names()`), `Tensor.type()` names a CPU
   tensor by its CUDA type ("torch.cuda.FloatTensor"): the distributed optimizer sorts parameters
   into fp32 and 16-bit groups, and clip_grads asserts fp32 grads, by those strings.

gloo itself needs no patch any more: torch 2.13's gloo has reduce-scatter (megatron's DDP
reduce-scatters grads for the distributed optimizer; its attention all-gather's backward when
`num_query_groups < TP`), all-gather into a tensor, AVG and coalesced collectives. What
megatron-core offers but chatgen cannot use on gloo is listed in docs/megatron_module.md.

8. Activation recompute (`activation_recompute`): megatron's checkpoint function saves and restores
   the CUDA RNG state around a layer's recomputation (`tensor_parallel.random._get_cuda_rng_state` /
   `_set_cuda_rng_state`); on CPU there is none (the CPU generator's state is saved beside it): they
   get / set nothing.

And on any machine without Transformer Engine (CPU or GPU):

7. megatron-core 0.16.1's MoE router GEMM (`moe_utils.RouterGatingLinearFunction`) tests
   `te_general_gemm is not None`, a name bound only when Transformer Engine imports: it is set to
   None so the router uses torch.mm.

Two more rules that are not patches, followed by `MegatronModule`: models are built with
`use_cpu_initialization=True` and the local layer spec (no Transformer Engine), and the forward
always receives an explicit causal `attention_mask` (megatron builds a CUDA tensor when it is None).
`tests/integration/test_megatron_module.py` fails loudly when an upgrade breaks one of these.
"""

import contextlib
import importlib

import torch

_APPLIED = False


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)

    return staticmethod(make)


class _TorchOnCpu:
    """`torch`, except that its tensor factories allocate device="cuda" tensors on the CPU (point
    4)."""

    tensor, zeros, ones, empty, full = (
        _on_cpu(torch.tensor),
        _on_cpu(torch.zeros),
        _on_cpu(torch.ones),
        _on_cpu(torch.empty),
        _on_cpu(torch.full),
    )

    def __getattr__(self, name):
        return getattr(torch, name)


# the megatron-core modules that allocate on "cuda" by name (point 4)
_CUDA_BY_NAME = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)


def apply() -> bool:
    """Patch torch / megatron-core for CPU if CUDA is absent; returns True when patches are
    active."""
    global _APPLIED
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # point 7
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core.tensor_parallel import random as tp_random  # point 8

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    for module in _CUDA_BY_NAME:
        importlib.import_module(module).torch = _TorchOnCpu()
    _APPLIED = True
    return True


def initialize_rng(seed: int) -> None:
    """Seed torch and set up megatron's RNG tracker (a CPU-safe one when CUDA is absent)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextlib.contextmanager
def building_model():
    """Within this block `Tensor.cuda()` is the identity when CUDA is absent (see point 3 above)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and self.device.type == "cpu":
        return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


_TENSOR_TYPE = torch.Tensor.type


@contextlib.contextmanager
def cuda_type_names():
    """Within this block `Tensor.type()` names a CPU tensor by its CUDA type when CUDA is absent
    (point 6)."""
    if torch.cuda.is_available():
        yield
        return
    torch.Tensor.type = _cuda_type_name
    try:
        yield
    finally:
        torch.Tensor.type = _TENSOR_TYPE
