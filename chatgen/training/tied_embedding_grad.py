"""The weight gradient of a tied embedding (the input embedding and the output layer share one
weight) summed in the output layer's gradient tensor instead of a second vocabulary-wide one.

Autograd sums the two uses' gradients of the shared weight: the output layer's (V, H) weight
gradient and the embedding's, which F.embedding's backward writes into a fresh zeroed (V, H)
tensor though a micro-batch touches a few hundred of its rows; the sum is a third pass over V x H.
For SmolLM2 (V 49152, H 576, fp32) that is a fresh 108 MiB of pages, its zeroing and a full add
per micro-batch (docs/long_context.md, "SmolLM2's episode, per phase"). Here the output layer hands
its gradient to the embedding's backward (`_OutputWeight`), which adds the embedding's rows into it
(`_TiedEmbedding`): the embedding's gradient is summed per touched row into a compact (rows, H)
tensor in the order F.embedding's backward sums it, then added to the output layer's rows; every
other row gets + 0.0, which is what adding F.embedding's zero does (a -0.0 becomes 0.0). The
shared weight's gradient has the same bits (tests/unit/test_tied_embedding_sums.py against
F.embedding's backward, tests/integration/test_tied_embedding_grad.py on a megatron trainer).

    install(model)   # a megatron GPTModel chunk on the CPU; returns whether it applies
"""

import torch
import torch.nn.functional as F


class _TiedEmbedding(torch.autograd.Function):
    """F.embedding(ids, weight) whose backward adds its gradient into the output layer's (left
    in `slot` by `_OutputWeight`) and returns the sum as the weight's only gradient."""

    @staticmethod
    def forward(ctx, ids, weight, slot):
        ctx.save_for_backward(ids)
        ctx.slot, ctx.weight_shape = slot, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        rows, touched = _row_sums(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        if ctx.slot:
            total = ctx.slot.pop()
            total.add_(0.0)  # the untouched rows: + F.embedding's zero
        else:  # the logits did not depend on the output layer's weight (nothing was left)
            total = grad.new_zeros(ctx.weight_shape)
        # rows are distinct: one add each, as index_add_ would do, without its loop per row
        return None, total.index_copy_(0, rows, total.index_select(0, rows).add_(touched)), None


def _row_sums(ids, grad):
    """(the distinct ids, (len, H) their rows' sums): F.embedding's backward sums a row's
    positions in position order starting from zero (an index_add_ into zeros, a Python-level loop
    over positions); here the k-th occurrence of every id is added at once, k = 0, 1, ..., which
    is the same order per row with as many steps as the most repeated id occurs."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    order = torch.argsort(inverse, stable=True)  # positions by row, in position order within it
    row_of = inverse[order]
    counts = torch.bincount(inverse, minlength=len(rows))
    occurrence = torch.arange(len(order)) - (counts.cumsum(0) - counts)[row_of]
    sums = grad.new_zeros(len(rows), grad.shape[-1])
    for k in range(int(counts.max()) if len(order) else 0):
        at = occurrence == k
        sums[row_of[at]] += grad[order[at]]
    return rows, sums


class _OutputWeight(torch.autograd.Function):
    """The shared weight as the output layer reads it; its gradient goes to `slot`, for
    `_TiedEmbedding`'s backward, instead of to autograd's sum."""

    @staticmethod
    def forward(ctx, weight, slot):
        ctx.slot = slot
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.append(grad)
        return None, None


def install(model) -> bool:
    """Route `model`'s tied embedding gradient through one tensor (module docstring), when the
    embedding and the output layer are on the CPU, in this chunk, share their weight, and are not
    split over tensor-parallel ranks (megatron's VocabParallelEmbedding then is F.embedding), and
    no multi-token prediction head reads the output layer too. Returns whether it did."""
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if not (
        getattr(model, "share_embeddings_and_output_weights", False)
        and model.pre_process
        and model.post_process
        and embedding is not None
        and embedding.weight.device.type == "cpu"  # CUDA's F.embedding backward sums otherwise
        and embedding.tp_group.size() == 1
        and not embedding.deterministic_mode
        and not embedding.reduce_scatter_embeddings
        and not getattr(model.config, "mtp_num_layers", None)
    ):
        return False
    slots = []  # this forward's slot: the embedding runs first, the output layer last

    def embed(input_):
        slots[:] = [[]]
        return _TiedEmbedding.apply(input_, embedding.weight, slots[0])

    def output_weight(_layer, args, kwargs):
        if kwargs.get("weight") is not None and torch.is_grad_enabled() and slots:
            kwargs["weight"] = _OutputWeight.apply(kwargs["weight"], slots[0])
        return args, kwargs

    embedding.forward = embed
    model.output_layer.register_forward_pre_hook(output_weight, with_kwargs=True)
    return True
