"""The vLLM backend's per-model config: `VLLMConfig` (the shared generation keys plus vLLM's engine
keys) and its mapping to `vllm.LLM(...)` arguments. Pure: imports neither vLLM nor torch.

Every key of docs/generation_keys.md is either mapped here (engine keys) or in
chatgen.generation.config (prompts and sampling), or rejected by `check()` with the reason and the
fix; nothing is silently ignored.
"""

import dataclasses
import json
from pathlib import Path
from typing import Literal, Optional

from chatgen.config import ConfigError, opt
from chatgen.generation.config import GenerationConfig, has_tokenizer, tokenizer_dir

# logprobs_mode -> vLLM's: log-softmax of the model's raw logits, or of the logits after
# temperature/top-k/top-p
LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_LORA_RANK = (
    16  # max_lora_rank's default (vLLM's): set alone, without enable_lora, it is refused
)


@dataclasses.dataclass(kw_only=True)
class VLLMConfig(GenerationConfig):
    # scheduler
    max_num_batched_tokens: Optional[int] = opt(
        None, "tokens per engine step at most; null = vLLM's default"
    )
    max_paddings: Optional[int] = opt(
        None, "old vLLM scheduler knob, not supported (vLLM V1 packs without padding)"
    )
    # cache
    block_size: Optional[int] = opt(
        None,
        "KV cache block size in tokens; None = vLLM's default (128 on CPU, which needs a multiple of 32)",
    )
    gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory vLLM may use, in (0, 1]")
    swap_space: Optional[float] = opt(
        None, "old vLLM KV swap space (GiB), not supported (vLLM V1 recomputes preempted requests)"
    )
    sliding_window: Optional[int] = opt(
        None, "sliding-window attention size; null = the model's own"
    )
    kv_cache_memory_bytes: Optional[int] = opt(
        None,
        "KV cache size in bytes; null = from gpu_memory_utilization (on CPU the module picks a small size)",
    )
    release_during_training: bool = opt(
        False,
        "colocated on CPU with the trainer that syncs into it: the engine frees its weights and KV cache while "
        "the trainer trains and the full weight sync that follows rebuilds them (peak memory down by about "
        "both; on GPUs the colocated engine sleeps anyway); a synchronous run with full syncs only",
    )
    # parallelism
    tensor_parallel_size: int = opt(1, "tensor-parallel ranks of the engine")
    return_routed_experts: bool = opt(
        False,
        "record the experts each token was routed to (mixture-of-experts models) into RolloutBatch.routed_experts, "
        "for a trainer's moe_routing_replay; turns prefix caching off (a cached prompt is not routed again)",
    )
    enforce_eager: bool = opt(
        False, "disable CUDA graphs / compilation (faster start, slower steps)"
    )
    enable_lora: bool = opt(
        False,
        "serve a LoRA adapter on top of the base weights (vLLM's enable_lora; one adapter): an adapter-only "
        "sync loads it (docs/lora.md)",
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128] = opt(
        MAX_LORA_RANK, "the largest adapter rank the engine accepts (vLLM's max_lora_rank)"
    )

    def check(self):
        yield from super().check()
        if self.release_during_training and self.enable_lora:
            yield (
                "release_during_training",
                "needs syncs that write every weight, and enable_lora's adapter-only sync writes the "
                "adapter alone; set one of them to false",
            )
        if self.max_lora_rank != MAX_LORA_RANK and not self.enable_lora:
            yield (
                "max_lora_rank",
                "is read only with enable_lora: true (an adapter-only sync's engine); set enable_lora: "
                "true or remove the key",
            )
        if self.max_paddings is not None:
            yield (
                "max_paddings",
                (
                    "not supported: vLLM's V1 scheduler packs sequences without padding; remove it "
                    "and bound a step with max_num_batched_tokens instead"
                ),
            )
        # Keys vLLM V1 cannot honour: rejected here, with the fix, so they come out with every other
        # error.
        if self.swap_space is not None:
            yield (
                "swap_space",
                (
                    "not supported: vLLM V1 recomputes preempted requests instead of swapping their KV "
                    "cache to CPU; remove the key (size the KV cache with gpu_memory_utilization or "
                    "kv_cache_memory_bytes)"
                ),
            )
        if self.sliding_window is not None:
            yield (
                "sliding_window",
                (
                    "not supported: vLLM V1 takes the sliding window from the model's config.json; "
                    "remove the key and set `sliding_window` there"
                ),
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            yield (
                "gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}; 0.9 is usual",
            )
        for key in ("block_size", "tensor_parallel_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        for key in ("max_num_batched_tokens", "sliding_window", "kv_cache_memory_bytes"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield (
                    key,
                    f"must be >= 1 or null, got {getattr(self, key)}; use null for the default",
                )


def check_vllm_config(cfg, cpu: bool) -> None:
    """Raise one ConfigError listing every problem of a config built in code: the schema's checks
    (VLLMConfig.check, which also rejects the keys vLLM V1 cannot honour) plus the platform's."""
    problems = [*cfg.check(), *platform_problems(cfg, cpu)]
    if problems:
        raise ConfigError([f"{key}: {msg}" for key, msg in problems])


def platform_problems(cfg, cpu: bool):
    """(key, problem) pairs for keys this platform cannot honour (the loader's `extra_check`)."""
    if cpu and cfg.block_size is not None and cfg.block_size % 32:
        yield (
            "block_size",
            (
                f"{cfg.block_size} does not fit vLLM's CPU attention, which needs a multiple of 32; "
                "use 128 (vLLM's CPU default) or remove the key"
            ),
        )


def engine_kwargs(cfg, model_dir, cpu: bool, distributed_executor_backend=None) -> dict:
    """Keyword arguments for `vllm.LLM(model_dir, **kwargs)`; unset (None) keys keep vLLM's
    defaults."""
    tokenizer = tokenizer_dir(cfg, model_dir)
    kwargs = dict(
        tokenizer=str(tokenizer),
        skip_tokenizer_init=not has_tokenizer(
            tokenizer
        ),  # token-only engine for a model without one
        dtype=cfg.dtype,
        seed=cfg.seed,
        max_model_len=cfg.seq_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        block_size=cfg.block_size,
        max_num_seqs=cfg.generation_batch_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        logprobs_mode=LOGPROBS_MODES[cfg.logprobs_mode],
        load_format=cfg.load_format if cfg.load_format != "auto" else None,
        # recorded routing must cover every prompt token of every sample: no prompt served from the
        # cache
        enable_prefix_caching=False if cfg.return_routed_experts else None,
        **(
            dict(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
            if cfg.enable_lora
            else {}
        ),
    )
    if cpu and cfg.kv_cache_memory_bytes is None:
        kwargs["kv_cache_memory_bytes"] = default_cpu_kv_cache_bytes(model_dir, cfg)
    return {key: value for key, value in kwargs.items() if value is not None}


CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM 0.32's CPU attention default


def default_cpu_kv_cache_bytes(model_dir, cfg) -> int:
    """KV cache for (generation_batch_size or 8) sequences of seq_length tokens, each rounded up
    to whole KV blocks (vLLM refuses a cache that cannot hold one full-length sequence). vLLM's
    own CPU default reserves most of the machine's RAM."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    per_token = (
        2
        * hf["num_hidden_layers"]
        * hf.get("num_key_value_heads", heads)
        * head_dim
        * DTYPE_BYTES[cfg.dtype]
    )
    block = cfg.block_size or CPU_DEFAULT_BLOCK_SIZE
    tokens_per_sequence = -(-cfg.seq_length // block) * block
    return per_token * tokens_per_sequence * (cfg.generation_batch_size or 8)
