"""Qwen2 family (HF model_type "qwen2"): the Llama mapping (llama.py) plus a bias on the fused QKV
projection.

Qwen2 checkpoints often tie the output layer to the embedding (`tie_word_embeddings`); the Llama
mapping handles that. Sliding-window attention is not mapped (Megatron would attend to the full
context), nor a `head_dim` other than hidden_size / num_attention_heads (transformers would use it,
vLLM's Qwen2 does not).

    spec = qwen2.spec_from_hf(json.load(open("DIR/config.json")))
"""

from chatgen.models import llama
from chatgen.models.llama import gpt_model_kwargs, param_mappings, transformer_config_kwargs  # noqa: F401
from chatgen.models.spec import ModelSpec


def spec_from_hf(hf_config: dict) -> ModelSpec:
    if hf_config.get("use_sliding_window"):
        raise ValueError(
            "qwen2 config: use_sliding_window=true is not supported (Megatron attends to the "
            "full context); set it to false"
        )
    derived = hf_config["hidden_size"] // hf_config["num_attention_heads"]
    if hf_config.get("head_dim") not in (None, derived):
        raise ValueError(
            f"qwen2 config: head_dim={hf_config['head_dim']} is not supported: vLLM's Qwen2 ignores "
            f"head_dim and uses hidden_size / num_attention_heads = {derived}; drop the key"
        )
    return llama.spec_from_hf(hf_config, family="qwen2", qkv_bias=True)
