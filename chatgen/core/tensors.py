"""Small tensor helpers every layer shares: sizes of shapes, flat buffers split back into tensors,
batch rows.

    numel((4, 8)) -> 32
    unflatten(flat, [(4, 8), (8,)]) -> [a (4, 8) view, a (8,) view] of `flat`
    unflatten_buckets(plan, flat_of) -> per bucket of plan [[(name, shape)]]: [(name, view)] of `flat_of(shapes)`
    select({"input_ids": (S, L), "note": "x"}, index) -> the rows `index` of every per-sample tensor

DEFAULT_BUCKET_BYTES is the size of one weight-sync bucket: the trainer gathers, and the engine
loads, this many bytes of parameters at a time (chatgen.param_sync, MegatronModule.hf_weights).
"""

import torch

DEFAULT_BUCKET_BYTES = 256 << 20


def numel(shape) -> int:
    """Elements of a tensor of this shape (a tuple or list of ints)."""
    n = 1
    for d in shape:
        n *= d
    return n


def unflatten(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Views of consecutive pieces of the 1-D `flat`, one per shape, in order."""
    out, offset = [], 0
    for shape in shapes:
        n = numel(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def unflatten_buckets(plan: list, flat_of):
    """Per bucket of `plan` ([[(name, shape)], ...], the order a sync sends): [(name, tensor)],
    the tensors views of the bucket's 1-D buffer `flat_of(shapes)` (received off a wire, or the
    next piece of one mapping: `slices`)."""
    for bucket in plan:
        shapes = [tuple(s) for _, s in bucket]
        yield [(n, t) for (n, _), t in zip(bucket, unflatten(flat_of(shapes), shapes))]


def slices(flat: torch.Tensor):
    """`flat_of` for `unflatten_buckets` over one buffer holding every bucket back to back."""
    offset = 0

    def flat_of(shapes):
        nonlocal offset
        size = sum(numel(s) for s in shapes)
        offset += size
        return flat[offset - size : offset]

    return flat_of


def select(data, index: torch.Tensor):
    """Rows `index` of every per-sample tensor of a batch dict or TrainBatch (tensors whose first
    dimension is the batch's sample count, taken from `input_ids`); other values are kept as they
    are."""
    if not isinstance(data, dict):
        return data.select(index)
    n = data["input_ids"].shape[0]
    return {
        k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v
        for k, v in data.items()
    }
