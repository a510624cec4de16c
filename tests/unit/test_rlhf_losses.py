"""Unit tests for chatgen.rlhf.losses: hand-checkable cases and properties (pytest tests/unit/test_rlhf_losses.py)."""

import math
import subprocess
import sys

import pytest
import torch
from helpers import policy_loss

from chatgen.core.metrics import reduce_metrics
from chatgen.core.train_batch import TrainBatch
from chatgen.rlhf import losses as A


def test_imports_no_heavy_dependencies():
    code = (
        "import sys, chatgen.rlhf.losses; "
        "bad = [m for m in ('ray', 'vllm', 'megatron') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_masked_mean_ignores_masked_and_handles_empty():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert A.masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3) / 3)
    assert A.masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])
    assert A.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_zero_mean_unit_var():
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 3 + 5
    mask = (torch.rand(4, 6) > 0.3).float()
    w = A.masked_whiten(x, mask)
    assert A.masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert A.masked_mean(w**2, mask).item() == pytest.approx(1.0, abs=1e-4)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])  # groups [1,0,0], [0,2,2]
    adv = A.group_advantages(rewards, group_size=3, normalize_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -4 / 3, 2 / 3, 2 / 3])
    adv_std = A.group_advantages(rewards, group_size=3, eps=0.0)
    std0 = torch.tensor([1.0, 0.0, 0.0]).std().item()
    assert adv_std[0].item() == pytest.approx((2 / 3) / std0)


def test_group_advantages_properties():
    torch.manual_seed(1)
    rewards = torch.rand(8 * 4)
    adv = A.group_advantages(rewards, group_size=4).view(8, 4)
    assert adv.sum(dim=1).abs().max().item() < 1e-5  # zero mean per group
    assert adv.std(dim=1).tolist() == pytest.approx([1.0] * 8, abs=1e-4)  # unit std per group
    # Order within a group is preserved (advantage is monotone in reward).
    r = rewards.view(8, 4)
    assert torch.equal(r.argsort(dim=1), adv.argsort(dim=1))
    # Equal rewards -> no signal.
    assert A.group_advantages(torch.ones(6), group_size=3).abs().max().item() == 0.0


def test_group_advantages_rejects_bad_shape():
    with pytest.raises(ValueError, match="group_size=4"):
        A.group_advantages(torch.ones(6), group_size=4)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    torch.manual_seed(2)
    rewards = torch.randn(3, 5)
    values = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float)
    adv, ret = A.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # lambda=1, gamma=1: advantage = (sum of future rewards) - V_t; returns = reward-to-go.
    reward_to_go = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(ret, reward_to_go, atol=1e-5)
    assert torch.allclose(adv, (reward_to_go - values) * mask, atol=1e-5)


def test_gae_lambda_zero_is_one_step_td():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    mask = torch.ones(1, 3)
    adv, _ = A.gae(rewards, values, mask, gamma=0.9, lam=0.0)
    expected = [0 + 0.9 * 0.25 - 0.5, 0 + 0.9 * 0.75 - 0.25, 1.0 - 0.75]
    assert adv[0].tolist() == pytest.approx(expected)


def test_gae_padding_does_not_leak():
    rewards = torch.tensor([[1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 0.5, 99.0]])
    adv_pad, _ = A.gae(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), gamma=0.9, lam=0.8)
    adv_short, _ = A.gae(rewards[:, :2], values[:, :2], torch.ones(1, 2), gamma=0.9, lam=0.8)
    assert torch.allclose(adv_pad[:, :2], adv_short)
    assert adv_pad[0, 2].item() == 0.0


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.2, 0.9]))
    ref = torch.log(torch.tensor([0.5, 0.4, 0.3]))
    k1, k2, k3 = (A.kl_estimate(logp, ref, k) for k in ("k1", "k2", "k3"))
    assert k1[0].item() == k2[0].item() == k3[0].item() == 0.0  # same policy -> 0
    assert k3.min().item() >= 0 and k2.min().item() >= 0
    lr = math.log(0.2 / 0.4)
    assert k3[1].item() == pytest.approx(math.exp(-lr) - 1 + lr)
    assert k1[1].item() == pytest.approx(lr)
    with pytest.raises(ValueError, match="k1"):
        A.kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # Sample from p, compare the mean estimate to the exact KL(p || q) of two categoricals.
    torch.manual_seed(3)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum().item()
    samples = torch.multinomial(p, 200_000, replacement=True)
    for kind in ("k1", "k3"):
        est = A.kl_estimate(p.log()[samples], q.log()[samples], kind).mean().item()
        assert est == pytest.approx(exact, abs=0.01), kind


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    torch.manual_seed(4)
    logp = torch.randn(2, 4)
    adv = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float)
    loss, stats = policy_loss(logp, logp, adv, mask)
    # ratio == 1: loss = -(mean over tokens of advantage) = -(3 * 1.5 + 2 * -0.5) / 5
    assert loss.item() == pytest.approx(-(3 * 1.5 - 2 * 0.5) / 5)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_old_logprob_diff_max_ignores_masked_tokens():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.3, 9.0], [0.05, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float)  # the 9.0 is padding
    _, stats = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask)
    assert stats["old_logprob_diff_max"].item() == pytest.approx(0.3)


