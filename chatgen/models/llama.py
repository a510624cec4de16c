"""Llama family (HF model_type "llama"): HF config -> Megatron model config, and the HF <-> Megatron
parameter mapping, side by side. A family is this one file: chatgen.models finds it by model_type.

Llama = RMSNorm, SwiGLU MLP, RoPE (plain, or Llama-3.1 "llama3" frequency scaling), grouped-query
attention, tied or untied embeddings, no biases. Qwen2 (qwen2.py) and Qwen3 (qwen3.py) reuse this
mapping; so do the mixture-of-experts families (qwen3_moe.py, mixtral.py): with `spec.num_experts` >
0 every layer's MLP is a router and that many SwiGLU experts (megatron-core's MoELayer, local
experts), and the family names where its checkpoint keeps them (`MoENames`). The mapping names each
Megatron parameter, the HF tensors it is made of with their shapes, and its layout kind
(chatgen/models/layout.py says what each kind means under tensor parallelism). `{i}` in a name is
the layer number: local to the pipeline stage on the Megatron side, global on the HF side.

Pure data and tensor shapes; imports neither Megatron nor vLLM:

    spec = llama.spec_from_hf(json.load(open("DIR/config.json")))
    llama.transformer_config_kwargs(spec)   # -> megatron TransformerConfig keyword arguments
    llama.param_mappings(spec)              # -> ([ParamMapping(megatron, {hf name: shape}, kind)], per-layer ones)
"""

import dataclasses

from chatgen.models.spec import ModelSpec, ParamMapping

# megatron-core 0.16 RotaryEmbedding._apply_scaling (its Llama-3.1 RoPE scaling) takes only `factor`
# from GPTModel(rope_scaling_factor=...); these three are fixed defaults there. Configs with other
# values are refused.
MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_scaling(hf_config: dict, problems: list) -> float | None:
    """The "llama3" scaling factor of an HF config, None for plain RoPE; appends to `problems`
    what Megatron cannot express. transformers 5 spells the block `rope_parameters`, 4.x
    `rope_scaling`; both are read."""
    for key in ("rope_parameters", "rope_scaling"):
        block = hf_config.get(key) or {}
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type == "default":
            continue
        if rope_type != "llama3":
            problems.append(
                f"{key}.rope_type={rope_type!r} (only plain RoPE and Llama-3.1 'llama3' scaling "
                "are mapped)"
            )
            return None
        for name, value in MEGATRON_LLAMA3_ROPE.items():
            if block.get(name) != value:
                problems.append(
                    f"{key}.{name}={block.get(name)} (megatron-core's llama3 RoPE scaling fixes "
                    f"{name}={value})"
                )
        if not isinstance(block.get("factor"), (int, float)):
            problems.append(
                f"{key}.factor={block.get('factor')} (llama3 RoPE scaling needs a number)"
            )
            return None
        return float(block["factor"])
    return None


def spec_from_hf(
    hf_config: dict, family: str = "llama", qkv_bias: bool = False, qk_norm: bool = False
) -> ModelSpec:
    """Read a Llama-architecture HF config dict; raise on features the Megatron model cannot
    express."""
    unsupported = []
    rope_scaling_factor = _rope_scaling(hf_config, unsupported)
    if hf_config.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if family == "llama" and hf_config.get("attention_bias"):
        unsupported.append("attention_bias=true (o_proj bias has no Megatron counterpart here)")
    if hf_config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf_config['hidden_act']!r} (SwiGLU needs 'silu')")
    if unsupported:
        raise ValueError(f"{family} config: unsupported feature(s): {'; '.join(unsupported)}")
    heads = hf_config["num_attention_heads"]
    rope = hf_config.get(
        "rope_theta", (hf_config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    return ModelSpec(
        family=family,
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        vocab_size=hf_config["vocab_size"],
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope),
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        rope_scaling_factor=rope_scaling_factor,
    )


def with_experts(
    spec: ModelSpec, num_experts, moe_ffn_hidden_size, topk, renormalize: bool, keys: str
) -> ModelSpec:
    """`spec` with a mixture of experts in every layer; `keys` names the HF config keys the
    numbers came from, for the error when one is missing or out of range."""
    numbers = (num_experts, moe_ffn_hidden_size, topk)
    if not all(isinstance(n, int) and n > 0 for n in numbers) or topk > num_experts:
        raise ValueError(
            f"{spec.family} config: {keys} = {', '.join(map(str, numbers))}: need positive integers "
            "with at most as many experts per token as experts"
        )
    return dataclasses.replace(
        spec,
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_router_topk=topk,
        moe_renormalize=renormalize,
    )


def transformer_config_kwargs(spec: ModelSpec) -> dict:
    """megatron.core TransformerConfig arguments reproducing the HF model exactly (no dropout, no
    fusions)."""
    import torch

    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        layernorm_epsilon=spec.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,  # the layer spec is built with the same flag (MegatronModule._layer_spec)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        **(moe_config_kwargs(spec) if spec.is_moe else {}),
    )


