"""The RL recipes' math (issue 35) against hand-computed values: RLOO, REINFORCE++, clip-higher,
dual clip, GSPO's sequence ratio, loss aggregations, entropy, sequence IS, outlier masking, DAPO's
overlong penalty; and today's defaults giving today's loss bit for bit.
pytest tests/unit/test_rlhf_recipes_losses.py"""

import math

import pytest
import torch
from helpers import policy_loss

from chatgen.rlhf import losses as A
from chatgen.rlhf import recipe


def _policy_loss_before_issue_35(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_eps=0.2,
    ref_logprobs=None,
    kl_coef=0.0,
    kl_kind="k3",
    is_weights=None,
):
    """policy_loss as it was at 8d6e1ce (the loss only), frozen here: the defaults must still give
    it bit for bit."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    if ref_logprobs is not None and kl_coef:
        per_token = per_token + kl_coef * A.kl_estimate(logprobs, ref_logprobs, kl_kind)
    return A.masked_mean(per_token, mask)


def test_defaults_give_todays_loss_and_gradient_bit_for_bit():
    torch.manual_seed(0)
    old = -torch.rand(4, 7) * 3
    ref = old + 0.1 * torch.randn(4, 7)
    mask = (torch.rand(4, 7) > 0.3).float()
    adv = torch.randn(4)
    w = A.truncated_importance_weights(old, old + 0.05 * torch.randn(4, 7))
    for kwargs in ({}, {"ref_logprobs": ref, "kl_coef": 0.1}, {"is_weights": w, "clip_eps": 0.1}):
        new_lp = (old + 0.3 * torch.randn(4, 7)).requires_grad_()
        before_lp = new_lp.detach().clone().requires_grad_()
        loss, _ = policy_loss(new_lp, old, adv, mask, **kwargs)
        before = _policy_loss_before_issue_35(before_lp, old, adv, mask, **kwargs)
        loss.backward(), before.backward()
        assert loss.item() == before.item()  # bit for bit
        assert torch.equal(new_lp.grad, before_lp.grad)


def test_rloo_leave_one_out_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])  # groups [1,0,0], [0,2,4]
    adv = A.rloo_advantages(rewards, group_size=3)
    # A_i = r_i - mean of the other two
    expected = [1 - 0, 0 - 0.5, 0 - 0.5, 0 - 3, 2 - 2, 4 - 1]
    assert adv.tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="at least 2"):
        A.rloo_advantages(rewards, group_size=1)


def test_reinforce_pp_returns_whitened_over_batch():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.0, 0.3]])  # log pi - log pi_ref, k1
    rewards = A.kl_shaped_rewards(scores, kl, torch.zeros_like(kl), mask, kl_coef=0.1, kl_kind="k1")
    # token rewards: row 0 [-0.05, 1 - 0.02], row 1 [-0.01, 0, 0 - 0.03]; G_t = sum from t on
    returns = [[-0.05 + 0.98, 0.98], [-0.04, -0.03, -0.03]]
    flat = torch.tensor(returns[0] + returns[1])
    mean, std = flat.mean(), flat.std(unbiased=False)
    adv = A.reinforce_pp_advantages(rewards, mask)
    expected = [
        [(g - mean) / std for g in returns[0]] + [0.0],
        [(g - mean) / std for g in returns[1]],
    ]
    assert adv.tolist()[0] == pytest.approx([float(x) for x in expected[0]], abs=1e-5)
    assert adv.tolist()[1] == pytest.approx([float(x) for x in expected[1]], abs=1e-5)
    # gamma discounts: G_0 = r_0 + gamma * r_1
    g = A.discounted_returns(torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), gamma=0.5)
    assert g.tolist() == [[1 + 0.5 * 2, 2.0]]


def test_clip_higher_asymmetric_bounds():
    old = torch.zeros(1, 2)
    # ratios 1.25 and 0.75: with (low 0.2, high 0.28) 1.25 is inside, 0.75 is clipped up to 0.8
    logp = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
    loss, stats = policy_loss(
        logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), clip_eps=0.2, clip_eps_high=0.28
    )
    # token 0: -min(1.25, 1.25) = -1.25; token 1 (A = -1): -min(-0.75, -0.8) = 0.8
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.25 / 2)  # unclipped: d(-r A)/dlogp = -r A / 2
    assert logp.grad[0, 1].item() == 0.0  # clipped at the low bound


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[5.0, 5.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps=0.2, dual_clip=3.0)
    # token 0: -min(-5, -1.2) = 5, capped at -c A = 3; token 1: -min(5, 1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert stats["dual_clip_fraction"].item() == pytest.approx(0.5)
    plain, _ = policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps=0.2)
    assert plain.item() == pytest.approx((5.0 - 1.2) / 2)


def test_gspo_sequence_ratio_value_and_gradient():
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[0.1, 0.3, 7.0], [0.0, 0.0, 0.03]]).requires_grad_()
    log_r = A.sequence_log_ratio(logp, old, mask)
    # value: each row's mean log-ratio over its tokens, on every position of the row
    assert log_r[0, :2].tolist() == pytest.approx([0.2, 0.2])
    assert log_r[1].tolist() == pytest.approx([0.01, 0.01, 0.01])
    adv = torch.tensor([1.0, 1.0])
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_eps=0.5,
        ratio_level="sequence",
        loss_aggregation="seq_mean_token_mean",
    )
    s0, s1 = math.exp(0.2), math.exp(0.01)
    assert loss.item() == pytest.approx(-(s0 + s1) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp_t of -(1/2) mean_i s_i: -(1/2) s_i / |y_i| per token (GSPO-token = GSPO's gradient)
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0], rel=1e-6)
    assert logp.grad[1].tolist() == pytest.approx([-s1 / 6] * 3, rel=1e-6)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", (1 + 2 + 3 + 4 + 5) / 5),
        ("seq_mean_token_mean", ((1 + 2) / 2 + (3 + 4 + 5) / 3) / 2),
        ("seq_mean_token_sum", ((1 + 2) + (3 + 4 + 5)) / 2),
        ("seq_mean_token_sum_norm", ((1 + 2) / 4 + (3 + 4 + 5) / 4) / 2),
    ],
)
def test_loss_aggregation_by_hand(mode, expected):
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert recipe.aggregation.get(mode)(x, mask, 4).item() == pytest.approx(expected)


def test_loss_aggregation_errors():
    with pytest.raises(ValueError, match="norm_length"):
        recipe.aggregation.get("seq_mean_token_sum_norm")(torch.ones(1, 2), torch.ones(1, 2), None)
    with pytest.raises(ValueError, match="token_mean"):
        recipe.aggregation.get("sum")


def test_entropy_metric_and_bonus_gradient():
    logp = torch.tensor([[-0.5, -2.0, -9.0]]).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    base, stats = policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask)
    # mean -log p of sampled tokens
    assert stats["entropy"].item() == pytest.approx((0.5 + 2.0) / 2)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask, entropy_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * 0.5 * (0.25 + 4.0) / 2)
    loss.backward()
    # d/dlogp of 0.1 * logp^2 / 2, over the 2 tokens of the mean
    assert logp.grad[0].tolist() == pytest.approx([0.1 * -0.5 / 2, 0.1 * -2.0 / 2, 0.0])


def test_entropy_bonus_raises_entropy_in_expectation():
    """Exact check of the estimator: every token weighted by its probability, the gradient is
    -grad H of a softmax (so descending the loss raises the entropy)."""
    logits = torch.tensor([2.0, 0.5, -1.0]).requires_grad_()
    logp = logits.log_softmax(-1)
    # E_{y ~ p}[logp(y)^2 / 2], p held fixed
    surrogate = (logp.detach().exp() * 0.5 * logp**2).sum()
    (grad_surrogate,) = torch.autograd.grad(surrogate, logits)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum()
    (grad_entropy,) = torch.autograd.grad(entropy, logits)
    assert grad_surrogate.tolist() == pytest.approx((-grad_entropy).tolist(), abs=1e-6)


def test_sequence_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0]])
    infer = torch.tensor([[-1.2, -1.1, 5.0], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    product = A.sequence_importance_weights(old, infer, mask, cap=2.0)
    assert product.tolist() == pytest.approx([math.exp(0.2 + 0.1), 1.0])
    geometric = A.sequence_importance_weights(old, infer, mask, cap=2.0, geometric=True)
    assert geometric.tolist() == pytest.approx([math.exp(0.15), 1.0])
    capped = A.sequence_importance_weights(
        old + torch.tensor([[3.0, 0, 0], [0, 0, 0]]), infer, mask, cap=2.0
    )
    assert capped[0].item() == pytest.approx(2.0)
    # a (B,) weight scales each row of the loss
    logp = old.clone()
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, is_weights=product)
    assert loss.item() == pytest.approx(-(2 * product[0].item() + 3 * 1.0) / 5)


def test_outlier_mask_token_and_sequence():
    old = torch.zeros(2, 3)
    # ratios 1, 4, 1 and 1.25, 1.25, 1
    infer = torch.log(torch.tensor([[1.0, 0.25, 1.0], [0.8, 0.8, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = A.outlier_mask(old, infer, mask, low=0.5, high=2.0, level="token")
    assert token.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    # sequence: geometric-mean ratios 4^(1/3) = 1.59 (row 0) and 1.25 (row 1): above 1.2 both go,
    # above 1.3 only row 0
    seq = A.outlier_mask(old, infer, mask, low=0.5, high=1.2, level="sequence")
    assert seq.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    seq = A.outlier_mask(old, infer, mask, low=0.5, high=1.3, level="sequence")
    assert seq.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="token"):
        A.outlier_mask(old, infer, mask, 0.5, 2.0, level="geometric")


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # max 16, buffer 4: free up to 12, then (12 - len) / 4, -1 at and past 16
    assert A.overlong_penalty(lengths, 16, 4).tolist() == pytest.approx(
        [0.0, 0.0, -0.5, -1.0, -1.0]
    )
    assert A.overlong_penalty(lengths, 16, 4, factor=0.5).tolist() == pytest.approx(
        [0, 0, -0.25, -0.5, -0.5]
    )
