"""LoRA on the fsdp trainer, through PEFT: the `lora:` keys of docs/lora.md on `backend: fsdp`
(docs/fsdp_backend.md#lora).

    trainer = FSDPModule(dict(load="outputs/tiny-llama", lora=dict(rank=4, alpha=8))).start()
    trainer.hf_weights()          # merged: W + (alpha / r) B A under the HF names, bucket by bucket
    trainer.adapter_weights()     # adapter-only: A and B under PEFT's names (chatgen.param_sync.sync_adapter)

`attach` injects PEFT's LoRA layers into transformers' model in place
(`peft.inject_adapter_in_model`, before FSDP shards it) and freezes every other parameter, so FSDP2
shards the frozen base and the adapters alike and AdamW holds the adapters' moments only. Parameter
names then read `...q_proj.base_layer.weight` and `...q_proj.lora_A.default.weight`; the merged sync
takes the HF name back by dropping `.base_layer` and adds `(alpha / r) B A` (fp32) to each adapted
weight as its bucket is gathered: no per-family table, as for the full model. The adapter-only
source names A and B as PEFT's adapter files do (chatgen.models.lora_format), which vLLM's LoRA
path and `sync_adapter` take.
"""

import re

import torch

from chatgen.config import ConfigError
from chatgen.models.lora_format import peft_config, peft_name, read_peft
from chatgen.module import remote
from chatgen.param_sync.checks import nonfinite
from chatgen.training.fsdp_weights import FSDPWeights, gather_by_objects, full_tensor

ADAPTER = "default"  # PEFT's adapter name inside the injected layers
_PAIR = re.compile(rf"^(.*)\.lora_([AB])\.{ADAPTER}\.weight$")


def hf_name(name: str) -> str:
    """model.layers.0.self_attn.q_proj.base_layer.weight -> model.layers.0.self_attn.q_proj.weight"""
    return name.replace(".base_layer.", ".")


def adapter_pairs(model) -> dict:
    """{HF name of an adapted weight: {"A": lora_A param, "B": lora_B param}}, in model order."""
    pairs = {}
    for name, p in model.named_parameters():
        if match := _PAIR.match(name):
            pairs.setdefault(match.group(1) + ".weight", {})[match.group(2)] = p
    return pairs


def attach(model, cfg, who: str) -> list[str]:
    """Inject LoRA layers of `cfg` (the `lora:` keys) into `model` (not sharded yet) and freeze the
    rest; start from `cfg.from_peft` when set. Returns the targets adapted: those of
    `cfg.target_modules` that are linear layers of this model (a mixture-of-experts model's
    experts are not; at least one must be)."""
    from peft import LoraConfig, inject_adapter_in_model

    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    targets = [t for t in cfg.target_modules if t in linear]
    if not targets:
        raise ConfigError(
            [
                f"{who}.lora.target_modules: none of {cfg.target_modules} is a linear layer of this "
                f"{type(model).__name__}; name some of {sorted(linear)}"
            ]
        )
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(_PAIR.match(name) is not None)
    if cfg.from_peft:
        _load_peft(model, cfg, targets)
    return targets


@torch.no_grad()
def _load_peft(model, cfg, targets) -> None:
    """Copy the PEFT adapter at cfg.from_peft into the injected (unsharded) layers; a ConfigError
    naming the key when its rank, alpha or a tensor does not fit."""
    config, tensors = read_peft(cfg.from_peft)
    problems = [
        f"lora.{key}: {ours} but the adapter at {cfg.from_peft} has {theirs}"
        for key, ours, theirs in (
            ("rank", cfg.rank, config.get("r")),
            ("alpha", cfg.alpha, config.get("lora_alpha")),
        )
        if ours != theirs
    ]
    for hf_weight, pair in adapter_pairs(model).items():
        for matrix, p in (("lora_A", pair["A"]), ("lora_B", pair["B"])):
            full = tensors.get(peft_name(hf_weight, matrix))
            if full is None or full.shape != p.shape:
                got = "missing" if full is None else f"shape {tuple(full.shape)}"
                problems.append(
                    f"lora.from_peft: {peft_name(hf_weight, matrix)} is {got}, expected "
                    f"{tuple(p.shape)} (lora.target_modules {targets})"
                )
            else:
                p.copy_(full)
    if problems:
        raise ConfigError(problems)


