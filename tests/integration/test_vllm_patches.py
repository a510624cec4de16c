"""The vLLM 0.32 patches still fit the installed vLLM (chatgen/generation/vllm/adapter/patches.py).

    .venv/bin/python -m pytest tests/integration/test_vllm_patches.py

No engine starts: each patch's needs (`patches.RELIES_ON`) are looked up in vLLM's modules, so an upgrade that
moves, renames or re-signs any of them fails here, naming the patch, instead of the patch silently not applying.
"""

import pytest
import torch

pytestmark = pytest.mark.integration


def test_every_patch_finds_what_it_relies_on():
    from chatgen.generation.vllm.adapter import patches

    assert patches.check() == []


def test_every_patch_of_the_adapter_declares_its_needs():
    """A patch function added to patches.py without a RELIES_ON entry would escape the check above; an entry
    for a wrapper in another adapter file (sampled_logprobs.record_sampled_logprobs) must name one."""
    import importlib
    import inspect
    import pkgutil

    from chatgen.generation.vllm import adapter
    from chatgen.generation.vllm.adapter import patches

    def public_functions(module):
        return {
            name
            for name, f in inspect.getmembers(module, inspect.isfunction)
            if f.__module__ == module.__name__ and not name.startswith("_")
        }

    functions = public_functions(patches) - {"check"}
    declared = set(patches.RELIES_ON)
    assert functions - set(RELIES_ON_EXEMPT) == declared & functions
    elsewhere = set().union(
        *(
            public_functions(importlib.import_module(f"{adapter.__name__}.{m.name}"))
            for m in pkgutil.iter_modules(adapter.__path__)
            if m.name != "patches"
        )
    )
    assert declared - functions <= elsewhere, (
        f"RELIES_ON names no adapter function: {declared - functions - elsewhere}"
    )
    assert "record_sampled_logprobs" in declared


# patches that need nothing of vLLM's internals beyond public API, or that degrade to a no-op when it is gone
RELIES_ON_EXEMPT = {
    "quiet_numa_notice": "skips itself when torch.ops._C.init_cpu_memory_env is gone (the notice then shows)",
    "refresh_tied_lm_head": "calls quant_method.process_weights_after_loading, the LM head's public post-load hook",
}


def test_a_moved_internal_is_named(monkeypatch):
    from chatgen.generation.vllm.adapter import patches

    monkeypatch.setitem(
        patches.RELIES_ON,
        "eager_token_ranks",
        [
            "vllm.v1.sample.sampler:no_such_function",
            ("vllm.v1.sample.sampler:Sampler.forward", ("self", "no_such_argument")),
            ("vllm.v1.sample.sampler", "no such text in the module"),
        ],
    )
    problems = [p for p in patches.check() if p.startswith("eager_token_ranks")]
    assert len(problems) == 3, problems
    assert "no_such_function is missing" in problems[0]
    assert "no_such_argument" in problems[1] and "no such text" in problems[2]


