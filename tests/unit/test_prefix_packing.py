"""Shared-prefix packing (chatgen.training.prefix_packing) as pure logic: every output of a packed row sees
exactly the (token, position) pairs its unpacked row would, at the same position, predicting the same token.
The model-level equality (loss and gradients) is in tests/integration/test_megatron_module.py.

    python -m pytest tests/unit/test_prefix_packing.py
"""

import random

import torch

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.training.prefix_packing import pack_shared_prefix


def right_padded(rows: list, prompt_lens: list):
    """(input_ids, attention_mask, loss_mask) for token lists, each scored after its prompt: the batch GRPO
    trains on (RolloutBatch.from_samples)."""
    samples = [
        Sample(prompt_ids=row[:p], response_ids=row[p:], response_logprobs=[0.0] * (len(row) - p))
        for row, p in zip(rows, prompt_lens)
    ]
    data = RolloutBatch.from_samples(samples, pad_token_id=0).trainer_inputs()
    return data["input_ids"], data["attention_mask"], data["loss_mask"]


def visible_unpacked(ids, r, t):
    return sorted((int(ids[r, j]), j) for j in range(t + 1))


def visible_packed(plan, row, at):
    keys = (~plan.attention_mask[row, 0, at]).nonzero()[:, 0].tolist()
    return sorted((int(plan.input_ids[row, j]), int(plan.position_ids[row, j])) for j in keys)


def check_equivalent(plan, ids, keep, loss_mask):
    rows, entries, packed_rows, outputs = (x.tolist() for x in plan.index)
    covered = set()
    for r, entry, row, k in zip(rows, entries, packed_rows, outputs):
        at = int(plan.logit_positions[row, k])
        assert visible_packed(plan, row, at) == visible_unpacked(ids, r, entry)
        assert int(plan.position_ids[row, at]) == entry
        assert int(plan.labels[row, k + 1]) == int(ids[r, entry + 1])
        covered.add((r, entry))
    # every scored entry is computed
    assert {(r, t) for r, t in (loss_mask > 0).nonzero().tolist()} <= covered
    # and nothing past a row's last token
    assert all(entry < int(keep[r].sum()) - 1 for r, entry in covered)


def test_rows_sharing_a_prompt_pack_into_one_row_that_sees_what_each_row_saw():
    prompt_a, prompt_b = [5, 6, 7, 8], [9, 10, 11]
    rows = [
        prompt_a + [20, 21, 22],
        prompt_a + [30],
        prompt_b + [40, 41],
        prompt_a + [50, 51],
        prompt_b + [60],
    ]
    ids, keep, loss_mask = right_padded(rows, [4, 4, 3, 4, 3])
    plan = pack_shared_prefix(ids, keep, loss_mask)
    assert plan.input_ids.shape[0] == 2  # one packed row per prompt
    assert plan.input_ids[0, :4].tolist() == prompt_a and plan.input_ids[1, :3].tolist() == prompt_b
    assert plan.tokens_before == sum(map(len, rows)) and plan.tokens_after == (4 + 3 + 1 + 2) + (
        3 + 2 + 1
    )
    check_equivalent(plan, ids, keep, loss_mask)
    # unpack puts each output where its row and entry are; 0 elsewhere
    outputs = torch.arange(plan.labels.shape[1] - 1, dtype=torch.float32).expand(2, -1) + 1
    unpacked = plan.unpack(outputs)
    assert unpacked.shape == (5, ids.shape[1] - 1)
    assert ((unpacked != 0) == (loss_mask > 0)).all()  # here every response entry is scored


def test_a_prompt_longer_for_one_row_shares_only_with_rows_of_the_same_prefix():
    # the same prompt tokens, but row 1 is scored from a later position (a longer prefix): its own group
    rows = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7]]
    ids, keep, loss_mask = right_padded(rows, [3, 4, 3])
    plan = pack_shared_prefix(ids, keep, loss_mask)
    assert plan.input_ids.shape[0] == 2
    check_equivalent(plan, ids, keep, loss_mask)


def test_padding_positions_attend_only_to_themselves_and_are_never_read():
    rows = [[1, 2, 3, 4], [1, 2, 5], [8, 9, 10, 11, 12, 13], [8, 9, 14]]
    ids, keep, loss_mask = right_padded(rows, [2, 2, 2, 2])
    plan = pack_shared_prefix(ids, keep, loss_mask)
    padded = plan.padded(3, plan.input_ids.shape[1] + 2)
    assert padded.input_ids.shape == (3, plan.input_ids.shape[1] + 2)
    s = plan.input_ids.shape[1]
    assert torch.equal(padded.attention_mask[:2, :, :s, :s], plan.attention_mask)
    short = int((plan.segments >= 0).sum(1).argmin())  # the shorter packed row: its tail is padding
    assert int((plan.segments[short] >= 0).sum()) == 2 + 2 + 1
    for row, start in ((short, 2 + 2 + 1), (2, 0)):
        for q in range(start, padded.input_ids.shape[1]):
            assert (~padded.attention_mask[row, 0, q]).nonzero()[:, 0].tolist() == [q]
    check_equivalent(padded, ids, keep, loss_mask)


