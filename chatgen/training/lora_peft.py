"""A LoRA trainer's adapter in PEFT's format, out and in: the directory
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the HF base model (and vLLM's LoRARequest
reads).

    export_peft(trainer, "outputs/run/adapter")   # collective; rank 0 writes adapter_config.json +
                                                  # adapter_model.safetensors, atomically
    load_peft(trainer, "outputs/run/adapter")     # collective; the trainer's `lora.from_peft` key calls it

Names are PEFT's: `base_model.model.` + the HF weight's module + `.lora_A.weight` (r, in) /
`.lora_B.weight` (out, r), e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight; the
scale is lora_alpha / r (PEFT without rsLoRA), the same as the trainer's.
"""

import json

import torch
from safetensors.torch import save_file

from chatgen.config import ConfigError
from chatgen.core.checkpoint_io import atomic_directory
from chatgen.models.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    peft_config,
    peft_name,
    read_peft,
)
from chatgen.training import lora
from chatgen.training.lora_sync import full_adapters


def export_peft(trainer, directory) -> str:
    """Write the trainer's adapter as a PEFT LoRA adapter directory (replacing one there);
    collective: call on every rank. Returns the directory."""
    import torch.distributed as dist

    cfg = trainer.config.lora
    adapters = full_adapters(trainer)
    if dist.is_initialized() and dist.get_rank() != 0:
        return str(directory)
    tensors = {}
    for hf_weight, (a, b) in adapters.items():
        tensors[peft_name(hf_weight, "lora_A")] = a.contiguous()
        tensors[peft_name(hf_weight, "lora_B")] = b.contiguous()
    config = peft_config(
        cfg.rank,
        cfg.alpha,
        cfg.dropout,
        {name.split(".")[-2] for name in adapters},
        trainer.config.load,
    )
    with atomic_directory(directory, replace=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return str(directory)


def _mismatches(config: dict, tensors: dict, cfg, directory) -> list[str]:
    """What keeps the adapter in `directory` from being this trainer's, each naming the key and
    the fix."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(
            f"lora.from_peft: {directory} is a {config.get('peft_type')} adapter, not LORA"
        )
    if config.get("use_rslora") or config.get("use_dora"):
        problems.append(
            f"lora.from_peft: {directory} uses rsLoRA / DoRA, which the trainer does not; use a plain LoRA "
            "adapter"
        )
    if config.get("r") != cfg.rank:
        problems.append(f"lora.rank: {cfg.rank}, but {directory} has r={config.get('r')}; set it")
    if float(config.get("lora_alpha", -1)) != float(cfg.alpha):
        problems.append(
            f"lora.alpha: {cfg.alpha}, but {directory} has lora_alpha={config.get('lora_alpha')}; set it"
        )
    found = sorted({k.split(".")[-3] for k in tensors if ".lora_A." in k})
    if found != sorted(cfg.target_modules):
        problems.append(
            f"lora.target_modules: {sorted(cfg.target_modules)}, but {directory} adapts {found}; set "
            "target_modules to those"
        )
    return problems


@torch.no_grad()
def load_peft(trainer, directory) -> None:
    """Copy a PEFT adapter into the trainer's adapters (this rank's shards); the optimizer's fp32
    copies follow. A ConfigError when its rank, alpha or targets differ from the `lora` keys, or
    a tensor is missing."""
    config, tensors = read_peft(directory)
    cfg = trainer.config.lora
    problems = _mismatches(config, tensors, cfg, directory)
    if problems:
        raise ConfigError(problems)
    for layer in lora._decoder_layers(trainer.model):
        for module in layer.modules():
            if not isinstance(module, lora.LoRAAdapter):
                continue
            for name, pair in module.pairs.items():
                t = module.targets[name]
                hf_weight = t.hf_weight.format(i=layer.layer_number - 1)
                for matrix, shape in (
                    ("lora_A", (cfg.rank, t.in_features)),
                    ("lora_B", (t.out_features, cfg.rank)),
                ):
                    key = peft_name(hf_weight, matrix)
                    full = tensors.get(key)
                    if full is None or tuple(full.shape) != shape:
                        got = "missing" if full is None else f"shape {tuple(full.shape)}"
                        raise ConfigError(
                            [
                                f"lora.from_peft: {directory}: {key} is {got}, expected {shape}; the "
                                f"adapter was made for another model than {trainer.config.load}"
                            ]
                        )
                    param = getattr(pair, matrix)
                    param.copy_(lora.tp_split(t, matrix, full, trainer.tp, trainer.tp_rank))
    if trainer.optimizer is not None:
        trainer.optimizer.reload_model_params()