def moe_config_kwargs(spec: ModelSpec) -> dict:
    """The TransformerConfig arguments of the MoE layers (merged into transformer_config_kwargs
    for a MoE spec).

    Top-k over the router logits then a softmax over the k (= softmax over all experts
    renormalised over the top k: Mixtral, Qwen3-MoE with norm_topk_prob); without
    renormalisation, top-k of the softmax over all experts (Qwen3-MoE with norm_topk_prob false).
    No shared experts, no capacity limit (no token dropped)."""
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_router_pre_softmax=not spec.moe_renormalize,
        moe_router_score_function="softmax",
        moe_grouped_gemm=False,  # SequentialMLP: per-expert linear layers, the local spec's names
        moe_router_fusion=False,
        moe_permute_fusion=False,
    )


def gpt_model_kwargs(spec: ModelSpec) -> dict:
    """megatron.core GPTModel arguments (vocab_size is filled in padded by the caller)."""
    kwargs = dict(
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rotary_percent=1.0,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
    )
    if spec.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    return kwargs


@dataclasses.dataclass(frozen=True)
class MoENames:
    """Where a mixture-of-experts checkpoint keeps one layer's router and experts: HF names after
    "model.layers.{i}.", `{e}` = the expert number (e.g. Qwen3-MoE
    "mlp.experts.{e}.gate_proj.weight")."""

    router: str  # (num_experts, hidden)
    gate: str  # (moe_ffn, hidden) per expert
    up: str  # (moe_ffn, hidden) per expert
    down: str  # (hidden, moe_ffn) per expert


def moe_mappings(spec: ModelSpec, names: MoENames) -> list[ParamMapping]:
    """One MoE layer: the router (replicated: megatron's TopKRouter is not split over TP) and,
    per expert, the SwiGLU weights split over TP like a dense MLP's (megatron's expert tensor
    parallelism = TP)."""
    h, ffn, layer = spec.hidden_size, spec.moe_ffn_hidden_size, "model.layers.{i}."
    expert = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
    return [
        ParamMapping(
            "decoder.layers.{i}.mlp.router.weight",
            {layer + names.router: (spec.num_experts, h)},
            "replicated",
        ),
        ParamMapping(
            expert + "linear_fc1.weight",
            {layer + names.gate: (ffn, h), layer + names.up: (ffn, h)},
            "gate_up",
            expert=True,
        ),
        ParamMapping(
            expert + "linear_fc2.weight", {layer + names.down: (h, ffn)}, "row", expert=True
        ),
    ]


def param_mappings(
    spec: ModelSpec, moe: MoENames | None = None
) -> tuple[list[ParamMapping], list[ParamMapping]]:
    """(model-level mappings, per-layer mappings with `{i}`), in HF checkpoint order, each HF name once.
    moe: where a mixture-of-experts family's checkpoint keeps the router and experts (needed when the spec has
    experts)."""
    h, ffn, hd = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_query_groups * hd
    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    layer = [
        ParamMapping(
            "decoder.layers.{i}.input_layernorm.weight",
            {"model.layers.{i}.input_layernorm.weight": (h,)},
            "replicated",
        ),
        ParamMapping(
            "decoder.layers.{i}.self_attention.linear_qkv.weight",
            {
                attn + "q_proj.weight": (q, h),
                attn + "k_proj.weight": (kv, h),
                attn + "v_proj.weight": (kv, h),
            },
            "qkv",
        ),
    ]
    if spec.qkv_bias:
        layer.append(
            ParamMapping(
                "decoder.layers.{i}.self_attention.linear_qkv.bias",
                {
                    attn + "q_proj.bias": (q,),
                    attn + "k_proj.bias": (kv,),
                    attn + "v_proj.bias": (kv,),
                },
                "qkv",
            )
        )
    if spec.qk_norm:  # one RMSNorm of head_dim, shared by every head
        layer += [
            ParamMapping(
                "decoder.layers.{i}.self_attention.q_layernorm.weight",
                {attn + "q_norm.weight": (hd,)},
                "replicated",
            ),
            ParamMapping(
                "decoder.layers.{i}.self_attention.k_layernorm.weight",
                {attn + "k_norm.weight": (hd,)},
                "replicated",
            ),
        ]
    layer += [
        ParamMapping(
            "decoder.layers.{i}.self_attention.linear_proj.weight",
            {attn + "o_proj.weight": (h, q)},
            "row",
        ),
        ParamMapping(
            "decoder.layers.{i}.pre_mlp_layernorm.weight",
            {"model.layers.{i}.post_attention_layernorm.weight": (h,)},
            "replicated",
        ),
    ]
    if spec.is_moe:
        if moe is None:
            raise ValueError(
                f"{spec.family}: a mixture-of-experts spec needs its family's MoENames"
            )
        layer += moe_mappings(spec, moe)
    else:
        layer += [
            ParamMapping(
                "decoder.layers.{i}.mlp.linear_fc1.weight",
                {mlp + "gate_proj.weight": (ffn, h), mlp + "up_proj.weight": (ffn, h)},
                "gate_up",
            ),
            ParamMapping(
                "decoder.layers.{i}.mlp.linear_fc2.weight",
                {mlp + "down_proj.weight": (h, ffn)},
                "row",
            ),
        ]
    model = [
        ParamMapping(
            "embedding.word_embeddings.weight",
            {"model.embed_tokens.weight": (spec.vocab_size, h)},
            "vocab",
        ),
        ParamMapping("decoder.final_layernorm.weight", {"model.norm.weight": (h,)}, "replicated"),
    ]
    if not spec.tie_word_embeddings:
        model.append(
            ParamMapping("output_layer.weight", {"lm_head.weight": (spec.vocab_size, h)}, "vocab")
        )
    return model, layer
