"""Context parallelism for the FSDP backend (`context_parallel_size`; docs/long_context.md): every
sample's sequence split over `context_parallel_size` ranks, attention computed as ring attention by
torch's `torch.distributed.tensor.experimental.context_parallel`.

GPU only, and NOT RUN: this stack has no GPU, and neither context-parallel attention runs on its CPU
(measured, torch 2.13 + megatron-core 0.16.1, 2 ranks over gloo; the errors are CPU_REFUSAL's).
What the path does, for the reader who runs it first on CUDA (the layout of torchtitan's CP):
- the world is a (dp, cp) mesh; FSDP shards over both dimensions flattened, so its mean-reduce
  of gradients runs over dp x cp ranks;
- the ranks of a CP group score the same samples (`group_batch` gathers their shares), each rank
  a contiguous 1/cp slice of every sequence (load balancing off, so the slices concatenate back in
  order); labels are shifted before the split, so every rank scores its own positions;
- the per-token log-probs are all-gathered with a differentiable all-gather: every CP rank then
  computes the same loss, the all-gather's backward sums the CP ranks' identical gradients (x cp)
  onto each slice, and FSDP's mean over dp x cp divides it back: the gradient of 1 rank.
Ring attention needs causal attention without a mask: padded or packed batches are refused.
"""

import torch
import torch.distributed as dist

CPU_REFUSAL = (
    "context_parallel_size > 1 runs on CUDA only: torch's context-parallel attention has no CPU "
    "kernel (torch 2.13, 2 ranks over gloo: `NotImplementedError: Operator "
    "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
    "registered`) and megatron-core 0.16.1's wants TransformerEngine (local layer spec: "
    "`AssertionError: Context parallelism is only supported by TEDotProductAttention!`); set "
    "context_parallel_size: 1 on CPU (docs/long_context.md)"
)


def cp_meshes(device_type: str, world: int, cp: int):
    """(mesh FSDP shards over, the CP sub-mesh): a (dp, cp) mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return mesh._flatten("dp_cp"), mesh["cp"]


def group_batch(data: dict, cp_mesh) -> dict:
    """The samples of every rank of this rank's CP group, concatenated in rank order: what the
    group scores together, each rank a slice of every sequence."""
    parts = [None] * cp_mesh.size()
    dist.all_gather_object(parts, {k: v for k, v in data.items()}, group=cp_mesh.get_group())
    out = {}
    for k, v in data.items():
        out[k] = torch.cat([p[k] for p in parts]) if torch.is_tensor(v) else v
    return out


def cp_token_outputs(module, ids: torch.Tensor, mask, cp_mesh) -> torch.Tensor:
    """`module.token_outputs` (b, T-1) of input_ids (b, T) computed with the sequence split over
    `cp_mesh` (see the module docstring)."""
    from torch.distributed.nn.functional import all_gather
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention

    cp = cp_mesh.size()
    b, length = ids.shape
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            f"{module.name}: context_parallel_size={cp} takes unpadded, unpacked batches (ring "
            "attention is causal without a mask); set context_parallel_size: 1 for this batch"
        )
    if length % cp:
        raise ValueError(
            f"{module.name}: {length} tokens per sample do not split over context_parallel_size="
            f"{cp}; pad the batch to a multiple of {cp}"
        )
    _attention._cp_options.enable_load_balance = False  # contiguous slices, gathered in order
    positions = torch.arange(length, device=ids.device).expand(b, length).contiguous()
    labels = torch.roll(ids, -1, dims=1)
    local = [ids.clone(), positions, labels]
    with context_parallel(cp_mesh, buffers=local, buffer_seq_dims=[1, 1, 1]):
        ids_l, pos_l, labels_l = local
        logits = module.model(input_ids=ids_l, position_ids=pos_l, use_cache=False).logits
        # token_outputs pairs logits[t] with ids[t+1]: one dummy column each way
        out = module.token_outputs(
            torch.cat([logits, logits[:, :1]], 1), torch.cat([labels_l[:, :1], labels_l], 1)
        )
    return torch.cat(all_gather(out.contiguous(), group=cp_mesh.get_group()), dim=1)[:, :-1]
