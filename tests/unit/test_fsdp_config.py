"""The fsdp trainer's config (chatgen.training.config.FSDPConfig) and its registration as `backend: fsdp`:
what it refuses before any model starts, each naming the key and the fix.

    python -m pytest tests/unit/test_fsdp_config.py
"""

import json
from pathlib import Path

import pytest

from chatgen.config import ConfigError
from chatgen.training.config import MEGATRON_ONLY, FSDPConfig, hf_family_problem

REPO = Path(__file__).resolve().parents[2]


def load_fsdp(data: dict):
    from chatgen.config import load_model_config

    return load_model_config(None, FSDPConfig, data)


@pytest.mark.parametrize(
    "key, value",
    [
        ("tensor_model_parallel_size", 2),
        ("pipeline_model_parallel_size", 2),
        ("expert_model_parallel_size", 2),
        ("moe_routing_replay", True),
        ("grad_reduce_dtype", "float32"),
    ],
)
def test_a_megatron_only_key_is_refused_naming_the_key_and_the_fix(key, value):
    with pytest.raises(ConfigError) as e:
        load_fsdp({key: value})
    message = str(e.value)
    assert key in message and "backend: megatron" in message and "remove the key" in message
    assert key in MEGATRON_ONLY


def test_selective_recompute_is_refused_full_recompute_and_lora_are_not():
    with pytest.raises(ConfigError, match="activation_recompute.*set full"):
        load_fsdp({"activation_recompute": "selective"})
    assert (
        load_fsdp({"lora": {"rank": 4}}).lora.rank == 4
    )  # through PEFT: chatgen/training/fsdp_lora.py
    assert load_fsdp({"activation_recompute": "full"}).activation_recompute == "full"
    # the keys the recipes share with Megatron, at the values fsdp runs: accepted
    assert load_fsdp({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}).dtype


def _model_dir(tmp_path, model_type):
    out = tmp_path / model_type
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


@pytest.mark.parametrize(
    "model_type, says",
    [
        # transformers has it, vLLM's CPU path does not serve it
        ("deepseek_v3", "latent attention"),
        ("not_a_family", "no causal LM in transformers"),
        # its experts fused on load: not the checkpoint's names
        ("mixtral", "renamed by transformers"),
    ],
)
def test_a_family_that_cannot_sync_is_refused_by_name_before_start(tmp_path, model_type, says):
    load = _model_dir(tmp_path, model_type)
    problem = hf_family_problem(load)
    assert problem is not None and repr(model_type) in problem and says in problem
    with pytest.raises(ConfigError, match=f"load: .*{model_type}"):
        load_fsdp({"load": str(load)})


@pytest.mark.parametrize(
    "model_type",
    ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "olmo2", "smollm3", "gpt_oss"],
)
def test_the_tested_families_are_accepted(tmp_path, model_type):
    assert hf_family_problem(_model_dir(tmp_path, model_type)) is None


def test_backend_fsdp_in_a_main_yaml_runs_fsdp_module_and_refuses_tensor_parallel():
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.schema import model_class

    cfg = load_config(REPO / "configs/grpo_tiny_fsdp.yaml", [])
    entry = cfg.models["policy_trainer"]
    assert isinstance(entry.config, FSDPConfig) and entry.backend == "fsdp"
    assert model_class(entry) == "chatgen.training.fsdp_module:FSDPModule"
    with pytest.raises(ConfigError) as e:
        load_config(
            REPO / "configs/grpo_tiny_fsdp.yaml", ["policy_trainer.tensor_model_parallel_size=2"]
        )
    assert "tensor_model_parallel_size" in str(e.value) and "backend: megatron" in str(e.value)


def test_an_fsdp_trainer_fills_a_trainer_role():
    from chatgen.rlhf.checks import backend_kind
    from chatgen.rlhf.config import load_config
    from chatgen.rlhf.placement import model_world_size

    assert backend_kind("fsdp") == backend_kind("megatron") == "megatron"
    cfg = load_config(REPO / "configs/grpo_tiny_fsdp.yaml", ["policy_trainer.data_parallel_size=2"])
    assert model_world_size(cfg.models["policy_trainer"]) == 2


def test_lora_targets_the_model_lacks_are_refused_naming_the_key():
    """A mixture-of-experts model's experts are no linear layers: adapting only them is refused, and
    the message lists the linear layers there are."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from chatgen.training.config import LoRAConfig
    from chatgen.training.fsdp_lora import attach

    sizes = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = AutoConfig.for_model(
        "gpt_oss", num_key_value_heads=1, head_dim=32, vocab_size=64, **sizes
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"policy_trainer.lora.target_modules: .*q_proj"):
        attach(model, LoRAConfig(rank=2, target_modules=["gate_proj", "up_proj"]), "policy_trainer")
    assert attach(model, LoRAConfig(rank=2), "policy_trainer") == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_the_smollm2_recipe_runs_its_trainer_on_fsdp():
    from chatgen.rlhf.config import load_config

    cfg = load_config(REPO / "configs/grpo_smollm2_fsdp.yaml", [])
    entry = cfg.models["policy_trainer"]
    assert isinstance(entry.config, FSDPConfig) and entry.backend == "fsdp"
    assert (
        cfg.runtime.num_episode
        == load_config(REPO / "configs/grpo_smollm2.yaml", []).runtime.num_episode
    )
