"""LoRA on the Megatron trainer: low-rank adapters beside the frozen base weights (`lora:` of a
trainer model).

    lora:                        # in a `backend: megatron` model's YAML (docs/lora.md)
      rank: 8                    # 0 = off: every parameter trains
      alpha: 16                  # the adapter's output is scaled by alpha / rank
      target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]

A target is named as in the HF checkpoint (q_proj ... down_proj); it adapts the Megatron linear
layer that holds it: q/k/v_proj live in the fused `linear_qkv`, gate/up_proj in `linear_fc1`, o_proj
in `linear_proj`, down_proj in `linear_fc2`. Each target has its own pair, exactly PEFT's: `W x +
(alpha / r) B A x` with A (r, in) and B (out, r) in HF layout, so a target inside a fused layer
adapts only its slice of the fused output (the other slices get nothing) and export / import to PEFT
is a renaming. The targets come from the family's own parameter mapping
(chatgen/models/<family>.py), so a family is LoRA-ready when it is mapped.

Tensor parallelism follows the base weight: a column-parallel layer (qkv, fc1) splits B along its
output rows (its TP rank's heads / its share of gate and up) and keeps A whole; a row-parallel one
(proj, fc2) splits A along its input columns and keeps B whole. The whole A of a column layer gets
its gradient summed over TP (`h = A x` enters the sharded B through megatron's copy-to-TP region),
the partial `A x` of a row layer is summed over TP before B (reduce-from-TP region), so every rank
computes the exact full-model forward and gradients.

The base weights are frozen before megatron's DDP and optimizer are built: they get no gradient
buffer and no optimizer state (megatron-core skips parameters with requires_grad False). The
adapters are children of the attention / MLP module, so the distributed checkpoint holds them (and
their optimizer state) as TP-sharded tensors in HF layout. `hf_weights()` sends W + (alpha / r) B A
under the base names (`MergedWeights`), so every sync transport and engine takes a LoRA trainer
unchanged; `adapter_disabled(model)` runs the base model, the KL reference, without a second copy of
the weights.
"""

import contextlib
import dataclasses
import logging
import math

import torch

from chatgen.config import ConfigError
from chatgen.models import family

log = logging.getLogger(__name__)

# What each HF target is inside Megatron's fused layers: the layout kinds of
# chatgen/models/layout.py.
COLUMN_KINDS = ("qkv", "gate_up", "column")  # output features split over TP: B is sharded
ROW_KINDS = ("row",)  # input features split over TP: A is sharded
SUFFIX = "_lora"  # the adapter of `linear_qkv` is the sibling module `linear_qkv_lora`


@dataclasses.dataclass(frozen=True)
class Target:
    """One HF target (e.g. q_proj) of a layer: the Megatron linear that holds it, and its slot
    there."""

    name: str  # q_proj
    module: str  # self_attention.linear_qkv (within a decoder layer)
    kind: str  # the layout kind of the Megatron weight
    slot: int  # position among the fused weight's HF tensors (q, k, v = 0, 1, 2)
    hf_weight: str  # model.layers.{i}.self_attn.q_proj.weight
    out_features: int
    in_features: int


def family_targets(spec) -> dict[str, Target]:
    """{HF target name: Target} of a model: every dense linear weight of a decoder layer (no
    experts, no biases, no norms), in the family's checkpoint order."""
    _, layer = family(spec).param_mappings(spec)
    out = {}
    for m in layer:
        if m.expert or not m.megatron.endswith(".weight") or m.kind not in COLUMN_KINDS + ROW_KINDS:
            continue
        module = m.megatron[len("decoder.layers.{i}.") : -len(".weight")]
        for slot, (hf_name, shape) in enumerate(m.hf.items()):
            name = hf_name.split(".")[-2]
            out[name] = Target(name, module, m.kind, slot, hf_name, shape[0], shape[1])
    return out


def check_targets(lora, spec, tp: int) -> dict[str, Target]:
    """The Targets `lora.target_modules` names on this model; a ConfigError naming the key
    otherwise."""
    have = family_targets(spec)
    unknown = [t for t in lora.target_modules if t not in have]
    if unknown:
        raise ConfigError(
            [
                f"lora.target_modules: {unknown} {'is' if len(unknown) == 1 else 'are'} not a linear layer "
                f"of a {spec.family} model{' (its MLP is experts)' if spec.is_moe else ''}; use some of "
                f"{sorted(have)}"
            ]
        )
    chosen = {name: have[name] for name in have if name in lora.target_modules}
    if tp > 1 and spec.num_query_groups % tp and any(t.kind == "qkv" for t in chosen.values()):
        raise ConfigError(
            [
                f"lora.target_modules: q/k/v_proj at tensor_model_parallel_size={tp} need whole query groups "
                f"per TP rank, but the model has num_key_value_heads={spec.num_query_groups}; drop q_proj, "
                "k_proj and v_proj from the targets or lower tensor_model_parallel_size"
            ]
        )
    return chosen


