"""Run megatron-core 0.16 on a CPU-only machine (gloo): every patch chatgen needs, in one place.

Megatron-core is written for CUDA. On a machine without a GPU (CI, laptops) `apply()` patches, once per
process and only when CUDA is absent:

1. `torch.cuda.current_device()` answers "cpu": megatron allocates gather buffers, RoPE frequencies and
   pipeline receive buffers with `device=torch.cuda.current_device()`.
2. `torch.cuda.synchronize()` is a no-op: pipeline p2p calls it after `batch_isend_irecv`.
3. gloo has no reduce-scatter: `reduce_scatter_tensor` / `_reduce_scatter_base` are emulated with
   all-reduce + slice. Megatron needs it in the backward of the all-gather that attention uses when
   `num_query_groups < TP`.
4. While a model is built (`building_model()`), `Tensor.cuda()` returns the tensor itself: with tied
   embeddings and PP > 1, megatron moves the last stage's embedding copy with `.cuda()` before the
   all-reduce that makes it equal to the first stage's.
5. megatron's pipeline schedules allocate their token counter with `device="cuda"` (hard-coded): the
   schedules module sees a `torch` whose `zeros` maps "cuda" to "cpu" (every other name is torch's).
6. The RNG tracker: megatron's `CudaRNGStatesTracker` stores CUDA generator states; on CPU chatgen installs
   the inference tracker, whose `fork()` is a no-op (dropout draws from torch's CPU generator).

And on any machine without Transformer Engine (CPU or GPU):

7. megatron-core 0.16.1's MoE router GEMM (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
   None`, a name bound only when Transformer Engine imports: it is set to None so the router uses torch.mm.

Two more rules that are not patches, followed by `MegatronModule`: models are built with
`use_cpu_initialization=True` and the local layer spec (no Transformer Engine), and the forward always
receives an explicit causal `attention_mask` (megatron builds a CUDA tensor when it is None).
`tests/integration/test_megatron_module.py` fails loudly when an upgrade breaks one of these.
"""
import contextlib

import torch
import torch.distributed as dist

_APPLIED = False


class _TorchWithCpuZeros:
    """`torch`, except that zeros(..., device="cuda") allocates on the CPU (for megatron's schedules)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _reduce_scatter_via_all_reduce(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    # input: (world * n, ...) -> output: (n, ...) = this rank's slice of the sum over ranks.
    summed = input.clone()
    dist.all_reduce(summed, op=op, group=group)
    rank = dist.get_rank(group)
    output.copy_(summed.chunk(dist.get_world_size(group), dim=0)[rank])
    return None


def apply() -> bool:
    """Patch torch / megatron-core for CPU if CUDA is absent; returns True when patches are active."""
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
    dist.reduce_scatter_tensor = _reduce_scatter_via_all_reduce
    dist._reduce_scatter_base = _reduce_scatter_via_all_reduce
    from megatron.core.tensor_parallel import mappings

    # megatron binds the function at import time
    mappings.dist_reduce_scatter_func = _reduce_scatter_via_all_reduce
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchWithCpuZeros()
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
    """Within this block `Tensor.cuda()` is the identity when CUDA is absent (see point 4 above)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
