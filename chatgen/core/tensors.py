"""Small tensor helpers every layer shares: sizes of shapes, flat buffers split back into tensors, batch rows.

    numel((4, 8)) -> 32
    unflatten(flat, [(4, 8), (8,)]) -> [a (4, 8) view, a (8,) view] of `flat`
    select({"input_ids": (S, L), "note": "x"}, index) -> the rows `index` of every per-sample tensor

DEFAULT_BUCKET_BYTES is the size of one weight-sync bucket: the trainer gathers, and the engine loads, this
many bytes of parameters at a time (chatgen.param_sync, MegatronModule.hf_weights).
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
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def select(data: dict, index: torch.Tensor) -> dict:
    """Rows `index` of every per-sample tensor of a batch dict (tensors whose first dimension is the batch's
    sample count, taken from `input_ids`); other values are kept as they are."""
    n = data["input_ids"].shape[0]
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in data.items()}
