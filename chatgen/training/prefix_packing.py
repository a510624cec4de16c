"""Shared-prefix packing: train the n samples of a prompt with the prompt computed once.

A GRPO group is n rows that begin with the same prompt. Trained as n rows, the prompt's forward and backward run n
times; yet its hidden states are the same in every row (a token attends only to earlier tokens), and the gradient
of a sum of losses through them is the sum of the rows' gradients. Packing puts each group in ONE row: the prompt
once, then every sample's own tokens, each segment attending to the prompt and causally to itself, with the
positions (RoPE) it had in its own row. Logits are computed only where a loss reads them. Loss and gradients are
those of the unpacked batch up to float summation order (tests/integration/test_megatron_module.py). For 8
samples of a 50-token prompt with 16-token answers, a row of 178 tokens replaces 8 of 66: 2.97x fewer tokens.

    plan = pack_shared_prefix(input_ids, attention_mask, loss_mask)   # None: nothing to share / cannot pack
    model(plan.input_ids, plan.position_ids, plan.attention_mask)      # output layer sees plan.logit_positions
    logprobs = plan.unpack(outputs)                                     # (b, T-1), 0 where no output was computed

The shared part of a row is its tokens up to and including the position that predicts its first loss-masked
token (loss_mask entry t scores token t + 1, predicted from position t); rows with the same such prefix form a
group. A row is packable when it is right-padded (attention_mask a run of ones, then zeros) and its loss mask
reads only its own tokens. Used by MegatronModule.train_step (`pack_shared_prefix`, default on).
"""
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """Packed rows for a micro-batch of b rows of T tokens; P packed rows of S tokens, K outputs each."""
    input_ids: torch.Tensor       # (P, S) long; padding 0
    position_ids: torch.Tensor    # (P, S) each token's position in its own unpacked row
    attention_mask: torch.Tensor  # (P, 1, S, S) bool, True = do not attend (megatron's convention)
    logit_positions: torch.Tensor  # (P, K + 1) packed positions whose logits are needed; the last column a dummy
    labels: torch.Tensor          # (P, K + 1): column k + 1 is the token predicted at logit_positions[:, k]
    index: tuple                  # (rows, entries) in (b, T-1) <- (packed rows, outputs) in (P, K)
    shape: tuple                  # (b, T-1)
    tokens_before: int            # real tokens the unpacked micro-batch would run
    tokens_after: int             # real tokens the packed rows run

    def unpack(self, outputs: torch.Tensor) -> torch.Tensor:
        """(P, K) per-output values (with gradient) -> (b, T-1) in the unpacked layout, 0 elsewhere."""
        rows, entries, packed_rows, outputs_k = self.index
        out = outputs.new_zeros(self.shape)
        out[rows, entries] = outputs[packed_rows, outputs_k]
        return out

    def padded(self, rows: int, length: int) -> "PackedBatch":
        """The same batch with all-padding rows / positions appended up to (rows, length) (pipeline stages
        exchange tensors of one shape for every micro-batch). A padding position attends to itself only."""
        p, s = self.input_ids.shape
        if (p, s) == (rows, length):
            return self
        ids = self.input_ids.new_zeros(rows, length)
        ids[:p, :s] = self.input_ids
        pos = self.position_ids.new_zeros(rows, length)
        pos[:p, :s] = self.position_ids
        mask = ~torch.eye(length, dtype=torch.bool).expand(rows, 1, length, length).clone()
        mask[:p, :, :s, :s] = self.attention_mask
        k1 = self.logit_positions.shape[1]
        logit_positions = self.logit_positions.new_zeros(rows, k1)
        logit_positions[:p] = self.logit_positions
        labels = self.labels.new_zeros(rows, k1)
        labels[:p] = self.labels
        return PackedBatch(ids, pos, mask, logit_positions, labels, self.index, self.shape, self.tokens_before,
                           self.tokens_after)


