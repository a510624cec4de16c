"""The one place in chatgen that touches vLLM internals (written against vLLM 0.32), one file per
topic.

`VLLMModule` drives vLLM one engine step at a time so that the framework, not vLLM, owns the loop.
The public `LLMEngine.step()` fuses "schedule" and "run the model"; this module splits them:

    schedule(llm)            -> ScheduledBatch     scheduler.schedule()
    execute(llm, batch)      -> [RequestOutput]    executor.execute_model + sample_tokens,
                                                   scheduler.update_from_output, output_processor

(split_step.py) which is exactly `EngineCore.step()` + `InprocClient.get_output()` +
`LLMEngine.step()` for an in-process, single-batch-queue engine. Everything else here uses vLLM's
public API (`LLM`, `SamplingParams`, `LLMEngine.add_request`, `collective_rpc`).

`record_routed_experts(llm)` (routing.py) makes `execute` record, for a mixture-of-experts model,
the experts each token was routed to (vLLM's router capture hook) and hand them out on each finished
sample as `CompletionOutput.routed_experts`.

`record_sampled_logprobs(llm)` (sampled_logprobs.py, installed by `build_llm` where it applies)
gives requests that want only their sampled tokens' log-probs those values from one gather per step
instead of vLLM's per-request entries.

`build_llm` / `shutdown` (engine.py) start and end the engine. `check_internals(llm)` asserts every
private attribute this relies on; `build_llm` calls it, and
tests/integration/test_generation_engine.py checks it and compares a split-step run with
`LLM.generate` token for token, so a vLLM upgrade that moves any of it fails loudly there instead of
generating garbage. Every workaround of a vLLM 0.32 behaviour is in patches.py, whose `check()`
(tests/integration/ test_vllm_patches.py) names what of vLLM each patch relies on.

Weight sync (chatgen.param_sync) writes into the engine with `load_weights(llm, named_tensors)`
(weights.py). On CPU, cpu_release.py frees the weights and KV cache for sleep level 2 (vLLM's CPU
worker frees nothing) and gives them back before the next full sync.
"""

import os

# The engine core must live in this process: the framework steps it and syncs weights into it in
# place.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from chatgen.core.imports import require  # noqa: E402

require("vllm", "the vllm backend (backend: vllm)")

from chatgen.generation.vllm.lean_imports import without_unused_imports  # noqa: E402

# no ray or opentelemetry import in a process that has none (lean_imports)
with without_unused_imports():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import RequestOutputKind

from chatgen.generation.vllm.adapter.engine import (  # noqa: E402
    ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    build_llm,
    host_memory_only_gc,
    in_process_workers,
    on_cpu,
    shutdown,
)
from chatgen.generation.vllm.adapter.lora import add_lora_dir, replace_lora  # noqa: E402
from chatgen.generation.vllm.adapter.patches import TESTED_VLLM  # noqa: E402
from chatgen.generation.vllm.adapter.routing import record_routed_experts  # noqa: E402
from chatgen.generation.vllm.adapter.split_step import (  # noqa: E402
    ScheduledBatch,
    abort,
    abort_with_outputs,
    add_request,
    request_batch,
    check_internals,
    execute,
    has_unfinished_requests,
    hf_config,
    is_sleeping,
    kv_cache_usage,
    output_token_counts,
    reset_prefix_cache,
    schedule,
    sleep,
    vocab_size,
    wake_up,
)
from chatgen.generation.vllm.adapter.weights import expert_weights, load_weights  # noqa: E402

__all__ = [
    "LLM",
    "SamplingParams",
    "TokensPrompt",
    "RequestOutput",
    "ScheduledBatch",
    "TESTED_VLLM",
    "build_llm",
    "check_internals",
    "add_request",
    "request_batch",
    "has_unfinished_requests",
    "schedule",
    "execute",
    "abort",
    "shutdown",
    "on_cpu",
    "kv_cache_usage",
    "sleep",
    "wake_up",
    "is_sleeping",
    "load_weights",
    "in_process_workers",
    "hf_config",
    "RequestOutputKind",
    "abort_with_outputs",
    "output_token_counts",
    "reset_prefix_cache",
    "vocab_size",
    "expert_weights",
    "record_routed_experts",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
    "host_memory_only_gc",
    "replace_lora",
    "add_lora_dir",
]
