"""NeMo RL's generation config as its example YAMLs (examples/configs/grpo_math_1B.yaml, NVIDIA-NeMo/RL 7ea279a)
and its configure_generation_config write it, read by chatgen's NeMo RL facade: every key mapped, ignored (one
log line naming them) or refused only where it asks for what chatgen cannot do. Pure Python, no engine.

    python -m pytest tests/peers/test_nemo_rl_config.py
"""

import logging

import pytest
from nemo_rl_cpu import configure_generation_config

from chatgen.compat.nemo_rl.config import MissingKeys, engine_config


class Tokenizer:  # what configure_generation_config reads of a tokenizer
    pad_token_id, eos_token_id = 0, 2


def grpo_math_1b_generation(model_name="/models/qwen") -> dict:
    """policy.generation of grpo_math_1B.yaml with its interpolations resolved (max_total_sequence_length
    512, precision bfloat16), model_name as GRPO writes it."""
    return {
        "port_range_low": 3000,
        "port_range_high": 4999,
        "backend": "vllm",
        "max_new_tokens": 512,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "val_temperature": 1.0,
        "val_top_p": 1.0,
        "val_top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "refit_transport": None,
        "real_quant_export_cpu_offload": True,
        "refit_cfg": {"nixl": {"device": "cuda", "backend_name": "UCX"}},
        "mcore_generation_config": {"max_model_len": 512, "expose_http_server": False},
        "vllm_cfg": {
            "async_engine": False,
            "precision": "bfloat16",
            "kv_cache_dtype": "auto",
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.6,
            "max_model_len": 512,
            "enforce_eager": False,
            "use_tqdm": True,
            "use_deep_gemm": False,
            "num_last_layers_in_bf16": 0,
            "num_first_layers_in_bf16": 0,
            "enable_vllm_metrics_logger": True,
            "vllm_metrics_logger_interval": 0.5,
            "http_refit_api_key_env_var": None,
            "reset_encoder_cache_after_weight_update": False,
            "http_refit_server_port": None,
            "zmq_refit_server_port": None,
        },
        "vllm_kwargs": {},
        "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
        "model_name": model_name,
    }


def test_the_example_yaml_as_configure_generation_config_leaves_it(caplog):
    config = configure_generation_config(grpo_math_1b_generation(), Tokenizer())
    with caplog.at_level(logging.INFO, logger="chatgen.compat.nemo_rl"):
        nemo = engine_config(config)
    assert nemo.keys == {
        "load": "/models/qwen",
        "max_new_tokens": 512,
        "new_token_limit": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "pad_token_id": 0,  # _pad_token_id, the tokenizer's
        "dtype": "bfloat16",
        "logprobs_mode": "processed",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "seq_length": 512,
        "enforce_eager": False,
        "load_format": "dummy",  # configure_generation_config: weights come from the first refit
    }
    assert nemo.stops == {"stop_token_ids": [2], "stop_strings": []}  # EOS, as it sets
    assert nemo.colocated
    ignored = [r.getMessage() for r in caplog.records if "accepted and unused" in r.getMessage()]
    assert len(ignored) == 1
    for key in (
        "val_temperature",
        "port_range_low",
        "vllm_cfg.use_tqdm",
        "mcore_generation_config",
    ):
        assert key in ignored[0]


def test_nemo_rl_test_config_spellings():
    """Its test config writes enforce_eager as the string "False", top_k None, vLLM kwargs it passes on."""
    config = grpo_math_1b_generation()
    config["vllm_cfg"]["enforce_eager"] = "False"
    config["vllm_kwargs"] = {
        "distributed_executor_backend": "ray",
        "kv_cache_memory_bytes": 1 << 20,
    }
    config["colocated"]["enabled"] = False
    nemo = engine_config(config)
    assert nemo.keys["enforce_eager"] is False and "top_k" not in nemo.keys
    assert nemo.keys["kv_cache_memory_bytes"] == 1 << 20
    assert "distributed_executor_backend" not in nemo.keys and not nemo.colocated


@pytest.mark.parametrize(
    "where,key,value,named",
    [
        ("vllm_cfg", "pipeline_parallel_size", 2, "pipeline parallel"),
        ("vllm_cfg", "expert_parallel_size", 4, "expert parallel"),
        ("vllm_cfg", "kv_cache_dtype", "fp8", "KV cache dtype"),
        ("vllm_cfg", "precision", "fp8", "fp8"),
        ("top", "refit_transport", "nixl", "refit transport"),
        ("top", "_mtp_weights_from_refit", True, "MTP"),
        ("vllm_kwargs", "speculative_config", {"method": "mtp"}, "speculative decoding"),
        ("vllm_cfg", "max_num_seqz", 8, "max_num_seqz"),
        ("vllm_cfg", "expose_http_server", True, "EmbeddedServer"),
    ],
)
def test_refused_only_where_it_asks_for_what_chatgen_cannot_do(where, key, value, named):
    config = grpo_math_1b_generation()
    (config if where == "top" else config[where])[key] = value
    with pytest.raises(ValueError, match=named):
        engine_config(config)


def test_a_missing_model_name_is_named_first():
    config = grpo_math_1b_generation()
    del config["model_name"]
    config["skip_tokenizer_init"] = True
    with pytest.raises(MissingKeys, match="Missing required keys in VllmConfig: model_name"):
        engine_config(config)
