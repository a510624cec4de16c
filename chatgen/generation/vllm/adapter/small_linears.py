"""Small fp32 linear layers of a CPU engine on vLLM's oneDNN matmul at a few bucketed row counts
(`bucketed_small_linears`, installed by adapter/engine.py's `build_llm`): the same numbers as vLLM's
own handler with a fraction of its primitives, and on an AMD EPYC faster than torch's linear
(docs/long_context.md, "The evaluation phase"). `RELIES_ON` is checked with adapter/patches.py's.
"""

_DISPATCH = "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm"

# The largest fp32 weight (bytes) that `bucketed_small_linears` gives a oneDNN matmul of its own:
# the tiny Llama's layers (hidden 128: 64-360 KiB) are under it; SmolLM2's (hidden 576: 1.3-7 MiB,
# lm_head 108 MiB) are over it and keep vLLM's own oneDNN handler.
SMALL_LINEAR_MAX_BYTES = 1 << 20
# The row counts a small layer's matmul runs at (`_row_bucket`): up to BULK_ROWS the next power of
# two up to 32, then the next multiple of 32; over it the next multiple of BULK_ROWS.
BULK_ROWS = 256


def _row_bucket(rows: int) -> int:
    """The row count (>= rows) a small layer's oneDNN matmul runs `rows` rows at: a run meets 13
    of them up to BULK_ROWS (a decode step's rows are its running sequences) and one per
    BULK_ROWS above, instead of one per batch size."""
    if rows <= 32:
        return 1 << (rows - 1).bit_length()
    if rows <= BULK_ROWS:
        return -(-rows // 32) * 32
    return -(-rows // BULK_ROWS) * BULK_ROWS


def bucketed_onednn_linear(weight):
    """x @ weight.T for a CPU engine's small fp32 layer: vLLM's oneDNN matmul handler (its packed
    copy of the weight) run at `_row_bucket` row counts only, the padding rows zero and dropped.

    vLLM's handler builds one oneDNN primitive per row count M and keeps its 32 latest, and a
    decode step's M is the number of running sequences, so a run builds hundreds (~0.4 ms and
    ~0.2-0.3 MB apiece): on the tiny model ~70 MiB more peak memory than torch's linear (~35 MiB
    bucketed). Rows are independent in a matmul and oneDNN computes each row of a primitive the
    same way whatever M it was built for (tests/integration/test_vllm_patches.py checks it bit
    for bit), so the padded call gives the numbers of vLLM's own handler. On an AMD EPYC
    (AVX-512) oneDNN ran these layers in 0.6-0.9x the time of torch's linear (MKL)
    (docs/long_context.md). The result of a padded call is a view of its first rows (a copy
    would cost a parallel region, ~0.1 ms, on this small a tensor). Traced into a compiled
    graph (an engine without enforce_eager), whose row count is symbolic, it is vLLM's own call
    (one primitive per row count, as vLLM has it)."""
    import torch
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), 32)
    k, n, pointer, run = handler.k, handler.n, handler.handler_tensor, torch.ops._C.onednn_mm

    def linear(x, _weight, bias):
        if torch.compiler.is_compiling():  # a compiled graph has no fixed row count: vLLM's call
            return ops.onednn_mm(handler, x, bias)
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        bucket = _row_bucket(m) if m else 0
        if bucket != m:
            padded = rows.new_empty((bucket, k))
            padded[:m] = rows
            padded[m:].zero_()
            rows = padded
        out = torch.empty((bucket, n), dtype=x.dtype)
        run(out, rows, bias, pointer)
        return out[:m].view(*x.shape[:-1], n)

    linear.chatgen_bucketed = True
    linear.handler = handler  # frees the oneDNN handler when collected: it lives with the layer
    return linear


def bucketed_small_linears() -> None:
    """Small fp32 linear layers of a CPU engine get `bucketed_onednn_linear` instead of vLLM's
    oneDNN handler.

    vLLM 0.32 on CPU makes every unquantized linear layer a oneDNN matmul with one primitive per
    row count (see `bucketed_onednn_linear`); on a small layer those primitives take many times
    the weight's memory. A layer whose weight is at most SMALL_LINEAR_MAX_BYTES runs at a few row
    counts instead (the same numbers); larger ones, and other dtypes (bf16 small layers have
    vLLM's own small-GEMM kernel), are dispatched by vLLM as before; where vLLM would not use
    oneDNN (no oneDNN in the build, POWER), a small layer runs torch's linear on its weight.
    Reloading weights dispatches again, so a synced layer is bucketed again."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import CpuArchEnum, current_platform

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "chatgen_small_linears", False):
        return
    onednn = ops._supports_onednn and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        if (
            weight.is_meta
            or weight.ndim != 2
            or weight.dtype != torch.float32
            or weight.numel() * weight.element_size() > SMALL_LINEAR_MAX_BYTES
        ):
            return dispatch(layer, remove_weight)
        if not onednn:
            layer.cpu_linear = torch.nn.functional.linear
            return
        layer.cpu_linear = bucketed_onednn_linear(weight)
        if remove_weight:  # as vLLM's handler layers: the packed copy is the weight
            layer.weight = torch.nn.Parameter(
                torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False
            )

    dispatch_cpu_unquantized_gemm.chatgen_small_linears = True
    dispatch_cpu_unquantized_gemm.__wrapped__ = dispatch  # what `check` reads (inspect follows)
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# patch -> what it needs of vLLM, in patches.RELIES_ON's form
RELIES_ON = {
    "bucketed_onednn_linear": [
        ("vllm._custom_ops:create_onednn_mm", ("weight", "primitive_cache_size")),
        # its output, its rows, the bias and the handler's pointer: what the padded calls pass
        (
            "vllm._custom_ops:onednn_mm",
            "output, x.reshape(-1, dnnl_handler.k), bias, dnnl_handler.handler_tensor",
        ),
    ],
    "bucketed_small_linears": [
        (
            "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
            ("layer", "remove_weight"),
        ),
        ("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "ops._supports_onednn"),
        # the callers import it when they run, so the patched name is the one they get
        (
            "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
            _DISPATCH,
        ),
        (
            "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading",
            _DISPATCH,
        ),
    ],
}
