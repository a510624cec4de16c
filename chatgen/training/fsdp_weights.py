"""An FSDP2-sharded transformers model as HF-named full tensors, bucket by bucket:
`FSDPModule.hf_weights()`.

    weights = trainer.hf_weights(bucket_bytes=256 << 20)   # on every rank (collective below)
    weights.plan            # [[(hf name, shape), ...] per bucket], the same on every rank
    for bucket in weights.buckets(): ...                   # [(hf name, full tensor)], on every rank
    weights.reference(i)    # bucket i again by an independent gather (validation)
    weights.nonfinite()     # HF names of parameters holding NaN/inf (any rank)

The weight-source protocol of chatgen.param_sync (source.py), as `MegatronModule.hf_weights()` gives
it, so every transport, manifest, fingerprint and finiteness check applies unchanged. The names are
the model's own parameter names, which for the families an fsdp trainer takes are the checkpoint's
(families whose transformers code renames checkpoint weights are refused:
chatgen.training.config.hf_family_problem), so no per-family mapping exists: vLLM's loader takes HF
names. A tied LM head is one parameter, sent once under the embedding's name, as save_pretrained
writes it.

A bucket is a run of whole decoder layers (or the embedding, the final norm and the head) whose size
in the sync dtype stays under `bucket_bytes` (a larger layer gets a bucket of its own). Each
parameter's shards are all-gathered (`DTensor.full_tensor()`); the bucket is yielded and dropped
before the next one, so the extra memory of a sync is about one bucket, never a copy of the model.
"""

import re

import torch
import torch.distributed as dist

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _unit(name: str) -> str:
    """The piece a bucket never splits: a decoder layer, else the parameter itself."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole: its DTensor shards all-gathered (collective), or the tensor itself."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def gather_by_objects(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole by another path than `full_tensor`: every rank's local shard (dim 0
    pieces, rank order) exchanged as objects and concatenated (collective), for validation."""
    local = p.to_local() if hasattr(p, "to_local") else p
    if hasattr(p, "to_local") and dist.is_initialized() and dist.get_world_size() > 1:
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, local.detach().cpu())
        local = torch.cat([x for x in pieces if x.numel()]).view(p.shape).to(_full_device(p))
    return local


class FSDPWeights:
    """One FSDP trainer's weights as HF tensors in buckets (see the module docstring). Build it
    with `FSDPModule.hf_weights(bucket_bytes)`; every method is collective over the trainer's
    ranks."""

    def __init__(self, trainer, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.dtype = trainer.dtype
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self._buckets, size, last_unit = [], 0, None
        for name, p in self.named(trainer.model):
            nbytes = numel(p.shape) * itemsize
            unit = _unit(name)
            if not self._buckets or (
                unit != last_unit and size + nbytes > bucket_bytes and self._buckets[-1]
            ):
                self._buckets.append([])
                size = 0
            self._buckets[-1].append((name, p))
            size, last_unit = size + nbytes, unit
        self.plan = [[(name, tuple(p.shape)) for name, p in bucket] for bucket in self._buckets]

    def named(self, model) -> list:
        """[(HF name, parameter)] of every weight the sync sends: the model's own."""
        return list(model.named_parameters())

    def parts(self, name: str, p) -> tuple:
        """The parameters whose full tensors make HF weight `name` (a LoRA subclass adds A, B)."""
        return (p,)

    def combine(self, name: str, parts: list) -> torch.Tensor:
        """HF weight `name` from its parts' full tensors."""
        return parts[0]

    def _value(self, name, p, gather) -> torch.Tensor:
        return self.combine(name, [gather(x) for x in self.parts(name, p)]).to(self.dtype)

    @torch.no_grad()
    def buckets(self):
        """Yield [(hf name, full tensor)] per bucket of `plan`, on every rank."""
        for bucket in self._buckets:
            yield [(name, self._value(name, p, full_tensor)) for name, p in bucket]

    @torch.no_grad()
    def reference(self, index: int) -> list[torch.Tensor]:
        """Bucket `index` by another path: every rank's local shard (dim 0 pieces, rank order)
        exchanged as objects and concatenated, not DTensor's all-gather."""
        return [self._value(name, p, gather_by_objects) for name, p in self._buckets[index]]

    @torch.no_grad()
    def nonfinite(self) -> list[str]:
        """HF names of the parameters with a NaN or inf on any rank: a sum of each local shard
        (NaN and inf survive a sum) and one exchange of the names."""
        bad = []
        for bucket in self._buckets:
            for name, p in bucket:
                for x in self.parts(name, p):
                    local = x.to_local() if hasattr(x, "to_local") else x
                    total = float(local.detach().float().sum()) if local.numel() else 0.0
                    if total != total or abs(total) == float("inf"):
                        bad.append(name)
                        break
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [None] * dist.get_world_size()
            dist.all_gather_object(box, bad)
            bad = sorted({name for names in box for name in names})
        return bad


def _full_device(p: torch.Tensor) -> torch.device:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.device
