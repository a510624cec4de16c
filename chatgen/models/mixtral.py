"""Mixtral family (HF model_type "mixtral", e.g. Mixtral-8x7B): Llama's attention (grouped-query,
RoPE, no biases) with a mixture of experts in place of every layer's MLP.

Each layer: a router `block_sparse_moe.gate` (num_local_experts x hidden, no bias) and
num_local_experts SwiGLU experts `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down),
each intermediate_size wide (the names transformers saves and vLLM loads). Each token goes to its
num_experts_per_tok best experts, weighted by a softmax over their router logits (the top-k
probabilities renormalised). `router_jitter_noise` is transformers' training-time noise, applied by
neither the trainer nor vLLM. Refused: sliding-window attention.

    spec = mixtral.spec_from_hf(json.load(open("DIR/config.json")))
"""

from chatgen.models import llama
from chatgen.models.llama import gpt_model_kwargs, transformer_config_kwargs  # noqa: F401
from chatgen.models.spec import ModelSpec

MOE = llama.MoENames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
)


def spec_from_hf(hf_config: dict) -> ModelSpec:
    if hf_config.get("sliding_window") is not None:
        raise ValueError(
            f"mixtral config: sliding_window={hf_config['sliding_window']} is not supported (Megatron "
            "attends to the full context); set it to null"
        )
    spec = llama.spec_from_hf(hf_config, family="mixtral")
    return llama.with_experts(
        spec,
        hf_config.get("num_local_experts"),
        hf_config.get("intermediate_size"),
        hf_config.get("num_experts_per_tok"),
        True,
        keys="num_local_experts, intermediate_size, num_experts_per_tok",
    )


def param_mappings(spec: ModelSpec):
    return llama.param_mappings(spec, moe=MOE)
