"""HF <-> Megatron conversion (chatgen/models/layout.py, chatgen/models/llama.py, qwen2.py, qwen3.py, qwen3_moe.py):
pure tensors.

    python -m pytest tests/unit/test_convert.py
"""

import pytest
import torch
from helpers import MOE_CONFIG, make_spec, random_hf_state

from chatgen import models
from chatgen.models import layout, llama, qwen2, qwen3, qwen3_moe

LAYOUTS = [  # (family, heads, groups, tied, tp, pp)
    ("llama", 4, 2, False, 1, 1),
    ("llama", 4, 2, False, 2, 1),
    ("llama", 4, 2, False, 2, 2),
    ("llama", 4, 1, False, 2, 1),  # num_query_groups < TP
    ("llama", 8, 2, False, 4, 2),  # num_query_groups < TP, PP
    ("llama", 4, 4, True, 4, 4),  # tied embeddings across 4 stages
    ("qwen2", 4, 2, True, 2, 2),  # QKV bias + tied + PP
    ("qwen2", 4, 1, False, 4, 1),  # QKV bias with num_query_groups < TP
    ("qwen3", 4, 2, False, 1, 1),  # QK-norm, head_dim * heads != hidden_size
    ("qwen3", 4, 2, False, 2, 1),
    ("qwen3", 4, 2, True, 2, 2),  # QK-norm + tied + PP
    ("qwen3", 4, 1, True, 2, 2),  # QK-norm with num_query_groups < TP
    ("qwen3_moe", 4, 2, False, 1, 1),  # router + 4 experts per layer
    ("qwen3_moe", 4, 2, False, 2, 2),  # experts split over TP, layers over PP
    ("qwen3_moe", 4, 1, True, 4, 1),
    ("mixtral", 4, 2, True, 2, 2),
]


@pytest.mark.parametrize("family,heads,groups,tied,tp,pp", LAYOUTS)
def test_round_trip_is_bit_exact(family, heads, groups, tied, tp, pp):
    spec = make_spec(family, heads, groups, tied=tied, hidden=24 if family == "qwen3" else None)
    hf = random_hf_state(spec)
    padded = spec.padded_vocab_size(tp, divisible_by=16)
    shards = layout.hf_to_megatron(hf, spec, tp, pp, padded)
    assert sorted(shards) == [(p, t) for p in range(pp) for t in range(tp)]
    back = layout.megatron_to_hf(shards, spec, tp, pp)
    assert list(back) == list(hf) or sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_padded_vocab_rows_are_zero_and_split_evenly():
    spec = make_spec(vocab=250)
    padded = spec.padded_vocab_size(2, divisible_by=128)
    assert padded == 256
    shards = layout.hf_to_megatron(random_hf_state(spec), spec, tp=2, pp=1, padded_vocab=padded)
    emb = torch.cat([shards[(0, t)]["embedding.word_embeddings.weight"] for t in range(2)])
    assert (
        emb.shape[0] == 256 and shards[(0, 0)]["embedding.word_embeddings.weight"].shape[0] == 128
    )
    assert torch.all(emb[250:] == 0)


def test_qkv_interleaves_per_query_group():
    # 4 query heads, 2 groups, head_dim 1: rows labelled by head id
    spec = make_spec(heads=4, groups=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k, v = torch.tensor([[20.0], [21.0]]), torch.tensor([[30.0], [31.0]])
    fused = layout.qkv_to_megatron(q, k, v, spec.num_query_groups)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # TP=2 with 2 groups: each rank holds one whole group
    shards = layout.to_megatron_shards("qkv", [q, k, v], spec, tp=2, padded_vocab=0)
    assert [s.flatten().tolist() for s in shards] == [[10, 11, 20, 30], [12, 13, 21, 31]]


def test_gate_up_rank_holds_its_gate_and_up_slices():
    spec = make_spec()
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(10.0, 14.0).view(4, 1)
    shards = layout.to_megatron_shards("gate_up", [gate, up], spec, tp=2, padded_vocab=0)
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]


