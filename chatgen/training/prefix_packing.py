"""Shared-prefix packing: train the n samples of a prompt with the prompt computed once.

A GRPO group is n rows that begin with the same prompt. Trained as n rows, the prompt's forward and
backward run n times; yet its hidden states are the same in every row (a token attends only to
earlier tokens), and the gradient of a sum of losses through them is the sum of the rows' gradients.
Packing puts each group in ONE row: the prompt once, then every sample's own tokens, each segment
attending to the prompt and causally to itself, with the positions (RoPE) it had in its own row.
Logits are computed only where a loss reads them. Loss and gradients are those of the unpacked batch
up to float summation order (tests/integration/test_megatron_module.py). For 8 samples of a 50-token
prompt with 16-token answers, a row of 178 tokens replaces 8 of 66: 2.97x fewer tokens. Groups then
share rows (first-fit decreasing, no row longer than the longest group): one group of long answers
no longer widens every other group's row to its length. In bench_async's long tail (one prompt in 8
answered at 112 tokens, n = 4) 2 rows of 463 tokens replace 8.

    plan = pack_shared_prefix(input_ids, attention_mask, loss_mask)   # None: nothing to share / cannot pack
    model(plan.input_ids, plan.position_ids, plan.attention_mask)      # output layer sees plan.logit_positions
    logprobs = plan.unpack(outputs)                                     # (b, T-1), 0 where no output was computed

The shared part of a row is its tokens up to and including the position that predicts its first
loss-masked token (loss_mask entry t scores token t + 1, predicted from position t); rows with the
same such prefix form a group. A row is packable when it is right-padded (attention_mask a run of
ones, then zeros) and its loss mask reads only its own tokens. Used by MegatronModule.train_step
(`pack_shared_prefix`, default on).
"""

from dataclasses import dataclass

import numpy as np
import torch

from chatgen.training.micro_batches import first_fit_decreasing


@dataclass
class PackedBatch:
    """Packed rows for a micro-batch of b rows of T tokens; P packed rows of S tokens, K outputs
    each."""

    input_ids: torch.Tensor  # (P, S) long; padding 0
    position_ids: torch.Tensor  # (P, S) each token's position in its own unpacked row
    # (P, S) the segment of each token: a group's shared prefix or one row's own tokens (ids unique
    # in their packed row); -1 = padding
    segments: torch.Tensor
    # (P, S) the segment of the shared prefix each token reads besides its own (a prefix token: its
    # own)
    prefixes: torch.Tensor
    # (P, 1, S, S) bool, True = do not attend (megatron's convention): `_mask(segments, prefixes)`
    attention_mask: torch.Tensor
    # (P, K + 1) packed positions whose logits are needed; the last column a dummy
    logit_positions: torch.Tensor
    labels: torch.Tensor  # (P, K + 1): column k + 1 is the token predicted at logit_positions[:, k]
    index: tuple  # (rows, entries) in (b, T-1) <- (packed rows, outputs) in (P, K)
    shape: tuple  # (b, T-1)
    tokens_before: int  # real tokens the unpacked micro-batch would run
    tokens_after: int  # real tokens the packed rows run

    def unpack(self, outputs: torch.Tensor) -> torch.Tensor:
        """(P, K) per-output values (with gradient) -> (b, T-1) in the unpacked layout, 0
        elsewhere."""
        rows, entries, packed_rows, outputs_k = self.index
        out = outputs.new_zeros(self.shape)
        out[rows, entries] = outputs[packed_rows, outputs_k]
        return out

    def padded(self, rows: int, length: int) -> "PackedBatch":
        """The same batch with all-padding rows / positions appended up to (rows, length)
        (pipeline stages exchange tensors of one shape for every micro-batch)."""
        p, s = self.input_ids.shape
        if (p, s) == (rows, length):
            return self

        def pad(x, width, fill=0):
            out = x.new_full((rows, width), fill)
            out[:p, : x.shape[1]] = x
            return out

        k1 = self.logit_positions.shape[1]
        segments, prefixes = pad(self.segments, length, -1), pad(self.prefixes, length, -1)
        return PackedBatch(
            pad(self.input_ids, length),
            pad(self.position_ids, length),
            segments,
            prefixes,
            _mask(segments, prefixes),
            pad(self.logit_positions, k1),
            pad(self.labels, k1),
            self.index,
            self.shape,
            self.tokens_before,
            self.tokens_after,
        )


def _mask(segments: torch.Tensor, prefixes: torch.Tensor) -> torch.Tensor:
    """(P, S) segments and prefixes -> (P, 1, S, S) megatron mask: query i may read key j <= i of its own
    segment or of its group's prefix; a padding query (-1) reads itself only (a row of nothing would softmax to
    NaN). Built in numpy, one thread: torch splits each element-wise pass over P x S x S booleans
    over its intra-op threads, and on a busy 2-core machine every pass then waits for the other
    thread (tens of ms a micro-batch against ~1 ms)."""
    seg, pre = segments.cpu().numpy(), prefixes.cpu().numpy()
    return torch.from_numpy(_mask_np(seg, pre)).to(segments.device)