def test_reduce_metrics_takes_the_largest_max_and_the_mean_of_the_rest():
    parts = [
        {"loss": 1.0, "old_logprob_diff_max": 0.5},
        {"loss": 3.0, "old_logprob_diff_max": 0.25},
    ]
    assert reduce_metrics(parts) == {"loss": 2.0, "old_logprob_diff_max": 0.5}


def test_policy_loss_gradient_pushes_toward_positive_advantage():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 2))
    loss.backward()
    # descending raises token 0, lowers 1
    assert logp.grad[0, 0].item() < 0 < logp.grad[0, 1].item()


def test_policy_loss_clipping_stops_gradient():
    old = torch.zeros(1, 2)
    # Ratio 1.5 with positive advantage: beyond 1 + eps, the clipped branch wins, no gradient.
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss, stats = policy_loss(
        logp, old, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), clip_eps=0.2
    )
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clip_fraction"].item() == 1.0


def test_policy_loss_kl_term_and_is_weights():
    torch.manual_seed(5)
    logp = torch.randn(2, 3)
    ref = torch.randn(2, 3)
    adv = torch.zeros(2)
    mask = torch.ones(2, 3)
    loss, stats = policy_loss(logp, logp, adv, mask, ref_logprobs=ref, kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * A.kl_estimate(logp, ref).mean().item(), rel=1e-5)
    assert stats["kl"].item() == pytest.approx(A.kl_estimate(logp, ref).mean().item(), rel=1e-5)
    # Weights scale the surrogate term token by token.
    adv = torch.ones(2)
    w = torch.full((2, 3), 0.5)
    base, _ = policy_loss(logp, logp, adv, mask)
    weighted, _ = policy_loss(logp, logp, adv, mask, is_weights=w)
    assert weighted.item() == pytest.approx(0.5 * base.item())


def test_truncated_importance_weights():
    old = torch.log(torch.tensor([0.5, 0.9, 0.1]))
    infer = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    w = A.truncated_importance_weights(old, infer, cap=2.0)
    assert w[0].item() == 1.0  # no mismatch -> exactly 1
    assert w[1].item() == 2.0  # ratio 3 capped at 2
    assert w[2].item() == pytest.approx(0.5)
    assert not w.requires_grad


def test_value_loss_clipping():
    old = torch.zeros(1, 2)
    returns = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.1, 0.5]], requires_grad=True)
    loss, stats = A.value_loss(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    # token 0 inside the clip range: 0.5*(0.9^2); token 1 clipped to 0.2: max(0.25, 0.64) = 0.64
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.64) / 2)
    assert stats["value_clip_fraction"].item() == 0.5
    loss.backward()
    assert values.grad[0, 1].item() == 0.0 and values.grad[0, 0].item() < 0


def test_kl_shaped_rewards_puts_score_on_last_token():
    logp = torch.zeros(2, 4)
    ref = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float)
    r = A.kl_shaped_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, kl_coef=0.1)
    assert r.tolist() == [[0, 0, 2.0, 0], [-1.0, 0, 0, 0]]
    # KL part: -coef * (logp - ref) on unmasked tokens only.
    r2 = A.kl_shaped_rewards(torch.zeros(2), logp + 1.0, ref, mask, kl_coef=0.1)
    assert torch.allclose(r2, -0.1 * mask)