def test_stage_params_offsets_layers_and_tied_copy():
    spec = make_spec(tied=True, layers=4)
    last = layout.stage_params(spec, pp=2, pp_rank=1)
    names = {p.local_name: p for p in last}
    assert names["decoder.layers.0.input_layernorm.weight"].hf_names == (
        "model.layers.2.input_layernorm.weight",
    )
    assert (
        names["output_layer.weight"].duplicate and "embedding.word_embeddings.weight" not in names
    )
    first = {p.local_name for p in layout.stage_params(spec, pp=2, pp_rank=0)}
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first


def test_qwen2_maps_qkv_bias_and_llama_does_not():
    assert any(
        m.megatron.endswith("linear_qkv.bias") for m in qwen2.param_mappings(make_spec("qwen2"))[1]
    )
    assert not any(m.megatron.endswith("bias") for m in llama.param_mappings(make_spec("llama"))[1])


def test_qwen2_head_dim_vllm_would_ignore_is_refused():
    cfg = dict(
        model_type="qwen2",
        num_hidden_layers=1,
        hidden_size=128,
        intermediate_size=8,
        num_attention_heads=4,
        vocab_size=8,
    )
    # = hidden_size / heads: fine
    assert models.spec_from_hf_config(dict(cfg, head_dim=32)).head_dim == 32
    with pytest.raises(
        ValueError, match="head_dim=64 is not supported: vLLM's Qwen2 ignores head_dim"
    ):
        models.spec_from_hf_config(dict(cfg, head_dim=64))


def test_qwen3_maps_qk_norm_replicated_per_head_and_megatron_gets_qk_layernorm():
    spec = make_spec("qwen3", heads=4, groups=2, head_dim=8, hidden=24)
    assert spec.qk_norm and not spec.qkv_bias and spec.head_dim == 8 and spec.hidden_size == 24
    layer = {m.megatron: m for m in qwen3.param_mappings(spec)[1]}
    for side in ("q", "k"):
        m = layer[f"decoder.layers.{{i}}.self_attention.{side}_layernorm.weight"]
        assert (
            m.hf == {f"model.layers.{{i}}.self_attn.{side}_norm.weight": (8,)}
            and m.kind == "replicated"
        )
    assert layer["decoder.layers.{i}.self_attention.linear_qkv.weight"].hf[
        "model.layers.{i}.self_attn.q_proj.weight"
    ] == (32, 24)
    kwargs = qwen3.transformer_config_kwargs(spec)
    assert (
        kwargs["qk_layernorm"] is True and kwargs["kv_channels"] == 8 and not kwargs["add_qkv_bias"]
    )
    assert not any(
        "layernorm" in m.megatron and "self_attention" in m.megatron
        for m in llama.param_mappings(make_spec("llama"))[1]
    )
    # TP 2: both ranks hold the whole (replicated) norm weight
    hf = random_hf_state(spec)
    shards = layout.hf_to_megatron(hf, spec, tp=2, pp=1, padded_vocab=256)
    for t in range(2):
        assert torch.equal(
            shards[(0, t)]["decoder.layers.0.self_attention.k_layernorm.weight"],
            hf["model.layers.0.self_attn.k_norm.weight"],
        )


def test_qwen3_head_dim_defaults_like_transformers():
    # transformers' Qwen3Config.head_dim is 128 when config.json leaves it out (not hidden_size / heads)
    cfg = dict(
        model_type="qwen3",
        num_hidden_layers=1,
        hidden_size=256,
        intermediate_size=8,
        num_attention_heads=4,
        vocab_size=8,
    )
    assert models.spec_from_hf_config(cfg).head_dim == 128


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("attention_bias", True, "attention_bias=true"),
        ("use_sliding_window", True, "use_sliding_window=true"),
        (
            "layer_types",
            ["full_attention", "sliding_attention"],
            "layer_types ['sliding_attention']",
        ),
        (
            "rope_parameters",
            {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            "rope_parameters.rope_type='yarn'",
        ),
    ],
)
def test_qwen3_features_megatron_cannot_express_are_refused(key, value, needle):
    cfg = dict(
        model_type="qwen3",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=8,
        num_attention_heads=4,
        head_dim=8,
        vocab_size=8,
        **{key: value},
    )
    with pytest.raises(ValueError, match="qwen3 config: unsupported feature") as err:
        models.spec_from_hf_config(cfg)
    assert needle in str(err.value)