@pytest.mark.parametrize(
    "shape, dtype, bucketed",
    [
        ((352 * 2, 128), torch.float32, True),  # the tiny Llama's gate_up: 352 KiB
        ((1024, 256), torch.float32, True),  # exactly SMALL_LINEAR_MAX_BYTES
        ((1024, 257), torch.float32, False),  # one column over: vLLM's oneDNN handler
        ((576 * 5 // 3, 576), torch.float32, False),  # SmolLM2's qkv, 2.2 MB
        ((352 * 2, 128), torch.bfloat16, False),  # another dtype: vLLM decides
    ],
)
def test_small_fp32_linears_run_at_bucketed_row_counts(shape, dtype, bucketed):
    """bucketed_small_linears on vLLM's real CPU dispatch: a small fp32 layer gets the bucketed oneDNN matmul;
    a larger one, or a bf16 one, gets what vLLM gives it. Either way the layer computes x @ W.T and, as vLLM
    does with remove_weight, drops the weight for its packed copy."""
    from vllm import _custom_ops as ops

    from chatgen.generation.vllm.adapter import small_linears

    assert ops._supports_onednn  # this CPU build has oneDNN: the bucketed path is the one tested
    small_linears.bucketed_small_linears()
    small_linears.bucketed_small_linears()  # idempotent: wrapping once
    from vllm.model_executor.layers import utils

    assert getattr(utils.dispatch_cpu_unquantized_gemm, "chatgen_small_linears", False)
    torch.manual_seed(0)
    weight = torch.randn(shape).to(dtype)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert getattr(layer.cpu_linear, "chatgen_bucketed", False) == bucketed
    assert layer.weight.numel() == 0
    x = torch.randn(5, shape[1]).to(dtype)
    got = utils.cpu_unquantized_gemm(layer, x, layer.weight, None)
    want = x.float() @ weight.float().T
    # bf16 keeps 8 bits of mantissa
    tol = {"rtol": 1e-2, "atol": 0.1} if dtype == torch.bfloat16 else {"atol": 1e-4}
    assert torch.allclose(got.float(), want, **tol)


@pytest.mark.parametrize("k, n, bias", [(128, 704, False), (352, 128, False), (128, 256, True)])
def test_bucketed_onednn_linear_gives_vllms_numbers_at_every_row_count(k, n, bias):
    """The padded calls give, bit for bit, what vLLM's own handler gives at the exact row count (a oneDNN
    primitive computes each row the same way whatever M it was built for: what the bucketing relies on), at
    row counts that are buckets, that are not, over BULK_ROWS (padded to its multiple), one, and none;
    for 3-D input too. Each is within float noise of torch's linear."""
    from vllm import _custom_ops as ops

    from chatgen.generation.vllm.adapter import small_linears

    torch.manual_seed(0)
    weight, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    linear, exact = (
        small_linears.bucketed_onednn_linear(weight),
        ops.create_onednn_mm(weight.t(), 64),
    )
    x = torch.randn(3 * small_linears.BULK_ROWS + 77, k) * 3
    for m in (
        0,
        1,
        3,
        32,
        33,
        58,
        123,
        186,
        256,
        257,
        3 * small_linears.BULK_ROWS,
        3 * small_linears.BULK_ROWS + 77,
    ):
        got = linear(x[:m], None, b)
        assert got.shape == (m, n)
        assert torch.equal(got, ops.onednn_mm(exact, x[:m], b)), m
        assert torch.allclose(
            got, torch.nn.functional.linear(x[:m], weight, b), rtol=1e-5, atol=1e-4
        ), m
    got = linear(x[:60].view(4, 15, k), None, b)
    assert got.shape == (4, 15, n) and torch.equal(got.view(60, n), linear(x[:60], None, b))
    # a bucket's padding rows take no part: the same rows with other rows beside them give the same
    assert torch.equal(linear(x[:186], None, b)[:100], linear(x[:100], None, b))


def test_row_buckets_are_few_and_cover_their_rows():
    """A run meets at most 13 row counts up to BULK_ROWS (the point: one primitive each, not one per batch
    size), each >= the rows it holds and under twice them."""
    from chatgen.generation.vllm.adapter.small_linears import BULK_ROWS, _row_bucket

    buckets = {_row_bucket(m) for m in range(1, BULK_ROWS + 1)}
    assert len(buckets) == 13 and max(buckets) == BULK_ROWS
    assert all(m <= _row_bucket(m) < 2 * m or m == 1 for m in range(1, BULK_ROWS + 1))


def test_bucketed_onednn_linear_traced_into_a_graph_is_vllms_call():
    """An engine without enforce_eager traces its model once with a symbolic row count (vLLM's
    DYNAMO_TRACE_ONCE); the bucketing's Python, fixed at the traced count, would then pad every later
    call to it (oneDNN wrote past the output: test_chatlearn_port's engine aborted). Traced, the
    layer is vLLM's own call: one graph gives every row count its numbers."""
    from vllm import _custom_ops as ops

    from chatgen.generation.vllm.adapter import small_linears

    torch.manual_seed(0)
    weight = torch.randn(704, 128)
    linear, exact = (
        small_linears.bucketed_onednn_linear(weight),
        ops.create_onednn_mm(weight.t(), 64),
    )
    traced = torch.compile(  # as vLLM compiles: once, then no guard decides to trace again
        lambda x: linear(x, None, None),
        backend="eager",
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    x = torch.randn(300, 128)
    for m in (5, 37, 186, 300):
        assert torch.equal(traced(x[:m]), ops.onednn_mm(exact, x[:m], None)), m
