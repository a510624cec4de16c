"""NeMo RL's generation config (its VllmConfig: GenerationConfig + vllm_cfg + vllm_kwargs, as its
YAMLs and its `configure_generation_config` write it) as chatgen's per-model generation keys
(docs/generation_keys.md), the stops it adds to every row, and the facade's own switches.

    nemo = engine_config({"backend": "vllm", "model_name": path, "max_new_tokens": 128, "temperature": 0.7,
                          "stop_token_ids": [2], "vllm_cfg": {"max_model_len": 2048}})
    # nemo.keys: {"load": path, "new_token_limit": True, "max_new_tokens": 128, "temperature": 0.7,
    #             "seq_length": 2048}
    # nemo.stops: {"stop_token_ids": [2], "stop_strings": []}: merged into each row's own (NeMo RL merges them)
    # nemo.colocated: colocated.enabled (True when absent)

Every key NeMo RL writes is one of three kinds: mapped to chatgen's (MAPPED tables), accepted and
unused (IGNORED, named in one log line per config), or accepted only at a value chatgen can honour
(REFUSED_UNLESS: any other value is an error naming what it asks for). `vllm_kwargs` are vllm.LLM's
keyword arguments in NeMo RL; here chatgen's generation keys as they are (kv_cache_memory_bytes,
enforce_eager, seed, ...), NeMo RL's vLLM ones in the same three kinds. Any other key is an error
naming it.
"""

import dataclasses
import logging
from collections.abc import Mapping

log = logging.getLogger("chatgen.compat.nemo_rl")

TOP = {  # NeMo RL's GenerationConfig key -> chatgen's
    "model_name": "load",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "pad_token_id": "pad_token_id",  # seed 000's spelling
    "_pad_token_id": "pad_token_id",  # what configure_generation_config writes (the tokenizer's pad id)
}
VLLM_CFG = {  # NeMo RL's vllm_cfg key -> chatgen's
    "tensor_parallel_size": "tensor_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "seq_length",
    "load_format": "load_format",
    "precision": "dtype",
    "enforce_eager": "enforce_eager",
    "logprobs_mode": "logprobs_mode",
    "enable_return_routed_experts": "return_routed_experts",
}
STOPS = ("stop_token_ids", "stop_strings")
FACADE = {"colocated", "vllm_cfg", "vllm_kwargs"}  # read by the facade itself (VllmGeneration)
# accepted and unused: what chatgen decides itself (placement, executor, tokenizer, engine stepping)
# or what belongs to NeMo RL's other paths (validation sampling of NeMo-Gym, Megatron inference,
# metrics, ports)
IGNORED = {
    "top": {
        "backend", "tokenizer", "model_name_or_path", "dtype", "val_temperature", "val_top_p",
        "val_top_k", "port_range_low", "port_range_high", "use_async_rollouts",
        "_debug_payload_metrics", "real_quant_export_cpu_offload", "refit_cfg",
        "mcore_generation_config", "skip_tokenizer_init", "load_format",
    },
    "vllm_cfg": {
        "async_engine", "skip_tokenizer_init", "use_tqdm", "enable_vllm_metrics_logger",
        "vllm_metrics_logger_interval", "http_refit_api_key_env_var",
        "reset_encoder_cache_after_weight_update", "http_refit_server_port",
        "zmq_refit_server_port", "cap_max_tokens_to_context",
    },
    "vllm_kwargs": {"distributed_executor_backend", "compilation_config", "enable_prefix_caching"},
}  # fmt: skip
OFF = (None, False, 0, "", "auto", {}, [])
# key -> (the values chatgen honours, what any other value asks for)
REFUSED_UNLESS = {
    "top": {
        "refit_transport": (
            OFF,
            "a refit transport of NeMo RL's (chatgen refits by broadcast or shm)",
        ),
        "real_quant": (OFF, "real quantized export (chatgen's engine loads the trainer's dtype)"),
        "_mtp_weights_from_refit": (OFF, "MTP draft weights by refit (no speculative decoding)"),
        "bad_words": (OFF, "bad_words (chatgen's sampling bans no words)"),
    },
    "vllm_cfg": {
        "pipeline_parallel_size": (
            (None, 1),
            (
                "pipeline parallel: chatgen's engine and its weight sync split a model by "
                "tensor_parallel_size only (per-rank loaders know no pipeline stages)"
            ),
        ),
        "expert_parallel_size": ((None, 1), "expert parallel (chatgen splits by tensor parallel)"),
        "kv_cache_dtype": (OFF, "a KV cache dtype other than the model's"),
        "is_mx": (OFF, "MXFP8 quantization"),
        "use_deep_gemm": (OFF, "DeepGEMM kernels (CUDA only)"),
        "num_last_layers_in_bf16": (OFF, "layers kept in bf16 of an fp8 model"),
        "num_first_layers_in_bf16": (OFF, "layers kept in bf16 of an fp8 model"),
        "lora_cfg": (OFF, "LoRA in the engine by NeMo RL's lora_cfg (chatgen's: enable_lora)"),
        "video": (OFF, "video inputs"),
        "env_vars": (OFF, "environment variables for vLLM's workers (set them before starting)"),
        "tool_parser_plugin": (OFF, "a vLLM tool parser plugin"),
        "reasoning_parser_plugin": (OFF, "a vLLM reasoning parser plugin"),
        "http_server_serving_chat_kwargs": (OFF, "vLLM's chat serving options"),
        "expose_http_server": (
            OFF,
            (
                "an HTTP server per worker, which the generation floor cannot start: serve a worker with "
                "chatgen.serving.embedded.EmbeddedServer(generation.workers[i]) (docs/serving.md)"
            ),
        ),
    },
    "vllm_kwargs": {"speculative_config": (OFF, "speculative decoding")},
}
PRECISIONS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
PRECISIONS.update(float32="float32", fp32="float32")
REQUIRED = ("model_name",)


