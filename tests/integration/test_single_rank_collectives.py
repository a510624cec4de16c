"""megatron-core's DDP at one data-parallel rank skips its one-rank reduce-scatter and all-gather
(chatgen.training.model_build.skip_single_rank_collectives): on a real tiny trainer the short
path leaves the grad and param buffers with the bits megatron's own collectives leave, and fails
loudly if megatron renames what it relies on.

    python -m pytest tests/integration/test_single_rank_collectives.py
"""

import pytest
import torch
from helpers import build

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf import losses as L

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trainer(make_tiny):
    return build(make_tiny("tiny_llama"))


def groups(trainer):
    return [*trainer.ddp.bucket_groups, *trainer.ddp.expert_parallel_bucket_groups]


def test_every_bucket_group_takes_the_short_path_at_one_rank(trainer):
    assert groups(trainer)
    for group in groups(trainer):
        # the megatron internals the short path reads and sets
        assert group.intra_distributed_optimizer_instance_size == 1
        assert "start_grad_sync" in vars(group) and "start_param_sync" in vars(group)
        for name in ("grad_reduce_handle", "param_gather_handle", "param_gather_dispatched"):
            assert hasattr(group, name), name
        assert all(hasattr(b, "gradient_scaling_factor") for b in group.buckets)


@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_short_path_leaves_the_buffers_megatron_leaves(trainer, factor):
    gen = torch.Generator().manual_seed(0)
    for group in groups(trainer):
        megatron = type(group)  # the class's own methods run gloo's one-rank collectives
        saved = [(b.gradient_scaling_factor, b.grad_data.clone()) for b in group.buckets]
        try:
            for b in group.buckets:
                b.gradient_scaling_factor = factor
                b.grad_data.copy_(torch.randn(b.grad_data.shape, generator=gen))
            start = [b.grad_data.clone() for b in group.buckets]
            megatron.start_grad_sync(group)
            reduced = [b.grad_data.clone() for b in group.buckets]
            for b, s in zip(group.buckets, start):
                b.grad_data.copy_(s)
            group.start_grad_sync()
            assert group.grad_reduce_handle is None
            for b, r in zip(group.buckets, reduced):
                assert torch.equal(b.grad_data, r)
            if factor != 1.0:  # the scaling is the short path's own work, not a no-op
                assert not torch.equal(reduced[0], start[0])
        finally:
            for b, (f, g) in zip(group.buckets, saved):
                b.gradient_scaling_factor = f
                b.grad_data.copy_(g)
        params = [b.param_data.clone() for b in group.buckets]
        megatron.start_param_sync(group)
        group.start_param_sync()
        assert group.param_gather_handle is None and group.param_gather_dispatched
        for b, p in zip(group.buckets, params):
            assert torch.equal(b.param_data, p)


def test_a_train_step_updates_the_weights_through_the_short_path(trainer):
    samples = [
        Sample(prompt_ids=[1, 5, 9], response_ids=[4, 7, 2], response_logprobs=[0.0] * 3),
        Sample(prompt_ids=[1, 6], response_ids=[3, 8], response_logprobs=[0.0] * 2),
    ]
    data = RolloutBatch.from_samples(samples, pad_token_id=0).trainer_inputs()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(data, L.nll_loss_fn)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    changed = [not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters())]
    assert sum(changed) > len(changed) // 2
