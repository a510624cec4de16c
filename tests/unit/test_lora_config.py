"""The `lora:` keys of a trainer model and the LoRA targets of each family: bad input is refused naming the key and
the fix; a target maps onto the Megatron linear that holds it. pytest tests/unit/test_lora_config.py"""

import re

import pytest
from helpers import make_spec

from chatgen.config import ConfigError, load_model_config
from chatgen.training import lora
from chatgen.training.config import LoRAConfig, MegatronConfig


def load(tmp_path, text):
    path = tmp_path / "trainer.yaml"
    path.write_text("load: /models/tiny\n" + text)
    return load_model_config(path, MegatronConfig)


def test_lora_is_off_by_default_and_reads_its_keys(tmp_path):
    assert load(tmp_path, "").lora.rank == 0
    cfg = load(tmp_path, "lora:\n  rank: 8\n  alpha: 16\n  target_modules: [q_proj, v_proj]\n").lora
    assert (cfg.rank, cfg.alpha, cfg.target_modules) == (8, 16.0, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("rank: -1", "lora.rank: must be > 0 (or 0 = no LoRA), got -1"),
        ("rank: 8\n  alpha: 0", "lora.alpha: must be > 0, got 0.0; 2 x rank (e.g. 16)"),
        ("rank: 8\n  dropout: 1.5", "lora.dropout: must be in [0, 1), got 1.5"),
        (
            "rank: 8\n  target_modules: [qkv_proj]",
            "lora.target_modules: ['qkv_proj']: not a LoRA",
        ),
        ("rank: 8\n  target_modules: []", "lora.target_modules: is empty"),
        ("rank: 8\n  alpah: 16", "lora.alpah: unknown key; did you mean 'alpha'"),
    ],
)
def test_bad_lora_keys_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(tmp_path, f"lora:\n  {text}\n")


def test_lora_with_sequence_parallel_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="lora: LoRA with sequence_parallel is not supported"):
        load(tmp_path, "tensor_model_parallel_size: 2\nsequence_parallel: true\nlora:\n  rank: 4\n")


def test_targets_map_onto_megatrons_fused_linears():
    targets = lora.family_targets(make_spec("llama", heads=4, groups=2, head_dim=8))
    assert list(targets) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    q, o, up, down = (targets[n] for n in ("q_proj", "o_proj", "up_proj", "down_proj"))
    assert (q.module, q.kind, q.slot, q.out_features, q.in_features) == (
        "self_attention.linear_qkv", "qkv", 0, 32, 32
    )  # fmt: skip
    assert (targets["v_proj"].slot, targets["v_proj"].out_features) == (2, 16)  # 2 groups x 8
    assert (o.module, o.kind) == ("self_attention.linear_proj", "row")
    assert (up.module, up.kind, up.slot, up.out_features) == ("mlp.linear_fc1", "gate_up", 1, 48)
    assert (down.module, down.kind, down.in_features) == ("mlp.linear_fc2", "row", 48)
    assert q.hf_weight == "model.layers.{i}.self_attn.q_proj.weight"


def test_a_target_the_family_does_not_have_is_refused():
    spec = make_spec("mixtral")  # the MLP is experts: no dense gate/up/down
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['gate_proj'\] is not a linear"):
        lora.check_targets(LoRAConfig(rank=4, target_modules=["q_proj", "gate_proj"]), spec, tp=1)
    assert list(lora.check_targets(LoRAConfig(rank=4, target_modules=["q_proj"]), spec, 1)) == [
        "q_proj"
    ]


def test_qkv_targets_need_whole_query_groups_per_tp_rank():
    spec = make_spec("llama", heads=4, groups=1)
    cfg = LoRAConfig(rank=4, target_modules=["k_proj", "o_proj"])
    with pytest.raises(ConfigError, match="num_key_value_heads=1; drop q_proj, k_proj and v_proj"):
        lora.check_targets(cfg, spec, tp=2)
    assert list(lora.check_targets(cfg, spec, tp=1)) == ["k_proj", "o_proj"]