def test_layout_that_does_not_fit_names_every_problem():
    spec = make_spec(heads=6, groups=3, head_dim=8, layers=3)
    with pytest.raises(ValueError) as err:
        layout.hf_to_megatron(random_hf_state(spec), spec, tp=4, pp=2, padded_vocab=256)
    for needle in ("num_attention_heads=6", "num_key_value_heads=3", "must divide num_layers=3"):
        assert needle in str(err.value)


# Llama-3.1-8B-Instruct's config.json
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "rope",
    [  # config.json as transformers 4.x / 5.x write it
        dict(rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE, factor=32.0)),
        dict(rope_parameters=dict(LLAMA31_ROPE, factor=32.0, rope_theta=500000.0)),
    ],
)
def test_llama3_rope_scaling_maps_to_megatron(rope):
    spec = llama.spec_from_hf(
        dict(
            num_hidden_layers=1,
            hidden_size=8,
            intermediate_size=8,
            num_attention_heads=1,
            vocab_size=8,
            **rope,
        )
    )
    assert spec.rope_theta == 500000.0 and spec.rope_scaling_factor == 32.0
    kwargs = llama.gpt_model_kwargs(spec)
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 32.0
    assert "rope_scaling" not in llama.gpt_model_kwargs(make_spec())


@pytest.mark.parametrize(
    "key, value",
    [
        ("original_max_position_embeddings", 64),
        ("low_freq_factor", 2.0),
        ("high_freq_factor", None),
    ],
)
def test_llama3_rope_scaling_megatron_cannot_express_is_refused(key, value):
    with pytest.raises(ValueError, match=f"rope_parameters.{key}={value} .*fixes {key}="):
        llama.spec_from_hf(
            dict(
                num_hidden_layers=1,
                hidden_size=8,
                intermediate_size=8,
                num_attention_heads=1,
                vocab_size=8,
                rope_parameters=dict(LLAMA31_ROPE, **{key: value}),
            )
        )


def test_unsupported_config_features_raise():
    with pytest.raises(ValueError, match="rope_scaling"):
        llama.spec_from_hf(
            dict(
                num_hidden_layers=1,
                hidden_size=8,
                intermediate_size=8,
                num_attention_heads=1,
                vocab_size=8,
                rope_scaling={"rope_type": "yarn", "factor": 4.0},
            )
        )
    with pytest.raises(ValueError, match="rope_parameters.rope_type='linear'"):
        llama.spec_from_hf(
            dict(
                num_hidden_layers=1,
                hidden_size=8,
                intermediate_size=8,
                num_attention_heads=1,
                vocab_size=8,
                rope_parameters={"rope_type": "linear", "factor": 2.0},
            )
        )
    with pytest.raises(ValueError, match="not supported"):
        models.spec_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="must divide num_layers"):
        layout.stage_params(make_spec(layers=3), pp=2, pp_rank=0)