@torch.no_grad()
def randomize(trainer, seed: int, std: float = 0.1) -> None:
    """A random B (N(0, std), the same full tensor at any DP) for every adapter, so that the adapted
    model differs from its base: for a check that a sync moves the adapter (check-sync --lora)."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for pair in adapter_pairs(trainer.model).values():
        b = pair["B"]
        full = (torch.randn(b.shape, generator=gen) * std).to(b.dtype)
        if hasattr(b, "device_mesh"):
            full = distribute_tensor(full.to(b.device), b.device_mesh, b.placements)
        b.copy_(full)


class FSDPMergedWeights(FSDPWeights):
    """A LoRA trainer's weights for a sync, merged: every HF weight once under its HF name, an
    adapted one as W + (alpha / r) B A computed in fp32 from the gathered W, A and B."""

    def __init__(self, trainer, bucket_bytes: int):
        cfg = trainer.config.lora
        self._scale, self._pairs = cfg.alpha / cfg.rank, adapter_pairs(trainer.model)
        super().__init__(trainer, bucket_bytes)

    def named(self, model):
        return [(hf_name(n), p) for n, p in model.named_parameters() if not _PAIR.match(n)]

    def parts(self, name: str, p) -> tuple:
        pair = self._pairs.get(name)
        return (p,) if pair is None else (p, pair["A"], pair["B"])

    def combine(self, name: str, parts: list) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        w, a, b = parts
        return (w.float() + self._scale * (b.float() @ a.float())).to(w.dtype)


class FSDPAdapterWeights:
    """The adapter alone as a weight source (plan / dtype / buckets / reference / nonfinite,
    chatgen.param_sync.source) under PEFT's names, one bucket, fp32, gathered whole on every rank
    (collective), and `config`, its adapter_config.json as a dict."""

    def __init__(self, trainer):
        cfg = trainer.config.lora
        self.dtype, self._pairs = torch.float32, adapter_pairs(trainer.model)
        targets = trainer.lora_targets
        self.config = peft_config(cfg.rank, cfg.alpha, cfg.dropout, targets, trainer.config.load)
        self._params = [
            (peft_name(hf_weight, f"lora_{m}"), pair[m])
            for hf_weight, pair in self._pairs.items()
            for m in ("A", "B")
        ]
        self.plan = [[(name, tuple(p.shape)) for name, p in self._params]]
        self._tensors = None

    def buckets(self):
        if self._tensors is None:
            self._tensors = [(n, full_tensor(p).float()) for n, p in self._params]
        yield self._tensors

    def reference(self, index: int) -> list[torch.Tensor]:
        return [gather_by_objects(p).float() for _, p in self._params]

    def nonfinite(self) -> list[str]:
        return nonfinite(next(self.buckets()))


class FSDPLoRAHooks:
    """`FSDPModule`'s LoRA methods (a mixin): its base as the KL reference, its adapter for a sync
    or a PEFT directory. Without `lora.rank` they act on the full model (base_forward_tokens) or
    refuse (adapter_weights)."""

    @remote("split")
    def base_forward_tokens(self, data: dict) -> torch.Tensor:
        """`forward_tokens` with every adapter off: a LoRA policy's KL reference from the same
        weights."""
        from peft.tuners.lora import LoraLayer

        layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            return self.forward_tokens(data)
        finally:
            for m in layers:
                m.enable_adapters(True)

    def adapter_weights(self) -> FSDPAdapterWeights:
        """The adapter alone (PEFT's names) for an adapter-only sync
        (chatgen.param_sync.adapter_sync); collective at its first use."""
        return FSDPAdapterWeights(self)

    def export_adapter(self, directory) -> str:
        """Write the adapter as a PEFT adapter directory (adapter_config.json +
        adapter_model.safetensors; rank 0 writes); collective."""
        import json
        from pathlib import Path

        import torch.distributed as dist
        from safetensors.torch import save_file

        from chatgen.models.lora_format import CONFIG_FILE, WEIGHTS_FILE

        weights = self.adapter_weights()
        tensors = {n: t.contiguous() for n, t in next(weights.buckets())}
        if not dist.is_initialized() or dist.get_rank() == 0:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CONFIG_FILE).write_text(json.dumps(weights.config, indent=1))
            save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return str(directory)