def tp_split(target: Target, matrix: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of a target's full (HF-layout) lora_A (r, in) or lora_B (out, r)."""
    if target.kind in COLUMN_KINDS and matrix == "lora_B":
        return full.chunk(tp, dim=0)[rank]
    if target.kind in ROW_KINDS and matrix == "lora_A":
        return full.chunk(tp, dim=1)[rank]
    return full


def tp_axis(target: Target, matrix: str) -> int | None:
    """The dim of `matrix` split over TP (None: whole on every TP rank)."""
    if target.kind in COLUMN_KINDS and matrix == "lora_B":
        return 0
    if target.kind in ROW_KINDS and matrix == "lora_A":
        return 1
    return None


class LoRAPair(torch.nn.Module):
    """One target's lora_A (r, in) and lora_B (out, r), this TP rank's shards."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)


class LoRAAdapter(torch.nn.Module):
    """The adapters of one fused Megatron linear layer; its forward hook adds their output to the
    layer's."""

    def __init__(self, targets: list[Target], pairs: dict, scale: float, dropout: float, tp: int):
        super().__init__()
        self.targets = {t.name: t for t in targets}
        self.pairs = torch.nn.ModuleDict(pairs)  # {target name: LoRAPair}
        self.scale, self.dropout, self.tp = scale, dropout, tp
        self.enabled = True  # adapter_disabled() turns it off: the base model
        kinds = {t.kind for t in targets}
        assert len(kinds) == 1, kinds
        self.kind = kinds.pop()

    def hook(self, module, args, output):
        """Forward hook of the Megatron linear: (out, bias) -> (out + scale * lora(x), bias)."""
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(args[0], module), bias

    def delta(self, x: torch.Tensor, module) -> torch.Tensor:
        """(T, b, in or in/TP) -> the adapters' contribution to the layer's local output (T, b,
        out_local)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        parts = {}
        for name, pair in self.pairs.items():
            h = x @ pair.lora_A.t()  # (T, b, r): whole (column) or this rank's partial sum (row)
            if self.tp > 1:  # column: sum A's gradient over TP; row: sum the partial products
                column = self.kind in COLUMN_KINDS
                h = (
                    copy_to_tensor_model_parallel_region(h)
                    if column
                    else reduce_from_tensor_model_parallel_region(h)
                )
            parts[name] = (h @ pair.lora_B.t()) * self.scale  # (T, b, out of this rank's slice)
        return self._fuse(parts, x, module)

    def _fuse(self, parts: dict, x: torch.Tensor, module) -> torch.Tensor:
        """Per-target outputs -> the fused layer's local layout (zeros for the slots with no
        adapter)."""
        if self.kind in ("column", "row"):
            return next(iter(parts.values()))
        lead, by_slot = x.shape[:-1], {t.slot: t.name for t in self.targets.values()}
        pieces = [
            parts[by_slot[i]] if i in by_slot else x.new_zeros(*lead, width)
            for i, width in enumerate(_slot_widths(self.kind, module.config, self.tp))
        ]
        if self.kind == "gate_up":  # TP rank r holds [gate_r; up_r]
            return torch.cat(pieces, dim=-1)
        # qkv: [q_g, k_g, v_g] per local query group
        groups = module.config.num_query_groups // self.tp
        return torch.cat([p.reshape(*lead, groups, -1) for p in pieces], dim=-1).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's distributed-checkpoint view: each matrix whole in HF layout, split over TP
        like the base weight (the parent attention / MLP module asks its children for theirs)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {
            f"pairs.{name}.{matrix}": tp_axis(t, matrix)
            for name, t in self.targets.items()
            for matrix in ("lora_A", "lora_B")
        }
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {k: v for k, v in axes.items() if v is not None},
            sharded_offsets,
        )


def _slot_widths(kind: str, cfg, tp: int) -> list[int]:
    """This TP rank's output width of each slot of a fused layer (q, k, v or gate, up)."""
    if kind == "qkv":
        q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
        return [q // tp, kv // tp, kv // tp]
    return [cfg.ffn_hidden_size // tp] * 2


def attach(trainer) -> dict:
    """Add the configured adapters to `trainer.model` (before its DDP and optimizer are built),
    freeze every other parameter, and log the trainable share. Returns {"trainable": n, "total":
    n, "share": f} over the whole model (every stage, every TP rank's shard counted once)."""
    cfg, spec = trainer.config.lora, trainer.spec
    targets = check_targets(cfg, spec, trainer.tp)
    scale = cfg.alpha / cfg.rank
    for p in trainer.model.parameters():
        p.requires_grad_(False)
    by_module = {}
    for t in targets.values():
        by_module.setdefault(t.module, []).append(t)
    dtype = trainer.dtype
    for layer in _decoder_layers(trainer.model):
        global_layer = layer.layer_number - 1
        for path, group in by_module.items():
            parent_path, _, leaf = path.rpartition(".")
            parent, linear = layer.get_submodule(parent_path), layer.get_submodule(path)
            # Transformer Engine's norm fused into the linear
            if "LayerNorm" in type(linear).__name__:
                raise ConfigError(
                    [
                        f"lora.target_modules: {[t.name for t in group]} sit in {type(linear).__name__}, "
                        "whose input is not normalized yet (Transformer Engine's fused norm); drop them "
                        "or run without Transformer Engine"
                    ]
                )
            pairs = {}
            for t in group:
                a, b = init_pair(t, cfg.rank, trainer.config.seed, global_layer)
                pairs[t.name] = LoRAPair(
                    tp_split(t, "lora_A", a, trainer.tp, trainer.tp_rank).to(dtype).clone(),
                    tp_split(t, "lora_B", b, trainer.tp, trainer.tp_rank).to(dtype).clone(),
                )
                for matrix in ("lora_A", "lora_B"):
                    _mark_tp(getattr(pairs[t.name], matrix), tp_axis(t, matrix))
            adapter = LoRAAdapter(group, pairs, scale, cfg.dropout, trainer.tp).to(trainer.device)
            parent.add_module(leaf + SUFFIX, adapter)
            linear.register_forward_hook(adapter.hook)
    stats = counts(spec, targets, cfg.rank)
    log.info(
        "LoRA rank %d on %s: %d trainable of %d parameters (%.3f%%)",
        cfg.rank,
        ",".join(targets),
        stats["trainable"],
        stats["total"],
        100 * stats["share"],
    )
    return stats


def _decoder_layers(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _mark_tp(param, axis: int | None) -> None:
    """Megatron's TP attributes: a split tensor counts once per TP rank in the grad norm, a whole
    one once."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, axis is not None, axis or 0, 1)


def init_pair(
    target: Target, rank: int, seed: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's full initial (A, B) in fp32, the same at every TP layout: A uniform in
    +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5)) bound), B zero (the adapted model starts as
    the base)."""
    g = torch.Generator().manual_seed(
        seed * 100_003 + layer * 101 + target.slot + hash_name(target)
    )
    bound = 1 / math.sqrt(target.in_features)
    a = (torch.rand(rank, target.in_features, generator=g) * 2 - 1) * bound
    return a, torch.zeros(target.out_features, rank)


def hash_name(target: Target) -> int:
    """A stable small number per target name (Python's hash() of a str changes per process)."""
    return sum(ord(c) * (i + 1) for i, c in enumerate(target.name)) % 10_007


def counts(spec, targets: dict, rank: int) -> dict:
    """Trainable (adapter) and total parameters of the whole model, from the spec's shapes (no
    collective)."""
    from chatgen.models import layout

    base = sum(
        math.prod(shape)
        for sp in layout.stage_params(spec, 1, 0)
        if not sp.duplicate
        for shape in sp.hf.values()
    )
    trainable = spec.num_layers * sum(
        rank * (t.in_features + t.out_features) for t in targets.values()
    )
    total = base + trainable
    return {"trainable": trainable, "total": total, "share": trainable / total}


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (model.named_parameters()) belongs to an adapter."""
    return SUFFIX + "." in name


def adapters(model) -> list[LoRAAdapter]:
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapter_disabled(model):
    """Run `model` as its base (every adapter off), e.g. for the KL reference; restored on exit."""
    mods = adapters(model)
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


@torch.no_grad()
def randomize(trainer, seed: int, std: float = 0.1) -> None:
    """Give every adapter a random B (N(0, std), the same full tensor at any layout), so that the
    adapted model differs from the base: for a check that a sync moves the adapter (check-sync
    --lora) without training."""
    for layer in _decoder_layers(trainer.model):
        for module in layer.modules():
            if not isinstance(module, LoRAAdapter):
                continue
            for name, pair in module.pairs.items():
                t = module.targets[name]
                g = torch.Generator().manual_seed(
                    seed * 7919 + layer.layer_number * 131 + hash_name(t)
                )
                full = torch.randn(t.out_features, pair.lora_B.shape[1], generator=g) * std
                shard = tp_split(t, "lora_B", full, trainer.tp, trainer.tp_rank)
                pair.lora_B.copy_(shard)
    if trainer.optimizer is not None:
        trainer.optimizer.reload_model_params()
