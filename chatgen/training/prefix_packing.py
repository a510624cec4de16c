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
    NaN)."""
    s = segments.shape[1]
    seg_q, seg_k = segments.unsqueeze(2), segments.unsqueeze(1)
    eye = torch.eye(s, dtype=torch.bool, device=segments.device)
    allowed = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril() & (
        (seg_k == prefixes.unsqueeze(2)) | (seg_k == seg_q)
    )
    return ~torch.where(seg_q < 0, eye, allowed).unsqueeze(1)


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
    micro-batch binned under it: no padding)."""
    if loss_mask is None:
        return None
    b, t = input_ids.shape
    scored = loss_mask.cpu().bool()
    if attention_mask is None:
        lengths = [t] * b
    else:
        keep = attention_mask.cpu().bool()
        lengths = keep.sum(-1).tolist()
        if any(not keep[r, :n].all() for r, n in enumerate(lengths)):  # left or inner padding
            return None
    tokens = input_ids.tolist()
    groups: dict = {}
    for r in range(b):
        hits = scored[r].nonzero()
        if not len(hits) or int(hits[-1]) > lengths[r] - 2:
            return None
        groups.setdefault(tuple(tokens[r][: int(hits[0]) + 1]), []).append(r)
    if len(groups) == b and capacity is None:
        return None

    groups = list(groups.items())
    sizes = [
        len(prefix) + sum(lengths[r] - len(prefix) for r in members) for prefix, members in groups
    ]
    packed = []  # per packed row: (tokens, positions, segments, prefixes, logit positions, labels)
    rows, entries, packed_rows, outputs_k = [], [], [], []
    for j, in_row in enumerate(first_fit_decreasing(sizes, max(capacity or 0, *sizes))):
        row_ids, row_pos, row_seg, row_prefix, row_at, row_labels = [], [], [], [], [], []
        segment = 0
        for prefix, members in (groups[g] for g in in_row):
            f, own = len(prefix) - 1, segment
            row_ids += prefix
            row_pos += range(f + 1)
            row_seg += [own] * (f + 1)
            row_prefix += [own] * (f + 1)
            at_prefix_end = len(row_ids) - 1
            for r in members:
                segment += 1
                start, n = len(row_ids), lengths[r]
                row_ids += tokens[r][f + 1 : n]
                row_pos += range(f + 1, n)
                row_seg += [segment] * (n - f - 1)
                row_prefix += [own] * (n - f - 1)
                # entry e predicts token e + 1 from position e: the prefix's last position for e =
                # f, else its own
                row_at += [at_prefix_end] + list(range(start, start + n - f - 2))
                row_labels += tokens[r][f + 1 : n]
                rows += [r] * (n - f - 1)
                entries += range(f, n - 1)
                packed_rows += [j] * (n - f - 1)
                outputs_k += range(len(row_at) - (n - f - 1), len(row_at))
            segment += 1
        packed.append((row_ids, row_pos, row_seg, row_prefix, row_at, row_labels))

    p, s, k = len(packed), max(len(row[0]) for row in packed), max(len(row[4]) for row in packed)
    device = input_ids.device

    def stack(i, width, fill, shift=0):  # field i of every packed row, right-padded with `fill`
        out = torch.full((p, width), fill, dtype=torch.long)
        for j, row in enumerate(packed):
            out[j, shift : shift + len(row[i])] = torch.tensor(row[i], dtype=torch.long)
        return out.to(device)

    segments, prefixes = stack(2, s, -1), stack(3, s, -1)
    return PackedBatch(
        input_ids=stack(0, s, 0),
        position_ids=stack(1, s, 0),
        segments=segments,
        prefixes=prefixes,
        attention_mask=_mask(segments, prefixes),
        logit_positions=stack(4, k + 1, 0),
        labels=stack(5, k + 1, 0, shift=1),
        index=tuple(
            torch.tensor(x, dtype=torch.long, device=device)
            for x in (rows, entries, packed_rows, outputs_k)
        ),
        shape=(b, t - 1),
        tokens_before=sum(lengths),
        tokens_after=sum(len(row[0]) for row in packed),
    )
