"""The top-k then top-p set (chatgen.core.truncation) is vLLM's, and the trainers' log-probs
renormalise over it (chatgen.training.token_scoring.TokenScoring.truncate).

    python -m pytest tests/unit/test_truncation.py

vLLM's own function is the reference: a vLLM upgrade that changes its order or its ties fails here.
"""

import math
import types

import pytest
import torch

from chatgen.core.truncation import top_k_top_p_keep
from chatgen.training.token_scoring import TokenScoring


def test_by_hand():
    # probabilities 0.4, 0.3, 0.2, 0.1 (logits their logs), in a shuffled order
    logits = torch.tensor([[0.2, 0.4, 0.1, 0.3]]).log()
    assert top_k_top_p_keep(logits, 2, 1.0).tolist() == [[False, True, False, True]]
    # top-p 0.6: from the bottom 0.1, 0.3 (<= 0.4: dropped), 0.6 (> 0.4: kept): {0.4, 0.3} stay
    assert top_k_top_p_keep(logits, 0, 0.6).tolist() == [[False, True, False, True]]
    assert top_k_top_p_keep(logits, 0, 0.75).tolist() == [[True, True, False, True]]
    # top-k first: of {0.4, 0.3, 0.2} (renormalised 4/9, 3/9, 2/9) top-p 0.6 keeps 4/9 and 3/9
    assert top_k_top_p_keep(logits, 3, 0.6).tolist() == [[False, True, False, True]]
    # the most likely token always stays; a tie at the k-th value keeps every tied token
    assert top_k_top_p_keep(logits, 0, 1e-6).tolist() == [[False, True, False, False]]
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert top_k_top_p_keep(tied, 1, 1.0).tolist() == [[False, True, True, False]]


def test_is_vllms_set_with_ties_and_per_row_settings():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(32, 200, generator=generator) * 3
        logits[:, 7] = logits[:, 8]  # ties
        k = torch.randint(1, 200, (32,), generator=generator)
        p = torch.rand(32, generator=generator) * 0.9 + 0.05
        for kk, pp in ((k, p), (k, None), (None, p)):
            vllm = apply_top_k_top_p_pytorch(logits.clone(), kk, pp) > float("-inf")
            ours = top_k_top_p_keep(logits, 0 if kk is None else kk, 1.0 if pp is None else pp)
            assert torch.equal(vllm, ours)
        assert torch.equal(
            apply_top_k_only(logits.clone(), k.clone()) > float("-inf"),
            top_k_top_p_keep(logits, k, 1.0),
        )


class Scorer(TokenScoring):
    def __init__(self, top_k, top_p):
        self.config = types.SimpleNamespace(logits_top_k=top_k, logits_top_p=top_p)


@pytest.mark.parametrize(
    "top_k, top_p, on", [(None, None, False), (-1, 1.0, False), (0, 0.9, True), (20, None, True)]
)
def test_truncates_only_when_on(top_k, top_p, on):
    assert Scorer(top_k, top_p).truncates is on


def test_renormalised_log_probs_are_vllms_processed_ones_and_the_label_stays():
    """log_softmax of the truncated logits is vLLM's processed log-prob (log-softmax of the
    logits with the dropped tokens at -inf) for a kept token; a dropped label keeps a finite value."""
    logits = torch.tensor([[[0.2, 0.4, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]]]).log()  # (1, 2, 4)
    labels = torch.tensor([[1, 2]])
    out = Scorer(2, 0.9).truncate(logits, labels)
    # position 0: {0.4, 0.3} kept: 0.4 / 0.7
    assert out[0, 0].log_softmax(-1)[1].item() == pytest.approx(math.log(0.4 / 0.7), abs=1e-6)
    assert out[0, 0].log_softmax(-1)[2].exp().item() == 0.0
    # position 1: a four-way tie, top-k 2 keeps all four (ties), top-p 0.9 drops the first one in
    # sorted order; the label 2 is kept whatever the sort did, and its log-prob is finite
    lp = out[0, 1].log_softmax(-1)
    assert torch.isfinite(lp[2]) and (lp.exp() > 0).sum().item() >= 3
