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
    "shape, dtype, plain",
    [
        ((352 * 2, 128), torch.float32, True),  # the tiny Llama's gate_up: 352 KiB
        ((1024, 256), torch.float32, True),  # exactly PLAIN_LINEAR_MAX_BYTES
        ((1024, 257), torch.float32, False),  # one column over: vLLM's oneDNN handler
        ((576 * 5 // 3, 576), torch.float32, False),  # SmolLM2's qkv, 2.2 MB
        ((352 * 2, 128), torch.bfloat16, False),  # another dtype: vLLM decides
    ],
)
def test_small_fp32_linears_keep_their_weight_and_use_torch(shape, dtype, plain):
    """plain_small_linears on vLLM's real CPU dispatch: a small fp32 layer runs torch's linear on the weight it
    keeps; a larger one, or a bf16 one, gets what vLLM gives it (a packed kernel that drops the weight). Either
    way the layer computes x @ W.T."""
    from chatgen.generation.vllm.adapter import patches

    patches.plain_small_linears()
    patches.plain_small_linears()  # idempotent: wrapping once
    from vllm.model_executor.layers import utils

    assert getattr(utils.dispatch_cpu_unquantized_gemm, "chatgen_plain_small", False)
    torch.manual_seed(0)
    weight = torch.randn(shape).to(dtype)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert (layer.cpu_linear is torch.nn.functional.linear) == plain
    assert (layer.weight.numel() == weight.numel()) == plain
    x = torch.randn(5, shape[1]).to(dtype)
    got = utils.cpu_unquantized_gemm(layer, x, layer.weight, None)
    want = x.float() @ weight.float().T
    # bf16 keeps 8 bits of mantissa
    tol = {"rtol": 1e-2, "atol": 0.1} if dtype == torch.bfloat16 else {"atol": 1e-4}
    assert torch.allclose(got.float(), want, **tol)