def _mask_np(seg: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """`_mask` of numpy (P, S) segments and prefixes: (P, 1, S, S) bool, True = do not attend."""
    s = seg.shape[1]
    seg_q, seg_k = seg[:, :, None], seg[:, None, :]
    allowed = (seg_k == pre[:, :, None]) | (seg_k == seg_q)
    allowed &= np.tri(s, dtype=bool)
    pad = seg < 0  # (P, S) padding queries: themselves only
    allowed[pad] = False
    rows, cols = pad.nonzero()
    allowed[rows, cols, cols] = True
    return ~allowed[:, None]


def _ragged(counts: np.ndarray) -> tuple:
    """For owners of `counts[i]` consecutive elements each: every element's owner and its index
    within the owner's run."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def pack_shared_prefix(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    capacity: int | None = None,
) -> PackedBatch | None:
    """Pack rows sharing their unscored prefix (module docstring). None when no two rows share
    one, when a row has nothing to score, is not right-padded, or its loss mask reads past its
    last token (then train unpacked). With `capacity` (a token budget: max_tokens_per_micro_batch)
    every row packs, sharing or not, into rows of up to that many tokens (one row for a
    micro-batch binned under it: no padding). The layout is planned per piece (a prefix, a row's
    own tokens) in Python and laid out per token with numpy index arithmetic: it runs for every
    micro-batch of every train step."""
    if loss_mask is None:
        return None
    b, t = input_ids.shape
    ids = input_ids.cpu().numpy()
    scored = loss_mask.cpu().bool().numpy()
    columns = np.arange(t)
    if attention_mask is None:
        lengths = np.full(b, t)
    else:
        keep = attention_mask.cpu().bool().numpy()
        lengths = keep.sum(-1)
        if (keep != (columns < lengths[:, None])).any():  # left or inner padding
            return None
    if not scored.any(-1).all():
        return None
    first = scored.argmax(-1)  # each row's first scored entry, its last scored one below
    last = scored.shape[1] - 1 - scored[:, ::-1].argmax(-1)
    if (last > lengths - 2).any():
        return None
    groups: dict = {}  # prefix bytes -> member rows; equal bytes of int64 ids = equal prefixes
    for r in range(b):
        groups.setdefault(ids[r, : first[r] + 1].tobytes(), []).append(r)
    if len(groups) == b and capacity is None:
        return None

    lengths = lengths.tolist()
    groups = [(int(first[members[0]]), members) for members in groups.values()]
    sizes = [f + 1 + sum(lengths[r] - f - 1 for r in members) for f, members in groups]
    # pieces of the packed rows, in order: (packed row, source row, first column, end column,
    # segment, prefix segment, first packed position); the outputs: (packed row, source row, f, n,
    # the prefix's last packed position, the member's first packed position, its first output)
    pieces, outputs = [], []
    widths, counts = [], []  # per packed row: tokens, outputs
    for j, in_row in enumerate(first_fit_decreasing(sizes, max(capacity or 0, *sizes))):
        at, segment, count = 0, 0, 0
        for f, members in (groups[g] for g in in_row):
            own = segment
            pieces.append((j, members[0], 0, f + 1, own, own, at))
            at += f + 1
            prefix_end = at - 1
            for r in members:
                segment += 1
                n = lengths[r]
                pieces.append((j, r, f + 1, n, segment, own, at))
                outputs.append((j, r, f, n, prefix_end, at, count))
                at += n - f - 1
                count += n - f - 1
            segment += 1
        widths.append(at)
        counts.append(count)

    p, s, k = len(widths), max(widths), max(counts)
    pj, pr, pa, pe, pseg, ppre, pstart = np.array(pieces, dtype=np.int64).T
    piece, within = _ragged(pe - pa)  # each packed token's piece, its index there
    column = pa[piece] + within  # the token's column (and position) in its own row
    packed_row, packed_at = pj[piece], pstart[piece] + within

    def laid_out(values, fill, width=s):
        out = np.full((p, width), fill, dtype=np.int64)
        out[packed_row, packed_at] = values
        return out

    seg_np, pre_np = laid_out(pseg[piece], -1), laid_out(ppre[piece], -1)

    oj, orow, of, on, oprefix, ostart, ocount = np.array(outputs, dtype=np.int64).T
    # outputs per member: entries f .. n-2; each output's member, its index there
    member, kk = _ragged(on - of - 1)
    # entry e predicts token e + 1 from position e: the prefix's last position for e = f, else
    # its own
    logit_at = np.where(kk == 0, oprefix[member], ostart[member] + kk - 1)
    o_row = oj[member]
    outputs_k = ocount[member] + kk
    rows, entries = orow[member], of[member] + kk
    labels_v = ids[rows, entries + 1]
    at_np = np.zeros((p, k + 1), dtype=np.int64)
    at_np[o_row, outputs_k] = logit_at
    labels_np = np.zeros((p, k + 1), dtype=np.int64)
    labels_np[o_row, outputs_k + 1] = labels_v

    device = input_ids.device

    def tensor(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)

    return PackedBatch(
        input_ids=tensor(laid_out(ids[pr[piece], column], 0)),
        position_ids=tensor(laid_out(column, 0)),
        segments=tensor(seg_np),
        prefixes=tensor(pre_np),
        attention_mask=torch.from_numpy(_mask_np(seg_np, pre_np)).to(device),
        logit_positions=tensor(at_np),
        labels=tensor(labels_np),
        index=tuple(tensor(x) for x in (rows, entries, o_row, outputs_k)),
        shape=(b, t - 1),
        tokens_before=sum(lengths),
        tokens_after=sum(widths),
    )
