"""Qwen3-MoE family (HF model_type "qwen3_moe", e.g. Qwen3-30B-A3B): Qwen3 (qwen3.py: QK-norm, no
biases) with a mixture of experts in place of every layer's MLP.

Each layer: a router `mlp.gate` (num_experts x hidden, no bias) and num_experts SwiGLU experts
`mlp.experts.{e}.gate_proj / up_proj / down_proj` of width moe_intermediate_size (the names
transformers saves and vLLM loads; transformers 5 fuses them in memory and splits them on save).
Each token goes to its num_experts_per_tok best experts: softmax over the router logits, top k,
renormalised to sum to 1 when `norm_topk_prob` (Qwen3-30B-A3B; transformers' default is false). The
expert count is `num_experts` in the Hub's config.json files and `num_local_experts` in what
transformers 5 writes; both are read. Refused: dense layers between the MoE ones (`mlp_only_layers`,
`decoder_sparse_step` > 1). `head_dim` defaults to hidden_size / num_attention_heads, as in
transformers' and vLLM's Qwen3-MoE (dense Qwen3 defaults to 128).

    spec = qwen3_moe.spec_from_hf(json.load(open("DIR/config.json")))
"""

from chatgen.models import llama, qwen3
from chatgen.models.llama import gpt_model_kwargs, transformer_config_kwargs  # noqa: F401
from chatgen.models.spec import ModelSpec

MOE = llama.MoENames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
)


def spec_from_hf(hf_config: dict) -> ModelSpec:
    unsupported = []
    if hf_config.get("mlp_only_layers"):
        unsupported.append(
            f"mlp_only_layers={hf_config['mlp_only_layers']} (dense layers among MoE layers are not "
            "mapped)"
        )
    if hf_config.get("decoder_sparse_step", 1) != 1:
        unsupported.append(
            f"decoder_sparse_step={hf_config['decoder_sparse_step']} (only an MoE MLP in every layer is "
            "mapped)"
        )
    if unsupported:
        raise ValueError(f"qwen3_moe config: unsupported feature(s): {'; '.join(unsupported)}")
    heads = hf_config["num_attention_heads"]
    spec = qwen3.spec_from_hf(
        {"head_dim": hf_config["hidden_size"] // heads, **hf_config}, family="qwen3_moe"
    )
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    return llama.with_experts(
        spec,
        experts,
        hf_config.get("moe_intermediate_size"),
        hf_config.get("num_experts_per_tok"),
        bool(hf_config.get("norm_topk_prob", False)),
        keys="num_experts, moe_intermediate_size, num_experts_per_tok",
    )


def param_mappings(spec: ModelSpec):
    return llama.param_mappings(spec, moe=MOE)
