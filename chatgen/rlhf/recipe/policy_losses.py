"""Policy losses, `runtime.algorithm.policy_loss`: fn(log_ratio, logprobs, advantages, mask,
options) -> (per_token (B, T), clipped (B, T) bool), the per-token loss before importance weights,
KL and entropy terms and the aggregation (chatgen.rlhf.losses.policy_loss). log_ratio is the ratio
the registry `ratio` names (log pi - log pi_old per token by default); logprobs carry the gradient;
advantages are (B, T); options the PolicyLossOptions (clip_eps = the low clip, clip_eps_high).
`clipped` marks the tokens the loss bounded: policy/clip_fraction. docs/algorithms.md has each
formula and paper; TRL's name is GRPOConfig.loss_type, verl's actor.policy_loss.loss_mode.
"""

import torch

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.registry import policy_loss


def _high(o):
    return o.clip_eps if o.clip_eps_high is None else o.clip_eps_high


def _no_dual_clip(algo):
    if algo.dual_clip is not None:
        yield (
            "dual_clip",
            f"caps ppo_clip's loss for A < 0; policy_loss {algo.policy_loss} has no such cap: "
            "remove dual_clip or set policy_loss: ppo_clip",
        )


def _gmpo_rules(algo):
    yield from _no_dual_clip(algo)
    if algo.ratio_level != "token":
        yield (
            "ratio_level",
            "gmpo takes the geometric mean of the clipped token ratios itself; set "
            "ratio_level: token",
        )


policy_loss("ppo_clip")(L.ppo_clip)


@policy_loss("cispo", check=_no_dual_clip)
def cispo(log_ratio, logprobs, advantages, mask, o):
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - clip_eps, 1 + clip_eps_high)) A log pi per
    token: REINFORCE weighted by the clipped, detached importance ratio; no token loses its
    gradient."""
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - o.clip_eps, 1 + _high(o)).detach()
    return -weight * advantages * logprobs, weight != ratio.detach()


@policy_loss("sapo", check=_no_dual_clip)
def sapo(log_ratio, logprobs, advantages, mask, o):
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization): -(4 / tau) sigmoid(tau (r - 1))
    A, tau = sapo_temperature_pos where A > 0, else sapo_temperature_neg: a smooth gate instead
    of the hard clip, whose gradient weight 4 s (1 - s) is 1 at r = 1 and fades as r leaves it."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * advantages, torch.zeros_like(mask, dtype=torch.bool)


@policy_loss("gmpo", check=_gmpo_rules)
def gmpo(log_ratio, logprobs, advantages, mask, o):
    """GMPO (Zhao et al. 2025, Geometric-Mean Policy Optimization): each token's log-ratio
    clipped pessimistically in log space to [-clip_eps, clip_eps_high] (the side that would lower
    the loss for sign(A)), then the row's geometric-mean ratio R_i = exp(mean_t clipped log r);
    every token of row i carries -A R_i, so seq_mean_token_mean gives GMPO's mean_i -A_i R_i."""
    sign = torch.sign(advantages)
    bounded = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-o.clip_eps, _high(o)))
    geometric = torch.exp(L.masked_mean(bounded, mask, dim=1)).unsqueeze(1)
    return -advantages * geometric, (bounded != log_ratio) & (sign != 0)
