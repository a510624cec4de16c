"""`chatgen convert` both ways on a random HF directory: HF -> Megatron (TP x PP) -> HF is bit-exact.

python -m pytest tests/unit/test_convert_cli.py
"""

import json

import pytest
import torch
from helpers import make_spec, random_hf_state
from safetensors.torch import load_file, save_file

from chatgen import models
from chatgen.cli import main
from chatgen.models import layout


@pytest.fixture
def hf_dir(tmp_path):
    spec = make_spec("qwen2", heads=4, groups=2, layers=4, vocab=250, tied=False)
    config = dict(
        model_type="qwen2",
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=250,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer_config.json").write_text("{}")
    save_file(random_hf_state(spec), str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)])
def test_convert_round_trip_is_bit_exact(hf_dir, tmp_path, tp, pp):
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert (
        main(
            [
                "convert",
                "--to",
                "megatron",
                "--input",
                str(hf_dir),
                "--output",
                str(meg),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--make-vocab-size-divisible-by",
                "16",
            ]
        )
        == 0
    )
    meta = json.loads((meg / "chatgen_megatron.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (tp, pp)
    assert (
        meta["padded_vocab_size"] == 256
        and len(list(meg.glob("model_tp*_pp*.safetensors"))) == tp * pp
    )
    shard = load_file(str(meg / "model_tp0_pp0.safetensors"))
    assert shard["embedding.word_embeddings.weight"].shape == (256 // tp, 32)
    assert main(["convert", "--to", "hf", "--input", str(meg), "--output", str(back)]) == 0
    original, restored = (
        load_file(str(hf_dir / "model.safetensors")),
        load_file(str(back / "model.safetensors")),
    )
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[k], restored[k]) for k in original)
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (back / "tokenizer_config.json").exists()
    # no ids given
    assert json.loads((back / "generation_config.json").read_text()) == {"_from_model_config": True}


def test_convert_refuses_existing_output_and_bad_layout(hf_dir, tmp_path, capsys):
    assert (
        main(["convert", "--to", "megatron", "--input", str(hf_dir), "--output", str(hf_dir)]) == 2
    )
    assert "exists" in capsys.readouterr().err
    # bad input: chatgen.cli prints one line naming it and returns 2 (no traceback); nothing is written
    assert (
        main(
            [
                "convert",
                "--to",
                "megatron",
                "--input",
                str(hf_dir),
                "--output",
                str(tmp_path / "x"),
                "--tp",
                "3",
            ]
        )
        == 2
    )
    assert "TP=3" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert (
        main(["convert", "--to", "hf", "--input", str(hf_dir), "--output", str(tmp_path / "y")])
        == 2
    )
    assert (
        "not a chatgen Megatron checkpoint" in capsys.readouterr().err
        and not (tmp_path / "y").exists()
    )


def test_convert_tiny_qwen3_both_ways(tiny_qwen3_dir, tmp_path):
    """A transformers-written Qwen3 (QK-norm, head_dim != hidden / heads, tied) through TP 2 x PP 2 and back."""
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert (
        main(
            [
                "convert",
                "--to",
                "megatron",
                "--input",
                str(tiny_qwen3_dir),
                "--output",
                str(meg),
                "--tp",
                "2",
                "--pp",
                "2",
            ]
        )
        == 0
    )
    # layer 1 as local layer 0, tied output copy
    last = load_file(str(meg / "model_tp1_pp1.safetensors"))
    original = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    assert torch.equal(
        last["decoder.layers.0.self_attention.q_layernorm.weight"],
        original["model.layers.1.self_attn.q_norm.weight"],
    )
    assert "output_layer.weight" in last and "lm_head.weight" not in original
    assert main(["convert", "--to", "hf", "--input", str(meg), "--output", str(back)]) == 0
    restored = load_file(str(back / "model.safetensors"))
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[k], restored[k]) for k in original)


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_convert_tiny_moe_both_ways(make_tiny, tmp_path, name):
    """A transformers-written MoE model (one tensor per expert on disk) through TP 2 x PP 2 and back, bit-exact."""
    hf_dir, meg, back = make_tiny(name), tmp_path / "meg", tmp_path / "back"
    assert (
        main(
            [
                "convert",
                "--to",
                "megatron",
                "--input",
                str(hf_dir),
                "--output",
                str(meg),
                "--tp",
                "2",
                "--pp",
                "2",
            ]
        )
        == 0
    )
    # layer 1 as local layer 0, TP rank 1's halves
    last = load_file(str(meg / "model_tp1_pp1.safetensors"))
    original = load_file(str(hf_dir / "model.safetensors"))
    spec = models.spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    down = next(
        sp
        for sp in layout.stage_params(spec, pp=2, pp_rank=1)  # the last expert's down projection
        if sp.expert == spec.num_experts - 1 and sp.kind == "row"
    )
    assert torch.equal(last[down.local_name], original[down.hf_names[0]].chunk(2, dim=1)[1])
    assert main(["convert", "--to", "hf", "--input", str(meg), "--output", str(back)]) == 0
    restored = load_file(str(back / "model.safetensors"))
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[k], restored[k]) for k in original)


def test_convert_to_hf_carries_tokenizer_and_generation_config_or_refuses(
    tiny_llama_dir, tmp_path, capsys
):
    """The export loads with AutoTokenizer as the source did (not an empty tokenizer) and has a
    generation_config.json; a checkpoint without tokenizer files is refused naming --tokenizer, and with
    --tokenizer it takes that directory's."""
    import shutil

    from transformers import AutoTokenizer

    meg, back = tmp_path / "meg", tmp_path / "back"
    assert (
        main(["convert", "--to", "megatron", "--input", str(tiny_llama_dir), "--output", str(meg)])
        == 0
    )
    assert main(["convert", "--to", "hf", "--input", str(meg), "--output", str(back)]) == 0
    source, exported = (
        AutoTokenizer.from_pretrained(tiny_llama_dir),
        AutoTokenizer.from_pretrained(back),
    )
    assert len(exported) == len(source) > 1 and exported.encode("hello world") == source.encode(
        "hello world"
    )
    assert (
        json.loads((back / "generation_config.json").read_text())["eos_token_id"]
        == source.eos_token_id
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("chatgen_megatron.json", "model_tp0_pp0.safetensors"):
        shutil.copy(meg / f, bare / f)
    assert (
        main(["convert", "--to", "hf", "--input", str(bare), "--output", str(tmp_path / "x")]) == 2
    )
    assert "--tokenizer DIR" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert (
        main(
            [
                "convert",
                "--to",
                "hf",
                "--input",
                str(bare),
                "--output",
                str(tmp_path / "y"),
                "--tokenizer",
                str(tiny_llama_dir),
            ]
        )
        == 0
    )
    assert AutoTokenizer.from_pretrained(tmp_path / "y").encode("hello") == source.encode("hello")
    config = json.loads((tmp_path / "y" / "generation_config.json").read_text())
    assert config == json.loads((tiny_llama_dir / "generation_config.json").read_text())