@pytest.mark.parametrize("kind, matrix, axis", [("qkv", "lora_B", 0), ("row", "lora_A", 1)])
def test_tp_split_follows_the_base_weight(kind, matrix, axis):
    import torch

    t = lora.Target("x", "m", kind, 0, "w", 8, 6)
    full = (
        torch.arange(48.0).reshape(8, 6) if matrix == "lora_B" else torch.arange(48.0).reshape(6, 8)
    )
    shards = [lora.tp_split(t, matrix, full, 2, r) for r in range(2)]
    assert torch.equal(torch.cat(shards, dim=axis), full) and lora.tp_axis(t, matrix) == axis
    other = "lora_A" if matrix == "lora_B" else "lora_B"
    assert lora.tp_split(t, other, full, 2, 1) is full and lora.tp_axis(t, other) is None


def test_trainable_share_counts_every_layer():
    spec = make_spec("llama", layers=4)
    targets = lora.family_targets(spec)
    stats = lora.counts(spec, targets, rank=2)
    per_layer = sum(2 * (t.in_features + t.out_features) for t in targets.values())
    assert stats["trainable"] == 4 * per_layer and 0 < stats["share"] < 1


def test_a_resume_that_changes_the_lora_keys_is_refused(tmp_path):
    """The checkpoint holds adapters of its rank, targets and scale: a resume keeps the `lora` section."""
    import dataclasses
    from types import SimpleNamespace

    from chatgen.rlhf.run import Run

    entry = SimpleNamespace(
        config=MegatronConfig(load="x", lora=LoRAConfig(rank=4)), trainable=True
    )
    run = SimpleNamespace(cfg=SimpleNamespace(models={"policy_trainer": entry}))
    saved = {
        "models": {"policy_trainer": {"config": {"lora": dataclasses.asdict(LoRAConfig(rank=4))}}}
    }
    Run._check_restored_keys(run, saved, tmp_path)  # unchanged: resumes
    saved["models"]["policy_trainer"]["config"]["lora"]["rank"] = 8
    with pytest.raises(ConfigError, match="models.policy_trainer.config.lora: .*'rank': 8.* -> "):
        Run._check_restored_keys(run, saved, tmp_path)


def load_chatlearn(tmp_path, text):
    from chatgen.compat.chatlearn import dialect

    path = tmp_path / "trainer.yaml"
    path.write_text("load: /models/tiny\nnum_layers: 24\n" + text)  # num_layers: a Megatron-LM key
    return load_model_config(path, MegatronConfig, dialect=dialect("chatlearn"))


def test_chatlearn_lora_keys_map_onto_ours(tmp_path):
    """ChatLearn's LoraConfig in the chatlearn dialect: lora_dim -> rank, lora_scaling -> alpha / rank, lora_layer
    classes -> the HF targets they hold, column_only_qkv -> q/k/v only; enable_lora false -> no LoRA."""
    text = (
        "lora:\n  enable_lora: true\n  lora_dim: 4\n  lora_scaling: 2.0\n  lora_dropout: 0.05\n"
        "  lora_layer: ColumnParallelLinear,RowParallelLinear\n"
    )
    cfg = load_chatlearn(tmp_path, text).lora
    assert (cfg.rank, cfg.alpha, cfg.dropout) == (4, 8.0, 0.05)
    assert cfg.target_modules == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    cfg = load_chatlearn(tmp_path, "lora:\n  enable_lora: true\n  lora_layer: RowParallelLinear\n")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (
        8,
        8.0,
        ["o_proj", "down_proj"],
    )
    qkv = load_chatlearn(tmp_path, "lora:\n  enable_lora: true\n  column_only_qkv: true\n").lora
    assert qkv.target_modules == ["q_proj", "k_proj", "v_proj"]  # ChatLearn's default lora_layer
    assert load_chatlearn(tmp_path, "lora:\n  enable_lora: false\n  lora_dim: 4\n").lora.rank == 0
    # chatgen's own keys still read in the dialect
    assert load_chatlearn(tmp_path, "lora:\n  rank: 2\n  alpha: 4\n").lora.rank == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("part_module_name: encoder", "lora.part_module_name: 'encoder' has no chatgen meaning"),
        (
            "lora_layer: ColumnParallelLinear,Embedding",
            r"\['Embedding'\]: chatgen adapts linear layers only",
        ),
        (
            "lora_layer: Conv1D",
            r"lora.lora_layer: \['Conv1D'\] are not ChatLearn LoRA layer classes",
        ),
        ("lora_dim: 4\n  rank: 4", "lora.rank: not a key of ChatLearn's lora section"),
    ],
)
def test_chatlearn_lora_keys_that_cannot_map_are_refused_by_name(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_chatlearn(tmp_path, f"lora:\n  enable_lora: true\n  {text}\n")
