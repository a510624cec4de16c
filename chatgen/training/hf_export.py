"""A sharded Megatron model as a stream of HF-named tensors, bucket by bucket:
`MegatronModule.hf_weights()`.

    weights = trainer.hf_weights(bucket_bytes=256 << 20)   # on every rank (collective below)
    weights.plan            # [[(hf name, shape), ...] per bucket], the same on every rank and for a receiver
    for bucket in weights.buckets():                       # [(hf name, full tensor)], on every rank
        ...
    weights.reference(i)    # bucket i again by an independent, unbucketed gather (validation)
    weights.nonfinite()     # HF names of parameters holding NaN/inf (any rank), checked before a sync writes

This is the trainer's one public way out for its weights (chatgen.param_sync consumes it; so does
`hf_state_dict` for `chatgen convert`).

A bucket is a run of Megatron parameters of one pipeline stage whose gathered size stays under
`bucket_bytes` (a single larger parameter gets a bucket of its own). Per bucket, collectively:

1. the owning stage's TP ranks flatten their shards into one buffer and all-gather it (one
   collective);
2. each parameter's TP shards are turned into HF tensors (chatgen/models/layout.py: un-interleave
   QKV per query group, split gate/up, drop vocab padding; layer numbers get the stage offset);
3. with EP > 1 (experts spread over expert-parallel ranks) the stage's EP ranks all-gather the HF
   tensors of the experts each holds (one collective): a bucket never splits one layer's experts,
   and every EP rank holds the same number of them, so the pieces are equal;
4. with PP > 1 the HF tensors are broadcast from the owning stage to the other stages (one
   collective).

Every tensor comes in the trainer's dtype (megatron's local RMSNorm keeps fp32 weights in a bf16
model: they are cast, as the HF checkpoint and the engine hold them). Every rank then holds the
bucket's full HF tensors; the next bucket reuses nothing, so peak extra memory is about two buckets,
never a copy of the model. The plan (names, shapes, bucket boundaries) is computed from the model
spec alone, identically on every rank and on a receiver in another process.
"""

import dataclasses

import torch
import torch.distributed as dist

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel, unflatten
from chatgen.models import layout
from chatgen.models.convert import TE_NORM_NAMES


@dataclasses.dataclass
class Bucket:
    stage: int  # pipeline stage owning these parameters
    params: list  # [layout.StageParam]
    shard_shapes: list  # this-TP-rank shard shape per param (the same on every TP rank)
    hf: list  # [(hf name, shape)] in stream order

    @property
    def hf_numel(self) -> int:
        return sum(numel(s) for _, s in self.hf)


def plan_buckets(
    spec, tp: int, pp: int, padded_vocab: int, itemsize: int, bucket_bytes: int
) -> list[Bucket]:
    """Bucket boundaries for a layout; shapes come from meta tensors pushed through the layout
    functions. The experts of one layer stay in one bucket (one EP all-gather), so the plan does
    not depend on EP."""
    buckets = []
    for stage in range(pp):
        units = []  # [StageParam]: one parameter, or the experts of one layer
        for sp in layout.stage_params(spec, pp, stage):
            if sp.duplicate:
                continue
            if sp.expert is not None and units and units[-1][-1].expert is not None:
                units[-1].append(sp)
            else:
                units.append([sp])
        current, size = None, 0
        for unit in units:
            shards = []
            for sp in unit:
                meta = [torch.empty(shape, device="meta") for shape in sp.hf.values()]
                shards.append(
                    tuple(
                        layout.to_megatron_shards(
                            sp.kind, meta, spec, tp, padded_vocab, sp.hf_names[0]
                        )[0].shape
                    )
                )
            nbytes = sum(numel(shard) for shard in shards) * tp * itemsize
            if current is None or (size + nbytes > bucket_bytes and current.params):
                current, size = Bucket(stage, [], [], []), 0
                buckets.append(current)
            for sp, shard in zip(unit, shards):
                current.params.append(sp)
                current.shard_shapes.append(shard)
                current.hf.extend(sp.hf.items())
            size += nbytes
    return buckets


