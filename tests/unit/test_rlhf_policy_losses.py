"""The policy losses of runtime.algorithm.policy_loss (chatgen.rlhf.recipe.policy_losses) against
hand-computed values and gradients: CISPO, SAPO, GMPO; ppo_clip is today's loss (the bit-for-bit
test is tests/unit/test_rlhf_recipes_losses.py).

    pytest tests/unit/test_rlhf_policy_losses.py
"""

import math

import pytest
import torch
from helpers import policy_loss

from chatgen.rlhf import losses as L
from chatgen.rlhf import recipe


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_the_losses_are_registered_and_ppo_clip_is_the_default():
    assert recipe.policy_loss.names() == ["cispo", "gmpo", "ppo_clip", "sapo"]
    assert L.PolicyLossOptions().surrogate is recipe.policy_loss.get("ppo_clip") is L.ppo_clip


def test_cispo_clipped_detached_weight_on_the_reinforce_term():
    old = torch.zeros(1, 3)
    # ratios 1.5 (clipped to 1.28), 0.5 (clipped to 0.8), 1.1 (inside)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, stats = policy_loss(
        logp, old, adv, torch.ones(1, 3), clip_eps=0.2, clip_eps_high=0.28, policy_loss="cispo"
    )
    w = [1.28, 0.8, 1.1]
    lp = [math.log(1.5), math.log(0.5), math.log(1.1)]
    a = [1.0, -1.0, 2.0]
    assert loss.item() == pytest.approx(sum(-w[i] * a[i] * lp[i] for i in range(3)) / 3, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    loss.backward()
    # -sg(w) A / 3: a clipped token keeps its gradient (PPO's would be 0 for tokens 0 and 1)
    assert logp.grad[0].tolist() == pytest.approx([-w[i] * a[i] / 3 for i in range(3)], rel=1e-6)
    ppo = logp.detach().clone().requires_grad_()
    policy_loss(ppo, old, adv, torch.ones(1, 3), clip_eps=0.2, clip_eps_high=0.28)[0].backward()
    assert ppo.grad[0, :2].tolist() == [0.0, 0.0]


def test_sapo_soft_gate_value_and_gradient():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 3), policy_loss="sapo")
    r, a, tau = [1.5, 0.5, 1.0], [1.0, -2.0, 3.0], [1.0, 1.05, 1.0]  # tau_neg where A <= 0
    s = [sigmoid(tau[i] * (r[i] - 1)) for i in range(3)]
    expected = sum(-(4 / tau[i]) * s[i] * a[i] for i in range(3)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_fraction"].item() == 0.0
    loss.backward()
    # d/dlogp = d/dr * r = -4 s (1 - s) A r / 3; at r = 1 it is -A / 3 (PPO's unclipped gradient)
    grad = [-4 * s[i] * (1 - s[i]) * a[i] * r[i] / 3 for i in range(3)]
    assert logp.grad[0].tolist() == pytest.approx(grad, rel=1e-5)
    assert logp.grad[0, 2].item() == pytest.approx(-3.0 / 3, rel=1e-6)
    loss, _ = policy_loss(
        logp, old, adv, torch.ones(1, 3), policy_loss="sapo", sapo_temperature_neg=2.0
    )
    assert loss.item() != pytest.approx(expected)  # the key reaches the gate


def test_gmpo_geometric_mean_clipped_in_log_space():
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0 (A = 1): log-ratios 0.1, 0.6 -> 0.1, 0.4 (clipped above); row 1 (A = -1): -0.5, 0.2,
    # -0.1 -> -0.4 (clipped below), 0.2, -0.1
    logp = torch.tensor([[0.1, 0.6, 5.0], [-0.5, 0.2, -0.1]]).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_eps=0.4,
        policy_loss="gmpo",
        loss_aggregation="seq_mean_token_mean",
    )
    r0, r1 = math.exp((0.1 + 0.4) / 2), math.exp((-0.4 + 0.2 - 0.1) / 3)
    assert loss.item() == pytest.approx((-r0 + r1) / 2, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    loss.backward()
    # d/dx_t of -(1/2) A_i exp(mean_t x): -(1/2) A_i R_i / |y_i| on unclipped tokens, 0 on clipped
    assert logp.grad[0].tolist() == pytest.approx([-r0 / 4, 0.0, 0.0], rel=1e-6)
    assert logp.grad[1].tolist() == pytest.approx([0.0, r1 / 6, r1 / 6], rel=1e-6)


def test_at_the_old_policy_every_loss_has_ppos_gradient():
    """On policy (r = 1) CISPO, SAPO, GMPO and ppo_clip all give the REINFORCE gradient -A / |batch
    tokens| per token (seq_mean_token_mean, rows of equal length)."""
    torch.manual_seed(0)
    old = -torch.rand(2, 4)
    adv = torch.tensor([1.5, -0.5])
    grads = {}
    for name in recipe.policy_loss.names():
        logp = old.clone().requires_grad_()
        loss, _ = policy_loss(
            logp,
            old,
            adv,
            torch.ones(2, 4),
            policy_loss=name,
            loss_aggregation="seq_mean_token_mean",
        )
        loss.backward()
        grads[name] = logp.grad
    expected = (-adv / 8).unsqueeze(1).expand(2, 4)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected, atol=1e-6), name