class MissingKeys(ValueError, AssertionError):
    """A required key is absent (an AssertionError too, as NeMo RL's VllmGeneration raises it)."""


@dataclasses.dataclass
class NemoRLConfig:
    """A NeMo RL config read: chatgen's generation keys, the stops every row gets, the facade's
    switches."""

    keys: dict
    stops: dict
    colocated: bool = True


def engine_config(config: Mapping) -> NemoRLConfig:
    """The NemoRLConfig of a NeMo RL generation config; a ValueError names each key chatgen
    cannot honour and its fix, after one log line naming the keys accepted and unused."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"VllmGeneration: the config must be a dict (NeMo RL's VllmConfig), got {type(config).__name__}"
        )
    missing = [key for key in REQUIRED if key not in config]
    if missing:
        raise MissingKeys(
            f"VllmGeneration: Missing required keys in VllmConfig: {', '.join(missing)} (model_name: a "
            f"Hugging Face model directory); provided keys: {', '.join(config)}"
        )
    if config.get("backend", "vllm") != "vllm":
        raise ValueError(
            f"VllmGeneration: backend={config['backend']!r}; this class is the vLLM backend (backend: vllm)"
        )
    vllm_cfg = dict(config.get("vllm_cfg") or {})
    vllm_kwargs = dict(config.get("vllm_kwargs") or {})
    errors, ignored = [], []
    for where, section, mapped in (
        ("top", config, {*TOP, *STOPS, *FACADE}),
        ("vllm_cfg", vllm_cfg, set(VLLM_CFG)),
        (
            "vllm_kwargs",
            vllm_kwargs,
            None,
        ),  # chatgen's own keys: its config check names a wrong one
    ):
        prefix = "" if where == "top" else f"{where}."
        for key, value in section.items():
            if key in IGNORED[where]:
                ignored.append(prefix + key)
            elif key in REFUSED_UNLESS[where]:
                allowed, asks = REFUSED_UNLESS[where][key]
                if not any(
                    value == ok and type(value) is type(ok) or value is ok for ok in allowed
                ):
                    errors.append(f"{prefix}{key}={value!r} asks for {asks}; remove it")
            elif mapped is not None and key not in mapped:
                errors.append(
                    f"{prefix}{key} is not a key of NeMo RL's config that chatgen knows "
                    f"(mapped: {sorted(mapped)}; chatgen's own engine keys go under vllm_kwargs)"
                )
    if errors:
        raise ValueError("VllmGeneration: " + "; ".join(errors))
    if ignored:
        log.info(
            "VllmGeneration: NeMo RL keys accepted and unused by chatgen: %s", ", ".join(ignored)
        )
    keys = {TOP[k]: v for k, v in config.items() if k in TOP and v is not None}
    if "max_new_tokens" in keys:
        keys["new_token_limit"] = True  # NeMo RL's limit counts generated tokens
    if keys.get("top_k") in (0, -1, None):
        keys.pop("top_k", None)  # off (chatgen's -1)
    for key, value in vllm_cfg.items():
        if key in VLLM_CFG and value is not None:
            keys[VLLM_CFG[key]] = _value(key, value)
    keys.update({k: v for k, v in vllm_kwargs.items() if k not in IGNORED["vllm_kwargs"]})
    colocated = config.get("colocated") or {}
    return NemoRLConfig(
        keys,
        {key: list(config.get(key) or []) for key in STOPS},
        colocated=bool(colocated.get("enabled", True)),
    )


def _value(key: str, value):
    """NeMo RL's value as chatgen's: precision names, processed/raw_logprobs, booleans written as
    strings."""
    if key == "precision":
        if value not in PRECISIONS:
            raise ValueError(
                f"VllmGeneration: vllm_cfg.precision={value!r}; chatgen's engine runs "
                f"{sorted(set(PRECISIONS.values()))} (fp8 is not supported)"
            )
        return PRECISIONS[value]
    if key == "logprobs_mode":
        return value.removesuffix("_logprobs")
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"  # NeMo RL's test config writes enforce_eager: "False"
    return value
