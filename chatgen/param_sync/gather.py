"""Trainer side of the sync: turn a sharded Megatron model into a stream of HF tensors, bucket by bucket.

A bucket is a run of Megatron parameters of one pipeline stage whose gathered size stays under
`bucket_bytes` (a single larger parameter gets a bucket of its own). Per bucket, collectively:

1. the owning stage's TP ranks flatten their shards into one buffer and all-gather it (one collective);
2. each parameter's TP shards are turned into HF tensors (chatgen/param_sync/layout.py: un-interleave
   QKV per query group, split gate/up, drop vocab padding; layer numbers get the stage offset);
3. with PP > 1 the HF tensors are broadcast from the owning stage to the other stages (one collective).

Every rank then holds the bucket's full HF tensors; the next bucket reuses nothing, so peak extra memory
is about two buckets, never a copy of the model. The plan (names, shapes, bucket boundaries) is computed
from the model spec alone, identically on every rank and on a receiver in another process.
"""
import dataclasses

import torch
import torch.distributed as dist

from chatgen.param_sync import layout

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclasses.dataclass
class Bucket:
    stage: int  # pipeline stage owning these parameters
    params: list  # [layout.StageParam]
    shard_shapes: list  # this-TP-rank shard shape per param (the same on every TP rank)
    hf: list  # [(hf name, shape)] in stream order

    @property
    def hf_numel(self) -> int:
        return sum(_numel(s) for _, s in self.hf)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_buckets(spec, tp: int, pp: int, padded_vocab: int, itemsize: int, bucket_bytes: int) -> list[Bucket]:
    """Bucket boundaries for a layout; shapes come from meta tensors pushed through the layout functions."""
    shapes = layout.family(spec).hf_param_shapes(spec)
    buckets = []
    for stage in range(pp):
        current, size = None, 0
        for sp in layout.stage_params(spec, pp, stage):
            if sp.duplicate:
                continue
            meta = [torch.empty(shapes[n], device="meta") for n in sp.hf_names]
            shard = tuple(layout.to_megatron_shards(sp.kind, meta, spec, tp, padded_vocab, sp.hf_names[0])[0].shape)
            nbytes = _numel(shard) * tp * itemsize
            if current is None or (size + nbytes > bucket_bytes and current.params):
                current, size = Bucket(stage, [], [], []), 0
                buckets.append(current)
            current.params.append(sp)
            current.shard_shapes.append(shard)
            current.hf.extend((n, tuple(shapes[n])) for n in sp.hf_names)
            size += nbytes
    return buckets


def trainer_plan(trainer, bucket_bytes: int) -> list[Bucket]:
    itemsize = torch.empty((), dtype=trainer.dtype).element_size()
    return plan_buckets(trainer.spec, trainer.tp, trainer.pp, trainer.padded_vocab_size, itemsize, bucket_bytes)


def manifest(buckets: list[Bucket]) -> dict:
    """{HF name: shape} over all buckets, in stream order; raises if a name would be sent twice."""
    out = {}
    for b in buckets:
        for name, shape in b.hf:
            if name in out:
                raise ValueError(f"sync plan sends {name} twice")
            out[name] = shape
    return out


def _groups():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()


def _gather_shards(local: list[torch.Tensor], tp: int, tp_group) -> list[list[torch.Tensor]]:
    """[this rank's shard per param] -> [[shard of TP rank r for r in range(tp)] per param], one all-gather."""
    if tp == 1:
        return [[t] for t in local]
    flat = torch.cat([t.reshape(-1) for t in local])
    gathered = torch.empty(tp * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=tp_group)
    per_rank = gathered.view(tp, -1)
    out, offset = [], 0
    for t in local:
        n = t.numel()
        out.append([per_rank[r, offset:offset + n].view(t.shape) for r in range(tp)])
        offset += n
    return out


def _bucket_on_owner(trainer, bucket: Bucket, tp_group) -> list[torch.Tensor]:
    local = [trainer.local_param(sp.local_name).detach() for sp in bucket.params]
    out = []
    for sp, shards in zip(bucket.params, _gather_shards(local, trainer.tp, tp_group)):
        out.extend(layout.to_hf(sp.kind, shards, trainer.spec))
    return out


@torch.no_grad()
def iter_hf_buckets(trainer, bucket_bytes: int = DEFAULT_BUCKET_BYTES, buckets: list[Bucket] | None = None):
    """Yield [(hf name, full tensor)] per bucket on every rank (collective over TP and PP groups)."""
    tp_group, pp_group = _groups()
    pp_ranks = dist.get_process_group_ranks(pp_group) if trainer.pp > 1 else None
    for bucket in buckets if buckets is not None else trainer_plan(trainer, bucket_bytes):
        if trainer.pp_rank == bucket.stage:
            tensors = _bucket_on_owner(trainer, bucket, tp_group)
        if trainer.pp > 1:
            if trainer.pp_rank == bucket.stage:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(bucket.hf_numel, dtype=trainer.dtype, device=trainer._device())
            dist.broadcast(flat, pp_ranks[bucket.stage], group=pp_group)
            tensors = unflatten(flat, [s for _, s in bucket.hf])
        yield [(name, t) for (name, _), t in zip(bucket.hf, tensors)]


def unflatten(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = _numel(shape)
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


@torch.no_grad()
def reference_hf_tensors(trainer, bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's HF tensors by an independent, unbucketed path (per-parameter all_gather of a list,
    point-to-point broadcast per tensor): what validation compares the stream against. Collective."""
    tp_group, pp_group = _groups()
    out = []
    hf_shapes = iter(bucket.hf)
    for sp, shard_shape in zip(bucket.params, bucket.shard_shapes):
        names = [next(hf_shapes) for _ in sp.hf_names]
        if trainer.pp_rank == bucket.stage:
            local = trainer.local_param(sp.local_name).detach().contiguous()
            shards = [torch.empty_like(local) for _ in range(trainer.tp)]
            dist.all_gather(shards, local, group=tp_group) if trainer.tp > 1 else shards.__setitem__(0, local)
            tensors = [t.contiguous() for t in layout.to_hf(sp.kind, shards, trainer.spec)]
        else:
            tensors = [torch.empty(s, dtype=trainer.dtype, device=trainer._device()) for _, s in names]
        if trainer.pp > 1:
            src = dist.get_process_group_ranks(pp_group)[bucket.stage]
            for t in tensors:
                dist.broadcast(t, src, group=pp_group)
        out.extend(tensors)
    return out
