"""A LoRA trainer's weights as the engine needs them: W + (alpha / r) B A under the base HF names
(merged sync), and its adapters whole in HF layout (PEFT export, merging).

    adapters = full_adapters(trainer)     # {HF weight name: (A (r, in), B (out, r))}, fp32, on every rank
    weights = trainer.hf_weights()        # a MergedWeights when lora.rank > 0 (chatgen/training/hf_export.py)
    adapter = trainer.adapter_weights()   # an AdapterWeights: the adapter alone, PEFT's names (adapter-only sync)

`MergedWeights` is the weight source of chatgen.param_sync (plan / dtype / buckets / reference /
nonfinite) over the base's `HFWeights`: the same plan and names, each adapted tensor plus its
low-rank update, so every transport and engine (vLLM, hf, another trainer) takes a LoRA trainer
unchanged. The merge is computed per bucket, in fp32, from adapters gathered once per stream (rank r
x (in + out) per target: small). `AdapterWeights` is the same protocol over the adapter alone
(chatgen.param_sync.adapter_sync sends it).
"""

import torch
import torch.distributed as dist

from chatgen.models.lora_format import peft_config, peft_name
from chatgen.param_sync.checks import nonfinite
from chatgen.training import lora


@torch.no_grad()
def full_adapters(trainer) -> dict:
    """{HF weight name (model.layers.N.self_attn.q_proj.weight): (A, B)} of the whole model,
    fp32, on every rank: gathered over TP (one all-gather per matrix) and, with PP > 1, exchanged
    between the stages."""
    from megatron.core import parallel_state as ps

    mine = {}
    tp_group = ps.get_tensor_model_parallel_group()
    for layer in lora._decoder_layers(trainer.model):
        for module in layer.modules():
            if not isinstance(module, lora.LoRAAdapter):
                continue
            for name, pair in module.pairs.items():
                t = module.targets[name]
                whole = []
                for matrix in ("lora_A", "lora_B"):
                    local = getattr(pair, matrix).detach().float().contiguous()
                    axis = lora.tp_axis(t, matrix)
                    if axis is not None and trainer.tp > 1:
                        shards = [torch.empty_like(local) for _ in range(trainer.tp)]
                        dist.all_gather(shards, local, group=tp_group)
                        local = torch.cat(shards, dim=axis)
                    whole.append(local.cpu())
                mine[t.hf_weight.format(i=layer.layer_number - 1)] = tuple(whole)
    if trainer.pp > 1:
        box = [None] * trainer.pp
        dist.all_gather_object(box, mine, group=ps.get_pipeline_model_parallel_group())
        mine = {k: v for part in box for k, v in part.items()}
    return mine


def scale_of(trainer) -> float:
    return trainer.config.lora.alpha / trainer.config.lora.rank


class MergedWeights:
    """The base `HFWeights` of a LoRA trainer with each adapted tensor merged: W + scale * B A
    (see above)."""

    def __init__(self, trainer, base):
        self._trainer, self._base = trainer, base
        self.plan, self.dtype = base.plan, base.dtype
        self._adapters = None

    def _merged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._adapters is None:
            # collective: the first bucket, on every rank
            self._adapters = full_adapters(self._trainer)
        pair = self._adapters.get(name)
        if pair is None:
            return tensor
        a, b = (x.to(tensor.device) for x in pair)
        return (tensor.float() + scale_of(self._trainer) * (b @ a)).to(tensor.dtype)

    def buckets(self):
        # the adapters as they are now, for this stream
        self._adapters = full_adapters(self._trainer)
        for bucket in self._base.buckets():
            yield [(name, self._merged(name, t)) for name, t in bucket]

    def reference(self, index: int) -> list[torch.Tensor]:
        tensors = self._base.reference(index)
        self._adapters = full_adapters(self._trainer)
        return [self._merged(name, t) for (name, _), t in zip(self.plan[index], tensors)]

    def nonfinite(self) -> list[str]:
        bad = set(self._base.nonfinite())
        for name, (a, b) in full_adapters(self._trainer).items():
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                bad.add(name)
        return sorted(bad)


class AdapterWeights:
    """A LoRA trainer's adapter as a weight source (plan / dtype / buckets / reference /
    nonfinite, see chatgen.param_sync.source) under PEFT's names, one bucket, fp32, whole
    (gathered over TP and PP once, at the first use, on every rank: collective), and `config`,
    its adapter_config.json as a dict. The plan comes from the config alone, so it is the same on
    every rank without a collective."""

    def __init__(self, trainer):
        cfg = trainer.config.lora
        targets = lora.check_targets(cfg, trainer.spec, trainer.tp)
        self._trainer, self.dtype = trainer, torch.float32
        self.config = peft_config(cfg.rank, cfg.alpha, cfg.dropout, targets, trainer.config.load)
        self.plan = [
            [
                (peft_name(t.hf_weight.format(i=i), matrix), shape)
                for i in range(trainer.spec.num_layers)
                for t in targets.values()
                for matrix, shape in (
                    ("lora_A", (cfg.rank, t.in_features)),
                    ("lora_B", (t.out_features, cfg.rank)),
                )
            ]
        ]
        self._tensors = None

    def _read(self) -> dict:
        """{PEFT name: tensor} of the adapter now (collective)."""
        out = {}
        for hf_weight, (a, b) in full_adapters(self._trainer).items():
            out[peft_name(hf_weight, "lora_A")], out[peft_name(hf_weight, "lora_B")] = a, b
        return out

    def _gathered(self) -> dict:
        if self._tensors is None:
            self._tensors = self._read()
        return self._tensors

    def buckets(self):
        tensors = self._gathered()
        yield [(name, tensors[name]) for name, _ in self.plan[0]]

    def reference(self, index: int) -> list[torch.Tensor]:
        tensors = self._read()  # a second gather, independent of the one the stream sent
        return [tensors[name] for name, _ in self.plan[index]]

    def nonfinite(self) -> list[str]:
        return nonfinite(self._gathered().items())