def test_batches_that_cannot_or_need_not_pack_return_none():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5]]
    ids, keep, loss_mask = right_padded(rows, [3, 3])
    assert pack_shared_prefix(ids, keep, loss_mask) is not None
    assert pack_shared_prefix(ids, keep, None) is None  # nothing says where a loss reads
    distinct = ids.clone()
    distinct[1, 0] = 9
    assert pack_shared_prefix(distinct, keep, loss_mask) is None  # no two rows share a prefix
    empty = loss_mask.clone()
    empty[1] = 0
    assert pack_shared_prefix(ids, keep, empty) is None  # a row with nothing to score
    left = keep.clone()
    left[0] = torch.tensor([0, 1, 1, 1])
    assert pack_shared_prefix(ids, left, loss_mask) is None  # left padding: positions would shift
    past_end = loss_mask.clone()
    short = keep.clone()
    short[0, 3] = 0
    assert pack_shared_prefix(ids, short, past_end) is None  # scores a padding token


def test_groups_share_rows_no_wider_than_the_longest_group():
    # one prompt's answers are long (the long tail), three prompts' short: the short groups share one row
    # instead of each padding to the long group's width, and no output sees another group's tokens
    long_prompt, short_prompts = [1, 2, 3], [[4, 5], [6, 7, 8], [9, 10]]
    rows = [long_prompt + list(range(20, 30)), long_prompt + list(range(30, 39))]
    prompt_lens = [3, 3]
    for k, prompt in enumerate(short_prompts):
        rows += [prompt + [40 + k], prompt + [50 + k, 51 + k]]
        prompt_lens += [len(prompt)] * 2
    ids, keep, loss_mask = right_padded(rows, prompt_lens)
    plan = pack_shared_prefix(ids, keep, loss_mask)
    long_group = 3 + 10 + 9
    assert plan.input_ids.shape == (
        2,
        long_group,
    )  # 4 groups in 2 rows, none wider than the longest
    assert plan.tokens_after == long_group + sum(len(p) + 3 for p in short_prompts)
    check_equivalent(plan, ids, keep, loss_mask)
    # a group's prefix is read only by its own samples
    short_row = (
        1 if int(plan.input_ids[0, 0]) == long_prompt[0] else 0
    )  # the row of the 3 short groups
    assert sorted(set(plan.prefixes[short_row].tolist()) - {-1}) == [
        0,
        3,
        6,
    ]  # each group's prefix segment
    visible = ~plan.attention_mask[short_row, 0]
    prefixes = plan.prefixes[short_row]
    for q in range(plan.input_ids.shape[1]):
        if plan.segments[short_row, q] >= 0:
            readable = {int(plan.segments[short_row, j]) for j in visible[q].nonzero()[:, 0]}
            assert readable <= {int(plan.segments[short_row, q]), int(prefixes[q])}


def test_random_batches_pack_to_rows_that_see_what_each_row_saw():
    # the layout is index arithmetic over pieces (prefixes, rows' own tokens): random batches of
    # shared and distinct prompts, ragged answers, unscored gaps, token budgets and no attention mask
    rng = random.Random(0)
    packed = 0
    for _ in range(150):
        prompts = [[rng.randint(4, 9) for _ in range(rng.randint(1, 5))] for _ in range(3)]
        rows, prompt_lens = [], []
        for _ in range(rng.randint(2, 10)):
            prompt = rng.choice(prompts)
            rows.append(prompt + [rng.randint(4, 30) for _ in range(rng.randint(1, 7))])
            prompt_lens.append(len(prompt))
        ids, keep, loss_mask = right_padded(rows, prompt_lens)
        gaps = loss_mask.clone()  # unscored entries inside an answer, the first one kept
        for r, p in enumerate(prompt_lens):
            for e in range(p, len(rows[r]) - 2):
                if rng.random() < 0.3:
                    gaps[r, e] = 0
        full = rng.random() < 0.2
        if full:  # every row as long as the batch: no attention mask
            ids, keep = ids[keep.sum(1) == ids.shape[1]], None
            gaps = gaps[: len(ids)]
            if not len(ids):
                continue
        capacity = rng.choice([None, None, 64])
        plan = pack_shared_prefix(ids, keep, gaps, capacity)
        if plan is None:
            continue
        packed += 1
        lengths = torch.full((len(ids),), ids.shape[1]) if keep is None else keep.sum(1)
        check_equivalent(plan, ids, torch.ones_like(ids) if keep is None else keep, gaps)
        assert plan.tokens_before == int(lengths.sum())
        assert plan.tokens_after == int((plan.segments >= 0).sum())
        seg, pre = plan.segments, plan.prefixes
        for row in range(seg.shape[0]):
            for q in range(seg.shape[1]):
                reads = [
                    j
                    for j in range(seg.shape[1])
                    if (
                        j == q
                        if seg[row, q] < 0
                        else j <= q and seg[row, j] in (seg[row, q], pre[row, q])
                    )
                ]
                assert (~plan.attention_mask[row, 0, q]).nonzero()[:, 0].tolist() == reads
    assert packed > 50
