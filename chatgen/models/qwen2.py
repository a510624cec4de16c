"""Qwen2 family: the Llama mapping (chatgen/models/llama.py) plus a bias on the fused QKV projection.

Qwen2 checkpoints often tie the output layer to the embedding (`tie_word_embeddings`); the Llama mapping
handles that. Sliding-window attention is not mapped (Megatron would attend to the full context).

    spec = qwen2.spec_from_hf(json.load(open("DIR/config.json")))
"""
from chatgen.models.llama import ModelSpec, gpt_model_kwargs, hf_param_shapes, param_mappings, \
    transformer_config_kwargs
from chatgen.models import llama

__all__ = ["spec_from_hf", "transformer_config_kwargs", "gpt_model_kwargs", "param_mappings", "hf_param_shapes",
           "ModelSpec"]


def spec_from_hf(hf_config: dict) -> ModelSpec:
    if hf_config.get("use_sliding_window"):
        raise ValueError("qwen2 config: use_sliding_window=true is not supported (Megatron attends to the "
                         "full context); set it to false")
    return llama.spec_from_hf(hf_config, family="qwen2", qkv_bias=True)
