"""How a trainer cuts a batch into micro-batches, and how much each micro-batch's loss counts.

By default (`max_tokens_per_micro_batch: null`) a batch of S samples runs as S / micro_batch_size
consecutive micro-batches, each of the batch's full width, and the loss is the mean of the
micro-batches' losses (megatron-core's and the fsdp trainer's gradient accumulation).

With `max_tokens_per_micro_batch: N` (verl: use_dynamic_bsz + ppo_max_token_len_per_gpu) whole
samples are binned, first-fit decreasing, into micro-batches of at most N tokens, each cut to its own
widest sample: a few long samples no longer widen every micro-batch. What a bin costs is what the
model runs: packed (the trainer packs each bin into one row, chatgen.training.prefix_packing) the
sum of its samples' tokens, a group sharing its prompt counted with the prompt once; unpacked, its
rows times its widest row. Samples that must meet in one loss stay in one bin: DPO's (chosen,
rejected) pairs (`rows_together`), and a packed group of samples sharing their prompt. A sample (or
such a unit) over N tokens is an error naming the key, as in verl.

Micro-batches of unequal size change what a mean over a micro-batch means, so each micro-batch's
loss is weighted by its share of the global batch (`loss_weights`): of the loss-masked tokens for a
token-mean loss, of the samples for a sequence-mean one (what the loss function declares through
`loss_unit`). The loss and the gradients are those of the whole global batch in one micro-batch, on
any number of data-parallel ranks. `plan_micro_batches` is the one place both backends call.

    plan = plan_micro_batches(batch, mbs, max_tokens, packs=True, rows_together=2)
    weights = loss_weights(plan.micro_batches, loss_unit(loss_fn), dp_group)   # sum to DP size
    out = plan.assemble(torch.cat(outputs))    # forward-only outputs back in the batch's order
"""

import dataclasses
import functools

import torch
import torch.distributed as dist

from chatgen.core.train_batch import TrainBatch

KEY = "max_tokens_per_micro_batch"


def first_fit_decreasing(sizes: list, capacity: int, rows: list | None = None) -> list:
    """Bins of item indices, largest item first, each into the first bin it still fits. A bin's
    cost is the sum of its items' sizes, or with `rows` (each item's row count) its rows times
    its largest size (a padded micro-batch). Deterministic: ties keep the items' order."""
    bins, cost = [], []  # cost: (size sum, rows, widest) of each bin
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        n = 1 if rows is None else rows[i]

        def fits(c):
            total, r, widest = c[0] + sizes[i], c[1] + n, max(c[2], sizes[i])
            return (total if rows is None else r * widest) <= capacity

        j = next((j for j, c in enumerate(cost) if fits(c)), len(bins))
        if j == len(bins):
            bins.append([])
            cost.append((0, 0, 0))
        bins[j].append(i)
        total, r, widest = cost[j]
        cost[j] = (total + sizes[i], r + n, max(widest, sizes[i]))
    return bins


