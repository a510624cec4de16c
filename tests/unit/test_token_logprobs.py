"""token_logprobs (chatgen/training/token_scoring.py) against megatron-core's vocab-parallel cross
entropy at TP 1, the computation it replaces in MegatronModule.token_outputs: the same log-probs and
the same gradient in the logits, bit for bit, with chunks of any size.

    pytest tests/unit/test_token_logprobs.py -q
"""

import pytest
import torch

from chatgen.training import token_scoring
from chatgen.training.token_scoring import token_logprobs


@pytest.fixture(scope="module")
def megatron_cross_entropy():
    import torch.distributed as dist

    from chatgen.training.megatron_module import init_distributed, release_parallel_state

    joined = dist.is_initialized()
    init_distributed(1, 1)  # a one-rank gloo world: its all-reduces are the identity
    from megatron.core import tensor_parallel

    yield tensor_parallel.vocab_parallel_cross_entropy
    if not joined:  # leave the session as it was
        release_parallel_state()
        dist.destroy_process_group()


def reference(cross_entropy, logits, ids):
    """What token_outputs computed before: megatron's cross entropy on logits[:, :-1]."""
    return -cross_entropy(logits[:, :-1].float().contiguous(), ids[:, 1:].contiguous())


def ours(logits, ids):
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    return token_logprobs(logits.float(), labels)[:, :-1]


@pytest.mark.parametrize("chunk", [None, 7 * 97, 97])  # whole rows at once; 7 rows; 1 row a step
def test_values_and_gradients_equal_megatrons(megatron_cross_entropy, monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(token_scoring, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    b, t, v = 3, 11, 97
    base = torch.randn(b, t, v) * 4
    base[0, 2, 5] = -1e30  # a masked vocabulary entry, as a padded vocabulary gets
    ids = torch.randint(0, v, (b, t))
    weights = torch.randn(b, t - 1)  # the loss's weight of each position; one position unread
    weights[1, 3] = 0
    results = []
    for fn in (lambda x: reference(megatron_cross_entropy, x, ids), lambda x: ours(x, ids)):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf, as the output layer's result is
        out = fn(logits)
        (out * weights).sum().backward()
        results.append((out.detach(), leaf.grad))
    (want, want_grad), (got, got_grad) = results
    assert got.shape == (b, t - 1)
    assert torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)
    assert torch.all(got_grad[:, -1] == 0)  # the last position scores nothing
    # and they are log-probs
    logp = torch.log_softmax(base[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got.double(), logp, rtol=1e-5, atol=1e-5)


def test_no_grad_forward_matches(megatron_cross_entropy):
    torch.manual_seed(1)
    logits, ids = torch.randn(2, 9, 50), torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(
            ours(logits.clone(), ids), reference(megatron_cross_entropy, logits, ids)
        )