class HFWeights:
    """One trainer's weights as HF tensors in buckets (see the module docstring). Build it with
    `MegatronModule.hf_weights(bucket_bytes)`; every method is collective over the trainer's
    ranks."""

    def __init__(self, trainer, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._trainer = trainer
        self.dtype = trainer.dtype
        itemsize = torch.empty((), dtype=trainer.dtype).element_size()
        self._buckets = plan_buckets(
            trainer.spec, trainer.tp, trainer.pp, trainer.padded_vocab_size, itemsize, bucket_bytes
        )
        self.plan = [list(b.hf) for b in self._buckets]
        # this rank's parameters by their first HF name (an expert's local name depends on the EP
        # rank)
        self._mine = {
            sp.hf_names[0]: sp
            for sp in layout.stage_params(
                trainer.spec, trainer.pp, trainer.pp_rank, trainer.ep, trainer.ep_rank
            )
        }
        self._experts_per_rank = trainer.spec.num_experts // trainer.ep

    def _owner(self, sp) -> int | None:
        """The EP rank holding an expert's weights; None for a parameter every EP rank holds."""
        return None if sp.expert is None else sp.expert // self._experts_per_rank

    @torch.no_grad()
    def buckets(self):
        """Yield [(hf name, full tensor)] per bucket of `plan`, on every rank."""
        t = self._trainer
        tp_group, pp_group = _groups()
        pp_ranks = dist.get_process_group_ranks(pp_group) if t.pp > 1 else None
        for bucket in self._buckets:
            if t.pp_rank == bucket.stage:
                tensors = self._on_owner(bucket, tp_group)
            if t.pp > 1:
                if t.pp_rank == bucket.stage:
                    flat = torch.cat([x.reshape(-1) for x in tensors])
                else:
                    flat = torch.empty(bucket.hf_numel, dtype=t.dtype, device=t.device)
                dist.broadcast(flat, pp_ranks[bucket.stage], group=pp_group)
                tensors = unflatten(flat, [s for _, s in bucket.hf])
            yield [(name, x) for (name, _), x in zip(bucket.hf, tensors)]

    def _on_owner(self, bucket: Bucket, tp_group) -> list[torch.Tensor]:
        t = self._trainer
        held = [sp for sp in bucket.params if self._owner(sp) in (None, t.ep_rank)]
        local = [
            t.local_param(self._mine[sp.hf_names[0]].local_name).detach().to(t.dtype) for sp in held
        ]
        hf = {}
        for sp, shards in zip(held, _gather_shards(local, t.tp, tp_group)):
            hf.update(zip(sp.hf_names, layout.to_hf(sp.kind, shards, t.spec)))
        if t.ep > 1 and any(sp.expert is not None for sp in bucket.params):
            from megatron.core import parallel_state as ps

            def experts_of(rank):
                return [
                    (name, shape)
                    for sp in bucket.params
                    if self._owner(sp) == rank
                    for name, shape in sp.hf.items()
                ]

            flat = torch.cat([hf[name].reshape(-1) for name, _ in experts_of(t.ep_rank)])
            gathered = torch.empty(t.ep * flat.numel(), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(gathered, flat, group=ps.get_expert_model_parallel_group())
            for rank, piece in enumerate(gathered.view(t.ep, -1)):
                names_shapes = experts_of(rank)
                hf.update(
                    zip(
                        [n for n, _ in names_shapes], unflatten(piece, [s for _, s in names_shapes])
                    )
                )
        return [hf[name] for name, _ in bucket.hf]

    @torch.no_grad()
    def reference(self, index: int) -> list[torch.Tensor]:
        """Bucket `index`'s HF tensors by an independent, unbucketed path (per-parameter
        all_gather of a list, a broadcast per tensor): what validation compares the stream
        against."""
        t = self._trainer
        bucket = self._buckets[index]
        tp_group, pp_group = _groups()
        out = []
        for sp in bucket.params:
            owner = self._owner(sp)
            if t.pp_rank == bucket.stage and owner in (None, t.ep_rank):
                local = (
                    t.local_param(self._mine[sp.hf_names[0]].local_name)
                    .detach()
                    .to(t.dtype)
                    .contiguous()
                )
                shards = [torch.empty_like(local) for _ in range(t.tp)]
                dist.all_gather(shards, local, group=tp_group) if t.tp > 1 else shards.__setitem__(
                    0, local
                )
                tensors = [x.contiguous() for x in layout.to_hf(sp.kind, shards, t.spec)]
            else:
                tensors = [
                    torch.empty(shape, dtype=t.dtype, device=t.device) for shape in sp.hf.values()
                ]
            if owner is not None and t.ep > 1 and t.pp_rank == bucket.stage:
                from megatron.core import parallel_state as ps

                ep_group = ps.get_expert_model_parallel_group()
                for x in tensors:
                    dist.broadcast(x, dist.get_process_group_ranks(ep_group)[owner], group=ep_group)
            if t.pp > 1:
                src = dist.get_process_group_ranks(pp_group)[bucket.stage]
                for x in tensors:
                    dist.broadcast(x, src, group=pp_group)
            out.extend(tensors)
        return out

    @torch.no_grad()
    def nonfinite(self) -> list[str]:
        """HF names of the parameters with a NaN or inf on any rank (empty when all are finite).
        One pass over this rank's shards (a sum per parameter: NaN and inf survive a sum) and one
        all-reduce."""
        t = self._trainer
        params = [
            sp
            for sp in layout.stage_params(t.spec, t.pp, t.pp_rank, t.ep, t.ep_rank)
            if not sp.duplicate
        ]
        local = torch.stack([t.local_param(sp.local_name).detach().float().sum() for sp in params])
        bad = [
            name
            for sp, v in zip(params, local.tolist())
            if v != v or abs(v) == float("inf")
            for name in sp.hf_names
        ]
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [None] * dist.get_world_size()
            dist.all_gather_object(box, bad)
            bad = sorted({name for names in box for name in names})
        return bad


def _groups():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()


def _gather_shards(local: list[torch.Tensor], tp: int, tp_group) -> list[list[torch.Tensor]]:
    """[this rank's shard per param] -> [[shard of TP rank r for r in range(tp)] per param], one
    all-gather."""
    if tp == 1:
        return [[t] for t in local]
    flat = torch.cat([t.reshape(-1) for t in local])
    gathered = torch.empty(tp * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=tp_group)
    per_rank = gathered.view(tp, -1)
    out, offset = [], 0
    for t in local:
        n = t.numel()
        out.append([per_rank[r, offset : offset + n].view(t.shape) for r in range(tp)])
        offset += n
    return out


class HFExport:
    """`MegatronModule`'s way out for its weights, as a mixin: hf_weights / hf_state_dict, and
    its parameters by name (local_param, used by param_sync)."""

    def hf_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> HFWeights:
        """This model's weights as HF-named full tensors (gathered over TP, broadcast over PP),
        bucket by bucket: the trainer's one public way out for its weights
        (chatgen/training/hf_export.py). Collective: call on every rank; at most about two
        buckets of extra memory, never a copy of the model."""
        self.onload(("params",))
        if self.config.lora.rank:  # W + (alpha / r) B A under the base names: any engine takes it
            from chatgen.training.lora_sync import MergedWeights

            return MergedWeights(self, HFWeights(self, bucket_bytes))
        return HFWeights(self, bucket_bytes)

    def hf_state_dict(self) -> dict:
        """The whole model as an HF state dict (a full copy; for tests and `chatgen convert`).
        Collective."""
        return {name: t.clone() for bucket in self.hf_weights().buckets() for name, t in bucket}

    def _to_module_name(self, name: str) -> str:
        for local, te in TE_NORM_NAMES.items():  # the Transformer Engine spec's names
            if name.endswith(local) and name not in self._params:
                return name[: -len(local)] + te
        return name

    @property
    def _params(self) -> dict:
        if getattr(self, "_param_cache", (None,))[0] is not self.model:
            self._param_cache = (self.model, dict(self.model.named_parameters()))
        return self._param_cache[1]

    def local_param(self, canonical_name: str) -> torch.Tensor:
        """This rank's shard of a Megatron parameter by its local-spec name (used by param_sync)."""
        params = self._params
        name = canonical_name if canonical_name in params else self._to_module_name(canonical_name)
        return params[name]
