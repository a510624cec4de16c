"""The tiny-model maker: spec validation, tokenizer properties, and that transformers loads the result."""

import json

import pytest
import torch

from chatgen import models
from chatgen.models import layout, tiny


def test_spec_rejects_unsupported_head_size_and_names_the_fix(tmp_path):
    path = tmp_path / "spec.yaml"
    # head size 16
    path.write_text("hidden_size: 64\nnum_attention_heads: 4\nnum_key_value_heads: 2\n")
    with pytest.raises(ValueError, match=r"(?s)spec.yaml.*head size 16 is not supported"):
        tiny.load_spec(path)


def test_spec_unknown_key_names_closest(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("num_hiden_layers: 3\n")
    with pytest.raises(
        ValueError,
        match=r"spec.yaml: num_hiden_layers: unknown key; did you mean 'num_hidden_layers'\?",
    ):
        tiny.load_spec(path)


def test_overrides_are_typed():
    spec = tiny.load_spec(
        None, ["num_hidden_layers=3", "tie_word_embeddings=true", "rope_theta=5e5"]
    )
    assert (
        spec.num_hidden_layers == 3 and spec.tie_word_embeddings is True and spec.rope_theta == 5e5
    )


def test_make_refuses_existing_output(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError, match="--output"):
        tiny.make_tiny_model(tiny.TinyModelSpec(), tmp_path / "m")


def test_tokenizer_splits_digits_and_roundtrips(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    text = "sort: 93 1207 = 0 1 2 3 7 9"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    digit_ids = [i for i in ids if tok.convert_ids_to_tokens(i).strip("▁").isdigit()]
    assert all(len(tok.convert_ids_to_tokens(i).strip("▁")) == 1 for i in digit_ids)
    assert len(tok) == tiny.TinyModelSpec().vocab_size


@pytest.mark.parametrize(
    "name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral"]
)
def test_transformers_loads_model_with_spec_shapes(make_tiny, name):
    from transformers import AutoModelForCausalLM

    path = make_tiny(name)
    spec = tiny.load_spec(path / "chatgen_tiny_model.yaml")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == spec.family and cfg["architectures"] == [type(model).__name__]
    state = model.state_dict()
    assert state["model.embed_tokens.weight"].shape == (spec.vocab_size, spec.hidden_size)
    kv_out = spec.num_key_value_heads * spec.head_dim
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (kv_out, spec.hidden_size)
    # Norms and biases are randomised so layout bugs cannot hide behind constants.
    assert not torch.allclose(state["model.norm.weight"], torch.ones(spec.hidden_size))
    if spec.family == "qwen2":
        assert state["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    # head_dim is its own dial here: q_proj is wider than the hidden size
    if spec.family == "qwen3":
        assert spec.head_dim * spec.num_attention_heads != spec.hidden_size
        assert state["model.layers.0.self_attn.q_proj.weight"].shape == (
            spec.num_attention_heads * spec.head_dim,
            spec.hidden_size,
        )
        for norm in ("q_norm", "k_norm"):
            weight = state[f"model.layers.0.self_attn.{norm}.weight"]
            assert weight.shape == (spec.head_dim,) and not torch.allclose(
                weight, torch.ones(spec.head_dim)
            )
    # MoE: the dials under transformers' names, one tensor per expert on disk
    if cfg.get("num_local_experts"):
        from safetensors import safe_open

        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (
            spec.num_experts,
            spec.num_experts_per_tok,
        )
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            saved = set(f.keys())
        hf_spec = models.spec_from_hf_config(cfg)
        assert saved == set(layout.hf_param_shapes(hf_spec))
        assert (
            hf_spec.num_experts == spec.num_experts
            and hf_spec.moe_router_topk == spec.num_experts_per_tok
        )
    else:  # a dense family's config never sees the MoE dials
        assert not {"num_local_experts", "num_experts", "moe_intermediate_size"} & set(cfg)
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model(torch.tensor([[1, 5, 9, 20]])).logits
    assert logits.shape == (1, 4, spec.vocab_size) and torch.isfinite(logits).all()


def test_spec_the_family_refuses_fails_before_building():
    with pytest.raises(
        ValueError, match=r"family: 'gpt2' is not supported; use one of \[.*'qwen3'.*\]"
    ):
        tiny.load_spec(None, ["family=gpt2"])
    # vLLM's Qwen2 ignores head_dim: the qwen2 family refuses one that differs from hidden_size / heads
    with pytest.raises(
        ValueError, match=r"family qwen2: qwen2 config: head_dim=64 is not supported"
    ):
        tiny.load_spec(None, ["family=qwen2", "head_dim=64"])
    assert tiny.load_spec(None, ["family=qwen3", "head_dim=64"]).head_dim == 64
