"""Micro-batches by tokens (max_tokens_per_micro_batch) and packing of every algorithm's rows, on real
megatron-core and on the fsdp trainer (transformers + FSDP2, gloo): on a long-tailed batch the loss and
the gradients equal those of the whole batch as one unpacked micro-batch; each token micro-batch is
one packed row with no padding position.

    python -m pytest tests/integration/test_token_micro_batches.py
"""

import functools

import pytest
import torch
from helpers import build

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf import losses as L

pytestmark = pytest.mark.integration

REL = 1e-6  # the loss's relative difference, and the whole gradient's (||g - g_ref|| / ||g_ref||)
# each tensor's worst element against that tensor's largest: fp32 sums in another order. Measured on
# an AVX-512 EPYC (2026-11-30): 1.02-1.07e-6 for the sequence-mean loss's unpacked token
# micro-batches (the whole gradient's 3.4e-7), 3.4-3.8e-7 for fixed micro-batches of 2-8 samples;
# a wrong normalization is ~1 here (fixed micro-batches of a token-mean loss: 0.9-1.5)
PER_TENSOR = 3e-6


def long_tailed(vocab=500, n=16, pairs=False, seed=0):
    """SFT-shaped rows (pairs=False: n prompts, one response each) or DPO-shaped ones (n / 2 prompts,
    each with a (chosen, rejected) pair), right-padded; two responses 8x longer than the rest."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n // 2 if pairs else n):
        prompt = torch.randint(1, vocab, (3 + i % 3,), generator=gen).tolist()
        for j in range(2 if pairs else 1):
            length = (2 + (i + j) % 3) * (8 if i in (1, 2) and j == 0 else 1)
            response = torch.randint(1, vocab, (length,), generator=gen).tolist()
            samples.append(
                Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * length)
            )
    batch = RolloutBatch.from_samples(samples, pad_token_id=0).trainer_inputs()
    ref = torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return batch.replace(ref_logprobs=ref) if pairs else batch


def relative(a: list, b: list) -> float:
    """The gradient `a`'s relative difference from `b`, over all their tensors, after checking that
    no tensor is off by more than PER_TENSOR of its largest element."""
    worst = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))
    assert worst < PER_TENSOR, worst
    norm = lambda ts: torch.sqrt(sum((t.double() ** 2).sum() for t in ts))
    return (norm([x - y for x, y in zip(a, b)]) / norm(b)).item()


LOSSES = {
    "sft": (L.nll_loss_fn, False),
    "dpo": (functools.partial(L.dpo_loss_fn, beta=0.5), True),
    "ppo": (functools.partial(L.policy_loss, options=L.PolicyLossOptions()), False),  # token_mean
    "seq_mean": (  # a sequence-mean policy loss: micro-batches weigh by samples, not tokens
        functools.partial(
            L.policy_loss, options=L.PolicyLossOptions(aggregation=L.seq_mean_token_mean)
        ),
        False,
    ),
}


def with_policy_fields(batch):
    gen = torch.Generator().manual_seed(1)
    return batch.replace(
        old_logprobs=-torch.rand(batch.loss_mask.shape, generator=gen),
        advantages=torch.randn(len(batch), generator=gen),
    )


@pytest.fixture(scope="module")
def megatron_trainer(make_tiny):
    # an update below fp32 resolution: every step sees the same weights
    return build(make_tiny("tiny_llama"), lr=1e-12, clip_grad=0.0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_megatron_token_micro_batches_train_like_one_micro_batch(megatron_trainer, name):
    trainer, (loss_fn, pairs) = megatron_trainer, LOSSES[name]
    data = with_policy_fields(long_tailed(pairs=pairs))
    rows = []
    hook = trainer.model.embedding.register_forward_pre_hook(
        lambda _m, args, kwargs: rows.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )

    def step(budget, packs):
        trainer.config.max_tokens_per_micro_batch, trainer.packing.packs = budget, packs
        rows.clear()
        metrics = trainer.train_step(data, loss_fn)
        grads = [p.main_grad.clone() for p in trainer.model.parameters()]
        return metrics, grads, list(rows)

    try:
        whole, whole_grads, _ = step(None, False)  # the reference: one unpacked micro-batch
        for packs in (True, False):
            tokens, grads, shapes = step(96, packs)
            assert len(shapes) > 1  # binned: several micro-batches of unequal size
            assert tokens["loss"] == pytest.approx(whole["loss"], rel=REL), packs
            assert relative(grads, whole_grads) < REL, packs
            if packs:  # one packed row per micro-batch, under the budget, no padding run
                assert all(p == 1 and t <= 96 for p, t in shapes), shapes
                assert tokens["padding_tokens_trained"] == 0
            else:
                assert all(p * t <= 96 for p, t in shapes), shapes
        assert whole["padding_tokens_trained"] > 0  # the batch padded to its longest sample
        # forward_tokens bins too, and gives the batch's outputs back in its order
        plain = {k: data[k] for k in ("input_ids", "attention_mask")}
        trainer.config.max_tokens_per_micro_batch = None
        full = trainer.forward_tokens(plain)
        trainer.config.max_tokens_per_micro_batch = 96
        binned = trainer.forward_tokens(plain)
        assert ((binned - full) * data["loss_mask"]).abs().max() < 1e-5
    finally:
        trainer.config.max_tokens_per_micro_batch, trainer.packing.packs = None, True
        hook.remove()


def test_a_sample_over_the_budget_is_an_error_naming_the_key(megatron_trainer):
    data = long_tailed()
    megatron_trainer.config.max_tokens_per_micro_batch = 16
    try:
        with pytest.raises(ValueError, match="raise max_tokens_per_micro_batch to at least"):
            megatron_trainer.train_step(data, L.nll_loss_fn)
    finally:
        megatron_trainer.config.max_tokens_per_micro_batch = None


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_fsdp_token_micro_batches_pack_and_train_like_one_micro_batch(tiny_llama_dir, name):
    from chatgen.training.fsdp_module import FSDPModule

    loss_fn, pairs = LOSSES[name]
    data = long_tailed(pairs=pairs)
    trainer = FSDPModule(dict(load=str(tiny_llama_dir), lr=1e-12, clip_grad=0.0)).start()
    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.append([p.grad.full_tensor().clone() for p in trainer.model.parameters()])
    )
    try:
        whole = trainer.train_step(data, loss_fn)
        trainer.config.max_tokens_per_micro_batch = 96
        tokens = trainer.train_step(data, loss_fn)
    finally:
        trainer.shutdown()
    assert tokens["loss"] == pytest.approx(whole["loss"], rel=REL)
    assert relative(grads[1], grads[0]) < REL
    assert tokens["padding_tokens_trained"] == 0 < whole["padding_tokens_trained"]


def _fsdp_step(model_dir, budget):
    """One train step of this rank's half of the DPO batch (all of it in a one-rank world)."""
    from chatgen.training.fsdp_module import FSDPModule

    loss_fn, pairs = LOSSES["dpo"]
    trainer = FSDPModule(
        dict(load=str(model_dir), lr=1e-12, clip_grad=0.0, max_tokens_per_micro_batch=budget)
    ).start()
    data, rows = long_tailed(pairs=pairs), 16 // trainer.dp
    share = data.select(list(range(trainer.dp_rank * rows, (trainer.dp_rank + 1) * rows)))
    metrics = trainer.train_step(share, loss_fn)
    trainer.shutdown()
    return metrics


def test_fsdp_two_ranks_of_token_micro_batches_train_like_one_micro_batch(tiny_llama_dir):
    """The weights are shares of the global batch over both ranks, and the ranks run as many
    micro-batches (FSDP's collectives pair up) although their halves bin differently."""
    from chatgen.training.launcher import run_distributed

    whole = _fsdp_step(tiny_llama_dir, None)
    two = run_distributed(_fsdp_step, 2, args=(tiny_llama_dir, 64))
    assert two[0]["loss"] == pytest.approx(whole["loss"], rel=REL)
    assert two[0]["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert two[0]["padding_tokens_trained"] == 0
