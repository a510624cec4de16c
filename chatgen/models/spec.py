"""What a model family tells the rest of chatgen: the architecture facts (`ModelSpec`) and, per
Megatron parameter, the HF tensors it is made of (`ParamMapping`). Pure data; imports neither
Megatron nor vLLM.
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The architecture facts both sides need, read from an HF config.json by the family's
    `spec_from_hf`."""

    family: str  # the HF model_type, also the name of the family's module in chatgen/models/
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # = HF num_key_value_heads
    head_dim: int  # = Megatron kv_channels
    vocab_size: int  # HF rows of embed_tokens / lm_head (Megatron pads this, see padded_vocab_size)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on queries and keys before RoPE (Qwen3)
    rope_scaling_factor: float | None = None  # Llama-3.1 "llama3" RoPE scaling; None = plain RoPE
    # Mixture of experts (every layer's MLP replaced by a router and num_experts SwiGLU experts); 0
    # = dense
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0  # one expert's SwiGLU width
    moe_router_topk: int = 0  # experts per token
    moe_renormalize: bool = (
        True  # the top-k probabilities renormalised to sum to 1 (softmax over the k logits)
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron's vocab padding: round up to a multiple of divisible_by * TP."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the HF tensors it is made of.

    megatron: local-spec name, `{i}` = the layer number within the pipeline stage, e.g.
        "decoder.layers.{i}.self_attention.linear_qkv.weight"
    hf: {HF name: HF shape}, in the order the layout kind expects; `{i}` = the global layer number
    kind: how the tensors are laid out under tensor parallelism (chatgen/models/layout.py):
        replicated | column | row | vocab | qkv | gate_up
    expert: one mapping per expert of a mixture-of-experts layer, `{e}` in both names = the expert
    number:
        local to the expert-parallel rank on the Megatron side, global on the HF side (like `{i}`)
    """

    megatron: str
    hf: dict
    kind: str
    expert: bool = False

    @property
    def hf_names(self) -> tuple:
        return tuple(self.hf)
