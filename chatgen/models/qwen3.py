"""Qwen3 family (HF model_type "qwen3", dense): the Llama mapping (llama.py) plus QK-norm.

What differs from Llama:
- QK-norm: before RoPE, every query head and every key head goes through an RMSNorm over head_dim
  (one weight of head_dim shared by all heads, `self_attn.q_norm` / `k_norm`, same eps as the other
  norms). Megatron's `qk_layernorm` is the same thing (`self_attention.q_layernorm` / `k_layernorm`,
  hidden size kv_channels, applied per head before RoPE); the weights are replicated under tensor
  parallelism.
- head_dim is its own config key and may differ from hidden_size / num_attention_heads (Qwen3-32B:
  5120 / 64 heads, head_dim 128); transformers' Qwen3Config makes it 128 when config.json leaves it
  out.
- No QKV bias (Qwen2 has one); `attention_bias=true` would also put a bias on o_proj, which neither
  the Megatron model here nor vLLM's Qwen3 has, so it is refused.
Sliding-window attention (`use_sliding_window`, `layer_types` other than full attention) is refused
too: Megatron would attend to the full context. The MoE variant is model_type "qwen3_moe"
(qwen3_moe.py).

    spec = qwen3.spec_from_hf(json.load(open("DIR/config.json")))
"""

from chatgen.models import llama
from chatgen.models.llama import gpt_model_kwargs, param_mappings, transformer_config_kwargs  # noqa: F401
from chatgen.models.spec import ModelSpec

DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim when config.json has none


def spec_from_hf(hf_config: dict, family: str = "qwen3") -> ModelSpec:
    unsupported = []
    if hf_config.get("attention_bias"):
        unsupported.append(
            "attention_bias=true (o_proj bias has no Megatron counterpart here, nor in vLLM)"
        )
    if hf_config.get("use_sliding_window"):
        unsupported.append(
            "use_sliding_window=true (Megatron attends to the full context); set it to false"
        )
    other_layers = sorted(set(hf_config.get("layer_types") or ()) - {"full_attention"})
    if other_layers:
        unsupported.append(f"layer_types {other_layers} (only 'full_attention' layers are mapped)")
    if unsupported:
        raise ValueError(f"{family} config: unsupported feature(s): {'; '.join(unsupported)}")
    return llama.spec_from_hf(
        {"head_dim": DEFAULT_HEAD_DIM, **hf_config}, family=family, qk_norm=True
    )
