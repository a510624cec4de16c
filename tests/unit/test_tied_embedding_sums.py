"""chatgen.training.tied_embedding_grad's arithmetic against torch's own: the embedding's row sums
have the bits of F.embedding's backward (repeated ids, signed zeros), and a tied weight's gradient
through `_TiedEmbedding` / `_OutputWeight` has the bits of autograd's sum of the two uses'.

    python -m pytest tests/unit/test_tied_embedding_sums.py
"""

import pytest
import torch
import torch.nn.functional as F

from chatgen.training.tied_embedding_grad import _OutputWeight, _row_sums, _TiedEmbedding


def bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize(
    "vocab, ids_high, shape",
    [(4096, 300, (16, 96)), (50, 50, (4, 7)), (4096, 4096, (3, 5))],  # many, all, few repeats
)
def test_row_sums_are_f_embedding_s(vocab, ids_high, shape):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ids_high, shape, generator=gen)
    weight = torch.randn(vocab, 16, requires_grad=True)
    grad = torch.randn(*shape, 16, generator=gen)
    grad[0, 0, :5] = -0.0
    F.embedding(ids, weight).backward(grad)
    rows, sums = _row_sums(ids.reshape(-1), grad.reshape(-1, 16))
    assert torch.equal(bits(weight.grad[rows]), bits(sums))
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[rows] = False
    assert not weight.grad[untouched].any()


def test_tied_gradient_is_autograd_s_sum():
    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(300, 16, generator=gen))
    ids = torch.randint(0, 40, (4, 9), generator=gen)
    hidden = torch.randn(12, 16, generator=gen)
    hidden[0] = 0.0  # output-layer gradient rows of -0.0 and 0.0

    def grad_of(tied: bool):
        slot = []
        emb = _TiedEmbedding.apply(ids, weight, slot) if tied else F.embedding(ids, weight)
        out = hidden @ (_OutputWeight.apply(weight, slot) if tied else weight).t()
        (out.logsumexp(-1).sum() - out[:, 0].sum() + emb.square().sum()).backward()
        grad, weight.grad = weight.grad, None
        return grad

    assert torch.equal(bits(grad_of(True)), bits(grad_of(False)))
