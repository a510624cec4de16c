"""A tied embedding's weight gradient summed in the output layer's gradient tensor
(chatgen.training.tied_embedding_grad) on a real megatron-core trainer: the grad buffer after a
train step of several micro-batches, and the weights after its Adam step, have the bits of
autograd's own sum of the two uses' gradients; an untied model is left alone.

    python -m pytest tests/integration/test_tied_embedding_grad.py
"""

import pytest
import torch
from helpers import build

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf import losses as L
from chatgen.training import tied_embedding_grad

pytestmark = pytest.mark.integration


def installed(trainer) -> bool:
    return "forward" in vars(trainer.model.embedding.word_embeddings)


def step(trainer) -> tuple[list, list]:
    """One train step of 3 micro-batches (tokens repeated within and across samples); the grad
    buffers and the weights after it."""
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(1, 40, (5,), generator=gen).tolist(),
            response_ids=torch.randint(1, 40, (4,), generator=gen).tolist(),
            response_logprobs=[0.0] * 4,
        )
        for _ in range(6)
    ]
    data = RolloutBatch.from_samples(samples, pad_token_id=0).trainer_inputs()
    trainer.train_step(data, L.nll_loss_fn)
    grads = [b.grad_data.clone() for g in trainer.ddp.bucket_groups for b in g.buckets]
    return grads, [p.detach().clone() for p in trainer.model.parameters()]


def test_the_tied_gradient_has_autograd_s_bits(make_tiny, monkeypatch):
    model_dir = make_tiny("tiny_llama", tie_word_embeddings=True)
    settings = {"lr": 1e-2, "micro_batch_size": 2, "global_batch_size": 6}
    trainer = build(model_dir, **settings)
    assert installed(trainer)
    grads, weights = step(trainer)
    monkeypatch.setattr(tied_embedding_grad, "install", lambda model: False)
    plain = build(model_dir, **settings)
    assert not installed(plain)
    plain_grads, plain_weights = step(plain)
    assert any(g.abs().sum() > 0 for g in grads)
    for a, b in zip(grads, plain_grads, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # -0.0 and 0.0 too
    for a, b in zip(weights, plain_weights, strict=True):
        assert torch.equal(a, b)


def test_an_untied_model_is_left_alone(make_tiny):
    assert not installed(build(make_tiny("tiny_llama")))