def pack_shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       loss_mask: torch.Tensor | None) -> PackedBatch | None:
    """Pack rows sharing their unscored prefix (module docstring). None when no two rows share one, when a row
    has nothing to score, is not right-padded, or its loss mask reads past its last token (then train unpacked)."""
    if loss_mask is None:
        return None
    b, t = input_ids.shape
    ids, scored = input_ids.cpu(), loss_mask.cpu().bool()
    if attention_mask is None:
        lengths = [t] * b
    else:
        keep = attention_mask.cpu().bool()
        lengths = keep.sum(-1).tolist()
        if any(not keep[r, :n].all() for r, n in enumerate(lengths)):  # left or inner padding
            return None
    groups: dict = {}
    firsts = []
    for r in range(b):
        hits = scored[r].nonzero()
        if not len(hits) or int(hits[-1]) > lengths[r] - 2:
            return None
        f = int(hits[0])
        firsts.append(f)
        groups.setdefault(tuple(ids[r, :f + 1].tolist()), []).append(r)
    if len(groups) == b:
        return None

    packed_ids, packed_pos, segments, outputs = [], [], [], []
    for (prefix, members) in groups.items():
        f = len(prefix) - 1
        row_ids, row_pos, row_seg = list(prefix), list(range(f + 1)), [0] * (f + 1)
        row_out = []  # (logit position, label, unpacked row, entry)
        for i, r in enumerate(members, start=1):
            start, n = len(row_ids), lengths[r]
            row_ids += ids[r, f + 1:n].tolist()
            row_pos += range(f + 1, n)
            row_seg += [i] * (n - f - 1)
            for entry in range(f, n - 1):  # entry predicts token entry + 1, from position entry
                at = f if entry == f else start + entry - f - 1
                row_out.append((at, int(ids[r, entry + 1]), r, entry))
        packed_ids.append(row_ids)
        packed_pos.append(row_pos)
        segments.append(row_seg)
        outputs.append(row_out)

    p, s, k = len(packed_ids), max(map(len, packed_ids)), max(map(len, outputs))
    input_ids_p = torch.zeros(p, s, dtype=torch.long)
    position_ids = torch.zeros(p, s, dtype=torch.long)
    seg = torch.full((p, s), -1, dtype=torch.long)  # -1: padding
    logit_positions = torch.zeros(p, k + 1, dtype=torch.long)
    labels = torch.zeros(p, k + 1, dtype=torch.long)
    rows, entries, packed_rows, outputs_k = [], [], [], []
    for j, (row_ids, row_pos, row_seg, row_out) in enumerate(zip(packed_ids, packed_pos, segments, outputs)):
        input_ids_p[j, :len(row_ids)] = torch.tensor(row_ids)
        position_ids[j, :len(row_pos)] = torch.tensor(row_pos)
        seg[j, :len(row_seg)] = torch.tensor(row_seg)
        for kk, (at, label, r, entry) in enumerate(row_out):
            logit_positions[j, kk] = at
            labels[j, kk + 1] = label
            rows.append(r), entries.append(entry), packed_rows.append(j), outputs_k.append(kk)
    # query i may read key j <= i of the prompt (segment 0) or of its own segment; a padding query reads itself
    seg_q, seg_k = seg.unsqueeze(2), seg.unsqueeze(1)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & ((seg_k == 0) | (seg_k == seg_q))
    allowed = torch.where(seg_q < 0, torch.eye(s, dtype=torch.bool), allowed)
    device = input_ids.device
    return PackedBatch(
        input_ids=input_ids_p.to(device), position_ids=position_ids.to(device),
        attention_mask=(~allowed).unsqueeze(1).to(device), logit_positions=logit_positions.to(device),
        labels=labels.to(device),
        index=tuple(torch.tensor(x, dtype=torch.long, device=device)
                    for x in (rows, entries, packed_rows, outputs_k)),
        shape=(b, t - 1), tokens_before=sum(lengths), tokens_after=sum(map(len, packed_ids)))
