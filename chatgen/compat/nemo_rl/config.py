"""NeMo RL's generation config (its VllmConfig: GenerationConfig + vllm_cfg + vllm_kwargs) as chatgen's per-model
generation keys (docs/generation_keys.md), and the stops it adds to every row.

    keys, stops = engine_config({"backend": "vllm", "model_name": path, "max_new_tokens": 128,
                                 "temperature": 0.7, "stop_token_ids": [2], "vllm_cfg": {"max_model_len": 2048}})
    # keys: {"load": path, "new_token_limit": True, "max_new_tokens": 128, "temperature": 0.7, "seq_length": 2048}
    # stops: {"stop_token_ids": [2], "stop_strings": []}: merged into each row's own (NeMo RL merges them too)

`vllm_kwargs` are chatgen's generation keys as they are (e.g. kv_cache_memory_bytes, enforce_eager, seed,
logprobs_mode). Keys of NeMo RL that chatgen's engine does not need are accepted and left unused (IGNORED);
any other key is an error naming it.
"""

from collections.abc import Mapping

TOP = {  # NeMo RL's GenerationConfig key -> chatgen's
    "model_name": "load",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "pad_token_id": "pad_token_id",
}
VLLM_CFG = {  # NeMo RL's vllm_cfg key -> chatgen's
    "tensor_parallel_size": "tensor_parallel_size",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "seq_length",
    "load_format": "load_format",
    "precision": "dtype",
}
STOPS = ("stop_token_ids", "stop_strings")
# chatgen's engine always steps asynchronously and keeps its tokenizer (generate_text needs it); colocation and
# the model's own tokenizer config are chatgen's placement and model directory
IGNORED = {
    "backend",
    "colocated",
    "model_name_or_path",
    "tokenizer",
    "skip_tokenizer_init",
    "async_engine",
}
PRECISIONS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def engine_config(config: Mapping) -> tuple:
    """(chatgen's generation keys, the stops every row gets) of a NeMo RL generation config; a ValueError names
    a key chatgen cannot honour and its fix."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"VllmGeneration: the config must be a dict (NeMo RL's VllmConfig), got {type(config).__name__}"
        )
    if config.get("backend", "vllm") != "vllm":
        raise ValueError(
            f"VllmGeneration: backend={config['backend']!r}; this class is the vLLM backend (backend: vllm)"
        )
    if "model_name" not in config:
        raise ValueError(
            "VllmGeneration: the config needs model_name, a Hugging Face model directory"
        )
    unknown = set(config) - set(TOP) - set(STOPS) - IGNORED - {"vllm_cfg", "vllm_kwargs"}
    if unknown:
        raise ValueError(
            f"VllmGeneration: unknown config key(s) {sorted(unknown)}; NeMo RL's keys are "
            f"{sorted({*TOP, *STOPS, 'vllm_cfg', 'vllm_kwargs'})}, chatgen's own go under vllm_kwargs"
        )
    keys = {TOP[k]: v for k, v in config.items() if k in TOP and v is not None}
    if "max_new_tokens" in keys:
        keys["new_token_limit"] = True  # NeMo RL's limit counts generated tokens
    if keys.get("top_k") in (0, None):
        keys.pop("top_k", None)  # off (chatgen's -1)
    vllm_cfg = dict(config.get("vllm_cfg") or {})
    if vllm_cfg.pop("pipeline_parallel_size", 1) != 1:
        raise ValueError(
            "VllmGeneration: vllm_cfg.pipeline_parallel_size must be 1; chatgen's engine splits a model "
            "with tensor_parallel_size only"
        )
    unknown = set(vllm_cfg) - set(VLLM_CFG) - IGNORED
    if unknown:
        raise ValueError(
            f"VllmGeneration: unknown vllm_cfg key(s) {sorted(unknown)}; known: {sorted(VLLM_CFG)} "
            "(chatgen's own engine keys go under vllm_kwargs)"
        )
    for key, value in vllm_cfg.items():
        if key in VLLM_CFG and value is not None:
            keys[VLLM_CFG[key]] = PRECISIONS.get(value, value) if key == "precision" else value
    keys.update(config.get("vllm_kwargs") or {})
    stops = {key: list(config.get(key) or []) for key in STOPS}
    return keys, stops


def with_stops(batch: Mapping, stops: dict) -> dict:
    """The batch with the config's stops added to each row's own `stop_token_ids` / `stop_strings`."""
    if not any(stops.values()):
        return dict(batch)
    rows = len(batch["input_ids"])
    out = dict(batch)
    for key, extra in stops.items():
        own = batch.get(key) or [None] * rows
        out[key] = [list(extra) + list(row or []) for row in own]
    return out