def loss_unit(loss_fn) -> str:
    """What a loss function's mean runs over: "tokens" (a token mean: SFT's NLL, token_mean
    policy losses, the critic's) or "samples" (a sequence mean: DPO, the seq_mean_*
    aggregations), as chatgen.core.train_batch.loss_declares declares it (a function of the
    functools.partial keywords may give another function, whose unit holds). Undeclared (a user's
    loss or aggregation): samples, as verl scales a micro-batch's loss by its share of the
    samples."""
    fn, keywords = loss_fn, {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    unit = getattr(fn, "normalized_by", "samples")
    unit = unit(**keywords) if callable(unit) else unit
    return unit if isinstance(unit, str) else loss_unit(unit)


def rows_together(loss_fn) -> int:
    """Consecutive rows a loss reads together (2 for DPO's (chosen, rejected) pairs), declared
    by the function's `rows_together` attribute; 1 otherwise."""
    while isinstance(loss_fn, functools.partial):
        loss_fn = loss_fn.func
    return getattr(loss_fn, "rows_together", 1)


@dataclasses.dataclass
class MicroBatchPlan:
    micro_batches: list  # TrainBatch each
    rows: list  # per micro-batch: the batch rows it holds (in order)
    shape: tuple  # the batch's (S, L-1) outputs

    def assemble(self, outputs: torch.Tensor) -> torch.Tensor:
        """(S, W) forward-only outputs, the micro-batches' rows one after another, each right-
        padded to the widest micro-batch W -> (S, L-1) in the batch's row order (0 past a row's
        micro-batch width: padding no loss reads)."""
        out = outputs.new_zeros(self.shape)
        index = torch.tensor([r for rows in self.rows for r in rows], dtype=torch.long)
        out[index, : outputs.shape[1]] = outputs
        return out


def plan_micro_batches(
    data,
    micro_batch_size: int,
    max_tokens: int | None = None,
    packs: bool = False,
    together: int = 1,
    dp_group=None,
) -> MicroBatchPlan:
    """`data`'s micro-batches: fixed (`max_tokens` None: consecutive runs of `micro_batch_size`
    rows) or token bins (module docstring) with `packs` telling whether the trainer packs them
    and `together` the rows a loss reads together. With several data-parallel ranks
    (`dp_group`), every rank gets as many micro-batches (the largest count: bins are split) so
    that FSDP's per-backward collectives pair up."""
    batch = TrainBatch.of(data)
    s, length = batch.input_ids.shape
    if max_tokens is None:
        rows = [list(range(i, i + micro_batch_size)) for i in range(0, s, micro_batch_size)]
        return MicroBatchPlan(batch.split(micro_batch_size), rows, (s, length - 1))
    if s % together:
        raise ValueError(f"{s} rows do not make whole units of {together} rows (DPO pairs)")
    lengths = (
        batch.attention_mask.long().sum(-1).tolist()
        if batch.attention_mask is not None
        else [length] * s
    )
    items = _items(batch, lengths, together, packs)
    if packs:
        sizes = [size for _, size in items]
        counts = None
    else:
        sizes = [max(lengths[r] for r in members) for members, _ in items]
        counts = [len(members) for members, _ in items]
    costs = sizes if counts is None else [size * n for size, n in zip(sizes, counts)]
    if max(costs) > max_tokens:
        raise ValueError(
            f"{KEY}={max_tokens}: a sample{'' if together == 1 else ' unit'} of {max(costs)} tokens"
            f"{' (a group sharing its prompt, packed)' if packs else ''} does not fit one "
            f"micro-batch; raise {KEY} to at least {max(costs)} (or cut prompts / responses)"
        )
    bins = first_fit_decreasing(sizes, max_tokens, counts)
    bins = _even_out(bins, dp_group)
    rows = [sorted(r for i in b for r in items[i][0]) for b in bins]
    return MicroBatchPlan([_trimmed(batch.select(r)) for r in rows], rows, (s, length - 1))


def _items(batch, lengths: list, together: int, packs: bool) -> list:
    """(rows, packed size) of each unit the bins take whole: `together` consecutive rows, and
    when packed all units whose first row shares its unscored prefix (one prompt: packing runs
    it once)."""
    units = [list(range(i, i + together)) for i in range(0, len(lengths), together)]
    if not packs or batch.loss_mask is None:
        return [(u, sum(lengths[r] for r in u)) for u in units]
    ids, scored = batch.input_ids.tolist(), batch.loss_mask.bool()
    groups: dict = {}
    for u in units:
        hits = scored[u[0]].nonzero()
        prefix = int(hits[0]) + 1 if len(hits) else lengths[u[0]]
        groups.setdefault(tuple(ids[u[0]][:prefix]), []).extend(u)
    return [
        (members, len(prefix) + sum(lengths[r] - len(prefix) for r in members))
        for prefix, members in groups.items()
    ]


def _even_out(bins: list, dp_group) -> list:
    """Split the fullest bins until this rank has as many as the data-parallel rank with most."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return bins
    count = torch.tensor([len(bins)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    while len(bins) < int(count):
        b = max(bins, key=len)
        if len(b) < 2:
            raise ValueError(
                f"{KEY}: another data-parallel rank needs {int(count)} micro-batches and this one "
                f"has {len(bins)} samples only; lower the global batch's imbalance or raise {KEY}"
            )
        bins.remove(b)
        bins += [b[: len(b) // 2], b[len(b) // 2 :]]
    return bins


def _trimmed(mb: TrainBatch) -> TrainBatch:
    """The micro-batch cut to its last column holding a token (a right-padded bin of short
    samples runs at its own width): (S, L) fields to L', (S, L-1) fields to L'-1."""
    if mb.attention_mask is None:
        return mb
    held = mb.attention_mask.bool().any(0).nonzero()
    width = int(held[-1]) + 1 if len(held) else 1
    length = mb.input_ids.shape[1]
    if width == length:
        return mb

    def cut(v):
        if not torch.is_tensor(v) or v.dim() < 2:
            return v
        if v.shape[1] == length:
            return v[:, :width]
        return v[:, : width - 1] if v.shape[1] == length - 1 else v

    return dataclasses.replace(
        mb,
        **{k: cut(getattr(mb, k)) for k in TrainBatch.fields()},
        extras={k: cut(v) for k, v in mb.extras.items()},
    )


def loss_weights(micro_batches: list, unit: str, dp_group=None) -> list:
    """Each micro-batch's weight in the step's loss: its share of the global batch's units (the
    loss-masked tokens, or the samples), times the data-parallel size (the ranks' gradients are
    averaged). Sum(weight x micro-batch loss), averaged over ranks, is the loss of the global batch
    as one micro-batch."""

    def units(mb):
        if unit == "tokens" and mb.loss_mask is not None:
            return float(mb.loss_mask.sum())
        return float(len(mb))

    counts = [units(mb) for mb in micro_batches]
    total, dp = torch.tensor([sum(counts)], dtype=torch.float64), 1
    if dp_group is not None and (dp := dist.get_world_size(dp_group)) > 1:
        dist.all_reduce(total, group=dp_group)
    total = max(float(total), 1.0)
    return [dp * c / total for c in counts]


def weighted_metrics(parts: list, weights: list) -> dict:
    """One dict from the micro-batches' metric dicts under `loss_weights`: "loss" the weighted
    sum (the step's loss), a name ending in `_max` the largest, every other name the weighted
    mean."""
    total = sum(weights) or 1.0
    return {
        k: max(p[k] for p in parts)
        if k.endswith("_max")
        else sum(w * p[k] for w, p in zip(weights, parts)) / (1.0 if k == "loss" else total)
        for k in parts[0]
    }


def padding_positions(micro_batch, plan=None) -> int:
    """Positions without a token the model ran for a micro-batch: its packed rows' padding, or
    its rows' (rows x width - tokens)."""
    if plan is not None:
        return int((plan.segments < 0).sum())
    mask = micro_batch.get("attention_mask")
    return 0 if mask is None else int((mask == 0).sum())
