"""Qwen2 family (HF model_type "qwen2"): the Llama mapping (llama.py) plus a bias on the fused QKV projection.

Qwen2 checkpoints often tie the output layer to the embedding (`tie_word_embeddings`); the Llama mapping
handles that. Sliding-window attention is not mapped (Megatron would attend to the full context).

    spec = qwen2.spec_from_hf(json.load(open("DIR/config.json")))
"""
from chatgen.models import llama
from chatgen.models.llama import gpt_model_kwargs, param_mappings, transformer_config_kwargs  # noqa: F401
from chatgen.models.spec import ModelSpec


def spec_from_hf(hf_config: dict) -> ModelSpec:
    if hf_config.get("use_sliding_window"):
        raise ValueError("qwen2 config: use_sliding_window=true is not supported (Megatron attends to the "
                         "full context); set it to false")
    return llama.spec_from_hf(hf_config, family="qwen2", qkv_bias=True)
