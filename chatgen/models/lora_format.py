"""PEFT's LoRA adapter format, as chatgen reads and writes it: adapter_config.json +
adapter_model.safetensors with HF names, `base_model.model.<HF module>.lora_A.weight` (r, in) and
`.lora_B.weight` (out, r), scale lora_alpha / r.

    config, tensors = read_peft("outputs/run/adapter")   # safetensors only
    merge_peft(hf_state, "outputs/run/adapter")          # W += (alpha / r) B A, in place, for every adapted weight
    merge_lora(hf_state, config, tensors)                # the same from tensors in memory (adapter-only sync)

The trainer writes and loads it (chatgen/training/lora_peft.py); `chatgen convert --to hf` merges
the adapter a LoRA trainer's checkpoint carries (its `adapter/` directory). Pure tensors; imports
neither Megatron nor vLLM.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from chatgen.config import ConfigError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
CHECKPOINT_DIR = "adapter"  # where a LoRA trainer's checkpoint keeps its adapter, in this format


def peft_name(hf_weight: str, matrix: str) -> str:
    """model.layers.0.self_attn.q_proj.weight, lora_A ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    return PREFIX + hf_weight[: -len("weight")] + matrix + ".weight"


def peft_config(rank: int, alpha: float, dropout: float, targets, base) -> dict:
    """adapter_config.json of a plain LoRA adapter (PEFT's keys) of `rank` on the HF modules
    `targets`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def split_name(name: str) -> tuple[str, str]:
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight ->
    (model.layers.0.self_attn.q_proj.weight, lora_A); a ValueError for a name that is not a PEFT
    LoRA tensor's."""
    head, _, matrix = name[: -len(".weight")].rpartition(".")
    if not (
        name.startswith(PREFIX) and name.endswith(".weight") and matrix in ("lora_A", "lora_B")
    ):
        raise ValueError(f"{name} is not a PEFT LoRA tensor name ({PREFIX}<module>.lora_A.weight)")
    return head[len(PREFIX) :] + ".weight", matrix


def read_peft(directory, key: str = "lora.from_peft") -> tuple[dict, dict]:
    """(adapter_config.json, {PEFT name: tensor}) of a PEFT adapter directory; a ConfigError
    naming `key` when a file is missing or the adapter is not plain LoRA."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise ConfigError(
                [
                    f"{key}: {directory} has no {name}; point it at a PEFT LoRA adapter directory "
                    "(adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes)"
                ]
            )
    config = json.loads((directory / CONFIG_FILE).read_text())
    if (
        config.get("peft_type", "LORA") != "LORA"
        or config.get("use_rslora")
        or config.get("use_dora")
    ):
        raise ConfigError(
            [
                f"{key}: {directory} is not a plain LoRA adapter (peft_type {config.get('peft_type')}, "
                f"use_rslora {config.get('use_rslora')}, use_dora {config.get('use_dora')}); use one without "
                "rsLoRA or DoRA"
            ]
        )
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    try:
        check_finite_adapter(tensors, f"{key}: {directory / WEIGHTS_FILE}")
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    return config, tensors


def check_finite_adapter(tensors: dict, what: str) -> None:
    """Refuse (ValueError naming `what` and the tensors) a LoRA adapter holding NaN or inf,
    before any engine applies it: its answers would be NaN, and the NaN it leaves in freed KV
    blocks would reach other requests of the base model."""
    bad = [name for name, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(
            f"{what}: the LoRA adapter holds NaN or inf in {len(bad)} tensor(s): "
            f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}; nothing was loaded (the "
            "training that made it diverged: an earlier checkpoint's adapter, a lower learning rate)"
        )


def adapted_weights(tensors: dict) -> list[str]:
    """The HF weight names a PEFT adapter's tensors adapt (model.layers.0.self_attn.q_proj.weight
    ...)."""
    return sorted(
        k[len(PREFIX) : -len("lora_A.weight")] + "weight"
        for k in tensors
        if k.endswith(".lora_A.weight")
    )


@torch.no_grad()
def merge_peft(hf_state: dict, directory) -> list[str]:
    """Add (lora_alpha / r) B A of the adapter in `directory` to the HF tensors it adapts (in
    fp32, cast back), in place; returns the HF names merged. A KeyError names an adapted weight
    the state lacks."""
    return merge_lora(hf_state, *read_peft(directory, key=str(directory)), where=str(directory))


@torch.no_grad()
def merge_lora(
    hf_state: dict, config: dict, tensors: dict, where: str = "the adapter"
) -> list[str]:
    """`merge_peft` of an adapter held in memory: its adapter_config.json as a dict, its tensors
    by PEFT name."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    merged = []
    for hf_weight in adapted_weights(tensors):
        if hf_weight not in hf_state:
            raise KeyError(f"{where}: adapts {hf_weight}, which the model does not have")
        a = tensors[peft_name(hf_weight, "lora_A")].float()
        b = tensors[peft_name(hf_weight, "lora_B")].float()
        w = hf_state[hf_weight]
        hf_state[hf_weight] = (w.float() + scale * (b @ a)).to(w.dtype)
        merged.append(hf_weight)
    return merged
