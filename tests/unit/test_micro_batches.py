"""Token micro-batches' binning and loss weights (chatgen.training.micro_batches), pure logic on small
tensors; the trainers' equality with one micro-batch is tests/integration/test_token_micro_batches.py.

    python -m pytest tests/unit/test_micro_batches.py
"""

import pytest
import torch

from chatgen.core.train_batch import TrainBatch
from chatgen.training.micro_batches import (
    first_fit_decreasing,
    loss_weights,
    plan_micro_batches,
    weighted_metrics,
)


def right_padded(lengths, prompt=2, shared_prompt=False):
    """Rows of the given lengths, the first `prompt` tokens unscored; distinct prompts unless
    shared_prompt."""
    s, width = len(lengths), max(lengths)
    ids = torch.zeros(s, width, dtype=torch.long)
    attention = torch.zeros(s, width, dtype=torch.long)
    loss = torch.zeros(s, width - 1)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.arange(1, n + 1) + (0 if shared_prompt else 100 * r)
        ids[r, prompt:n] += 1000 * r  # every response its own
        attention[r, :n] = 1
        loss[r, prompt - 1 : n - 1] = 1
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss)


def test_first_fit_decreasing_sums_or_pads_and_is_deterministic():
    sizes = [3, 9, 4, 4, 2]
    assert first_fit_decreasing(sizes, 10) == [[1], [2, 3, 4], [0]]
    # padded: a bin costs its rows times its widest item
    assert first_fit_decreasing(sizes, 12, rows=[1] * 5) == [[1], [2, 3, 0], [4]]
    assert first_fit_decreasing(sizes, 10) == first_fit_decreasing(sizes, 10)


def test_long_tail_bins_cut_to_their_own_width_and_come_back_in_order():
    batch = right_padded([40, 6, 5, 6, 7, 5, 6, 38])
    plan = plan_micro_batches(batch, 8, max_tokens=48)
    widths = [mb.input_ids.shape for mb in plan.micro_batches]
    assert all(b * t <= 48 for b, t in widths) and len(widths) == 3
    assert sorted(r for rows in plan.rows for r in rows) == list(range(8))
    for mb, rows in zip(plan.micro_batches, plan.rows):
        width = mb.input_ids.shape[1]
        assert torch.equal(mb.input_ids, batch.input_ids[rows, :width])
        assert torch.equal(mb.loss_mask, batch.loss_mask[rows, : width - 1])
    outputs = torch.cat(
        [
            torch.nn.functional.pad(
                mb.input_ids[:, 1:].float(), (0, 39 - mb.input_ids.shape[1] + 1)
            )
            for mb in plan.micro_batches
        ]
    )
    back = plan.assemble(outputs)
    assert torch.equal(back * batch.loss_mask, batch.input_ids[:, 1:].float() * batch.loss_mask)


def test_packed_bins_count_tokens_and_keep_pairs_and_prompt_groups_together():
    # DPO-like: rows 2k, 2k + 1 are a pair; sizes 3 + 5, 3 + 9, ...
    batch = right_padded([5, 9, 20, 4, 6, 6, 21, 3])
    plan = plan_micro_batches(batch, 8, max_tokens=30, packs=True, together=2)
    for rows in plan.rows:
        assert all(r % 2 == 0 and r + 1 in rows for r in rows if r % 2 == 0)
        assert sum(batch.attention_mask[rows].sum(-1).tolist()) <= 30
    # packed, a group sharing its prompt counts it once: 4 rows of 10 sharing 2 tokens fit 34 (unpacked
    # 3 rows of 10 do)
    shared = right_padded([10] * 4, shared_prompt=True)
    assert len(plan_micro_batches(shared, 4, max_tokens=34, packs=True).micro_batches) == 1
    assert len(plan_micro_batches(shared, 4, max_tokens=34, packs=False).micro_batches) == 2


def test_a_unit_over_the_budget_names_the_key_and_the_fix():
    batch = right_padded([5, 9, 20, 4])
    with pytest.raises(ValueError, match="raise max_tokens_per_micro_batch to at least 40"):
        plan_micro_batches(batch, 4, max_tokens=30, together=2)  # the pair (20, 4) padded: 2 x 20


def test_weights_give_the_global_token_mean_and_sample_mean():
    batch = right_padded([12, 3, 4, 11, 5])
    plan = plan_micro_batches(batch, 5, max_tokens=24)
    values = torch.randn(batch.loss_mask.shape)
    for unit in ("tokens", "samples"):
        weights = loss_weights(plan.micro_batches, unit)
        assert sum(weights) == pytest.approx(1.0)
        parts = []
        for mb, rows in zip(plan.micro_batches, plan.rows):
            v, m = values[rows, : mb.loss_mask.shape[1]], mb.loss_mask
            per_row = (v * m).sum(1) / m.sum(1)
            parts.append(
                {"loss": float((v * m).sum() / m.sum() if unit == "tokens" else per_row.mean())}
            )
        whole = (
            (values * batch.loss_mask).sum() / batch.loss_mask.sum()
            if unit == "tokens"
            else ((values * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)).mean()
        )
        assert weighted_metrics(parts, weights)["loss"] == pytest.approx(float(whole), rel=1e-6)


def test_fixed_micro_batches_are_consecutive_and_full_width():
    batch = right_padded([12, 3, 4, 11])
    plan = plan_micro_batches(batch, 2)
    assert plan.rows == [[0, 1], [2, 3]]
    assert all(mb.input_ids.shape == (2, 12) for mb in plan.micro_batches)