# ---- DPO


def test_dpo_loss_hand_checked():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    # margins 0.5 * (1 - 0), 0.5 * (0 - 2) = 0.5, -1.0
    loss, stats = A.dpo_loss(chosen, rejected, beta=0.5)
    assert loss.item() == pytest.approx(
        (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1.0))) / 2
    )
    assert stats["accuracy"].item() == 0.5 and stats["margin"].item() == pytest.approx(-0.25)
    assert (
        stats["chosen_reward"].item() == pytest.approx(0.25)
        and stats["rejected_reward"].item() == 0.5
    )
    # equal log-ratios (the policy is the reference): loss log 2, and the tie counts half
    loss, stats = A.dpo_loss(torch.zeros(3), torch.zeros(3), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2)) and stats["accuracy"].item() == 0.5


def test_dpo_loss_weights_drop_pairs_but_keep_the_mean_over_all():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    loss, stats = A.dpo_loss(chosen, rejected, beta=0.5, weights=torch.tensor([1.0, 0.0]))
    # mean over both pairs, one weighted 0
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.5)) / 2)
    # over the counted pair
    assert stats["accuracy"].item() == 1.0 and stats["margin"].item() == pytest.approx(0.5)
    _, stats = A.dpo_loss(chosen, rejected, beta=0.5, weights=torch.zeros(2))
    # no counted pair: 0, not NaN
    assert stats["accuracy"].item() == 0.0 and stats["margin"].item() == 0.0


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    A.dpo_loss(chosen, rejected, beta=0.1)[0].backward()
    # d/dc -log sigmoid(beta (c - r)) = -beta sigmoid(-beta (c - r)) = -0.1 * 0.5 at c = r
    assert chosen.grad.item() == pytest.approx(-0.05) and rejected.grad.item() == pytest.approx(
        0.05
    )


def test_pair_logratios_sum_response_tokens_of_row_pairs():
    logprobs = torch.tensor(
        [[-9.0, -1.0, -2.0], [-9.0, -3.0, 0.0], [-9.0, -0.5, -0.5], [-9.0, -4.0, -9.0]]
    )
    ref = torch.full((4, 3), -1.0)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    chosen, rejected = A.pair_logratios(logprobs, ref, mask)
    # rows 0, 2 and rows 1, 3
    assert chosen.tolist() == [-1.0, 1.0] and rejected.tolist() == [
        -2.0,
        -3.0,
    ]
    with pytest.raises(ValueError, match="3 rows do not make"):
        A.pair_logratios(logprobs[:3], ref[:3], mask[:3])


def test_dpo_loss_fn_pairs_rows_and_reads_pair_weights():
    logprobs = torch.tensor(
        [[-1.0, -2.0], [-3.0, -1.0], [-1.0, -1.0], [-2.0, -2.0]], requires_grad=True
    )
    mb = TrainBatch(
        input_ids=torch.zeros(4, 3, dtype=torch.long),
        ref_logprobs=torch.full((4, 2), -1.5),
        loss_mask=torch.ones(4, 2),
        pair_weights=torch.tensor([1.0, 1.0, 0.0, 0.0]),
    )
    loss, stats = A.dpo_loss_fn(logprobs, mb, beta=1.0)
    # pair 0: chosen ratio -3 + 3 = 0, rejected -4 + 3 = -1: margin 1; pair 1 weighted 0
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)) / 2)
    assert stats["accuracy"].item() == 1.0 and stats["margin"].item() == pytest.approx(1.0)
    loss.backward()
    # the tied pair adds nothing
    assert logprobs.grad[2:].abs().sum() == 0 and logprobs.grad[0].lt(0).all()


def test_best_worst_pairs_with_ties():
    rewards = torch.tensor([0.2, 0.9, 0.5, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0])
    rows, weights = A.best_worst_pairs(rewards, 3)
    # prompt 0: best 1, worst 0; prompt 1: all tie (row 3 twice, weight 0); prompt 2: first best 6, worst 7
    assert rows.tolist() == [1, 0, 3, 3, 6, 7]
    assert weights.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="group_size=1: a pair needs at least 2 responses"):
        A.best_worst_pairs(rewards, 1)
    with pytest.raises(ValueError, match="multiple of group_size=2"):
        A.best_worst_pairs(rewards, 2)