def test_moe_layer_maps_router_replicated_and_each_expert_like_a_dense_mlp():
    spec = make_spec("qwen3_moe")
    assert (
        spec.num_experts,
        spec.moe_ffn_hidden_size,
        spec.moe_router_topk,
        spec.moe_renormalize,
    ) == (4, 16, 2, False)
    layer = {m.megatron: m for m in qwen3_moe.param_mappings(spec)[1]}
    assert "decoder.layers.{i}.mlp.linear_fc1.weight" not in layer  # no dense MLP
    router = layer["decoder.layers.{i}.mlp.router.weight"]
    assert (
        router.hf == {"model.layers.{i}.mlp.gate.weight": (4, spec.hidden_size)}
        and router.kind == "replicated"
    )
    fc1 = layer["decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
    assert (
        fc1.expert
        and fc1.kind == "gate_up"
        and list(fc1.hf)
        == [
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        ]
    )
    kwargs = qwen3_moe.transformer_config_kwargs(spec)
    assert (
        kwargs["num_moe_experts"],
        kwargs["moe_ffn_hidden_size"],
        kwargs["moe_router_topk"],
    ) == (4, 16, 2)
    # norm_topk_prob false: top k of the softmax over all experts
    assert kwargs["moe_router_pre_softmax"] is True
    assert "num_moe_experts" not in llama.transformer_config_kwargs(make_spec())
    # the Hub's config.json says num_experts, transformers 5 writes num_local_experts; norm_topk_prob renormalises
    hub = dict(
        model_type="qwen3_moe",
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=8,
        num_attention_heads=4,
        vocab_size=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        norm_topk_prob=True,
    )
    spec = models.spec_from_hf_config(hub)
    # hidden / heads, not qwen3's 128
    assert spec.num_experts == 8 and spec.moe_renormalize and spec.head_dim == 8
    assert qwen3_moe.transformer_config_kwargs(spec)["moe_router_pre_softmax"] is False


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("mlp_only_layers", [0], "mlp_only_layers=[0]"),
        ("decoder_sparse_step", 2, "decoder_sparse_step=2"),
        (
            "num_experts_per_tok",
            8,
            "need positive integers with at most as many experts per token as experts",
        ),
        (
            "moe_intermediate_size",
            None,
            "num_experts, moe_intermediate_size, num_experts_per_tok = 4, None, 2",
        ),
    ],
)
def test_qwen3_moe_features_megatron_cannot_express_are_refused(key, value, needle):
    cfg = dict(
        model_type="qwen3_moe",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=8,
        num_attention_heads=4,
        vocab_size=8,
        **dict(MOE_CONFIG["qwen3_moe"], **{key: value}),
    )
    with pytest.raises(ValueError, match="qwen3_moe config: ") as err:
        models.spec_from_hf_config(cfg)
    assert needle in str(err.value)


def test_expert_parallel_rank_holds_its_experts_under_local_numbers():
    spec = make_spec("qwen3_moe", layers=2)
    second = {
        sp.local_name: sp for sp in layout.stage_params(spec, pp=2, pp_rank=1, ep=2, ep_rank=1)
    }
    # stage 1 holds layer 1 as local layer 0; EP rank 1 holds experts 2, 3 as local experts 0, 1
    fc2 = second["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert fc2.hf_names == ("model.layers.1.mlp.experts.3.down_proj.weight",) and fc2.expert == 3
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in second
    # the router: on every EP rank
    assert second["decoder.layers.0.mlp.router.weight"].expert is None
    # EP = 1 (a checkpoint's layout): every expert under its global number
    names = {sp.local_name for sp in layout.stage_params(spec, pp=1, pp_rank=0)}
    assert {
        f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(4)
    } <= names


def test_expert_parallel_layout_that_does_not_fit_is_refused():
    with pytest.raises(ValueError) as err:
        layout.check_layout(make_spec("qwen3_moe"), tp=3, pp=1, ep=3)
    assert "EP=3" in str(err.value) and "must divide the 4 experts" in str(err.value)
    assert "experts' intermediate size 16 is not divisible by TP=3" in str(err.value)
    with pytest.raises(ValueError, match="a model without experts needs 1"):
        layout.check_layout(make_spec(), tp=1, pp=1, ep=2)
    layout.check_layout(make_spec("qwen3_moe"), tp=2, pp=2, ep=4)


def test_mixtral_maps_its_checkpoint_names_and_renormalises():
    spec = make_spec("mixtral")
    assert (spec.num_experts, spec.moe_ffn_hidden_size, spec.moe_renormalize, spec.qk_norm) == (
        4,
        48,
        True,
        False,
    )
    hf = set(layout.hf_param_shapes(spec))
    assert {
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.3.block_sparse_moe.experts.3.w3.weight",
    } <= hf
    assert models.family(spec).transformer_config_kwargs(spec)["moe_router_pre_softmax"] is False
    with pytest.raises(ValueError, match="mixtral config: sliding_window=4096 is not supported"):
        models.spec_from_hf_config(
            dict(
                model_type="mixtral",
                num_hidden_layers=1,
                hidden_size=8,
                intermediate_size=8,
                num_attention_heads=1,
                vocab_size=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                sliding_window=4096,
            )
        )
