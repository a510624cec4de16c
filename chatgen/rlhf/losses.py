"""RLHF algorithm math on plain tensors: advantages, KL estimators, policy/value/DPO losses,
importance weights.

Pure torch: no Ray, vLLM or Megatron import, so every formula here is unit-tested in milliseconds
(`pytest tests/unit/test_rlhf_losses.py`) and reused unchanged by the algorithms
(chatgen/rlhf/algorithms/).

Shapes: B sequences, T response tokens. Token tensors are (B, T) and come with a float `mask` (B, T)
that is 1 on response tokens the loss should see and 0 on padding. Log-probs are of the sampled
token.
"""

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from chatgen.core.train_batch import loss_declares


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `x` where `mask` is 1 (over all elements, or along `dim`)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1; 0 where the mask is empty (no NaN from
    0/0)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / std over the masked positions; with shift_mean=False the mean is added back."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus the mean of its group, divided by the group's std.

    rewards: (P * group_size,) with the `group_size` samples of each prompt contiguous. Returns (P *
    group_size,). A group whose samples all got the same reward gets advantage 0 (no signal). The
    std is the unbiased sample std (as in DeepSeekMath's GRPO); normalize_std=False gives Dr. GRPO.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024): each reward minus the mean of its group's others.

    rewards: (P * group_size,) with each prompt's samples contiguous. Returns (P * group_size,):
    A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean(r)); no std division.
    """
    if group_size < 2:
        raise ValueError(
            f"group_size={group_size}: a leave-one-out baseline needs at least 2 samples per prompt"
        )
    centred = group_advantages(rewards, group_size, normalize_std=False)
    return centred * (group_size / (group_size - 1))


def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each row's unmasked tokens.
    rewards, mask: (B, T) -> (B, T), zero on masked positions."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] * mask[:, t] + gamma * running
        returns[:, t] = running * mask[:, t]
    return returns


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025): each token's discounted return, whitened over the batch.

    token_rewards: (B, T), e.g. kl_shaped_rewards (the score on the last token, minus a per-token
    KL penalty when the KL is in the reward); mask: (B, T). Returns (B, T), zero on masked
    positions: A_t = (G_t - mean(G)) / std(G), mean and std over every unmasked token of the batch
    (no critic, no group baseline).
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask) * mask


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
):
    """Generalised advantage estimation over response tokens.

    rewards, values, mask: (B, T). Token t's TD error is r_t + gamma * V_{t+1} - V_t with V past the
    last unmasked token taken as 0 (the episode ends there). Returns (advantages, returns), both (B,
    T), zero on masked positions; returns = advantages + values is the value-function target.
    """
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # On padding keep carrying the values from the right (which are zeros past the sequence
        # end).
        advantages[:, t] = adv * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence").

    k1: log r with log r = logp - logp_ref; unbiased, can be negative.
    k2: (log r)^2 / 2; biased, non-negative.
    k3: exp(-log r) - 1 + log r; unbiased, non-negative (the GRPO paper's choice).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # Clamp keeps exp() finite when the two policies disagree wildly early in training.
        return torch.exp(-log_ratio.clamp(-20, 20)) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}: use 'k1', 'k2' or 'k3'")


def truncated_importance_weights(
    old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance-sampling weights for the train/inference mismatch (Yao et al., "TIS").

    The samples come from the inference engine's distribution (inference_logprobs) while the loss
    treats them as samples of the trainer's (old_logprobs): weight = min(pi_train / pi_infer, cap),
    per token, detached. Equal log-probs give weight 1 exactly.
    """
    return torch.exp(old_logprobs - inference_logprobs).clamp(max=cap).detach()


def sequence_importance_weights(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
    geometric: bool = False,
) -> torch.Tensor:
    """Sequence-level truncated importance weights (verl's rollout_is: sequence), detached.

    old_logprobs (the trainer's), inference_logprobs (the engine's, which sampled), mask: (B, T).
    Returns (B,): min(prod_t pi_train / pi_infer, cap), or with geometric=True
    min(exp(mean_t log(pi_train / pi_infer)), cap), over each row's unmasked tokens. Equal
    log-probs give 1 exactly.
    """
    log_ratio = masked_sum(old_logprobs - inference_logprobs, mask, dim=1)
    if geometric:
        log_ratio = log_ratio / mask.sum(dim=1).clamp(min=1)
    # clamp before exp: a long sequence's product overflows float32 long before the cap matters
    return torch.exp(log_ratio.clamp(max=math.log(cap))).detach()


def outlier_mask(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    level: str = "token",
) -> torch.Tensor:
    """Rejection of train/inference outliers (verl's rollout_rs): a (B, T) float mask, 1 = kept.

    old_logprobs, inference_logprobs, mask: (B, T). level "token": token t is dropped when its
    ratio pi_train / pi_infer is outside [low, high]; "sequence": the whole row is dropped when
    its geometric-mean ratio exp(mean_t log ratio) is outside [low, high]. Masked positions stay 0.
    """
    log_ratio = old_logprobs - inference_logprobs
    if level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(mask)
    elif level != "token":
        raise ValueError(f"unknown outlier level {level!r}: use 'token' or 'sequence'")
    keep = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    return keep.to(mask.dtype) * mask


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the rewards.

    response_lengths: (S,) tokens. Returns (S,): 0 up to max_length - buffer_length tokens, then
    falling linearly to -factor at max_length, factor * (max_length - buffer_length - length) /
    buffer_length, and -factor beyond.
    """
    over = (response_lengths.float() - (max_length - buffer_length)).clamp(min=0) / buffer_length
    return -factor * over.clamp(max=1.0)


# ---- loss aggregations (verl's loss_agg_mode): (B, T) per-token loss -> scalar; registered by name
# in chatgen.rlhf.recipe.aggregation


@loss_declares("tokens")
def token_mean(per_token, mask, norm_length=None):
    """Every unmasked token of the batch weighs the same (long responses weigh more; DAPO)."""
    return masked_mean(per_token, mask)


@loss_declares("samples")
def seq_mean_token_mean(per_token, mask, norm_length=None):
    """Each row's token mean, then the mean over rows (GRPO paper; GSPO)."""
    return masked_mean(per_token, mask, dim=1).mean()


@loss_declares("samples")
def seq_mean_token_sum(per_token, mask, norm_length=None):
    """Each row's token sum, then the mean over rows."""
    return masked_sum(per_token, mask, dim=1).mean()


@loss_declares("samples")
def seq_mean_token_sum_norm(per_token, mask, norm_length=None):
    """Each row's token sum / norm_length (a constant, e.g. the generation budget), then the mean
    over rows (Dr. GRPO: no length bias)."""
    if not norm_length:
        raise ValueError(
            "loss aggregation seq_mean_token_sum_norm needs norm_length (the constant divisor)"
        )
    return (masked_sum(per_token, mask, dim=1) / norm_length).mean()


# ---- policy ratios: (B, T) log-ratios whose exp is the clipped ratio; registered by name in
# chatgen.rlhf.recipe.ratio


def token_log_ratio(logprobs, old_logprobs, mask):
    """One importance ratio per token (PPO, GRPO): log pi - log pi_old."""
    return logprobs - old_logprobs


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's per-token log-ratio (Zheng et al. 2025, GSPO-token): (B, T), whose value in row i
    is the length-normalised sequence log-ratio mean_t (logp - old) of row i, and whose gradient
    is each token's own (sg(s_i) * pi_t / sg(pi_t)): the ratio moves, and is clipped, per
    sequence."""
    seq = masked_mean(logprobs - old_logprobs, mask, dim=1).detach()
    return logprobs - logprobs.detach() + seq.unsqueeze(1)


def ppo_clip(log_ratio, logprobs, advantages, mask, o):
    """PPO's clipped surrogate per token, -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps_high) A)
    with r = exp(log_ratio); returns (per_token, clipped) with clipped where the clip changed r
    A. The default policy loss (runtime.algorithm.policy_loss: ppo_clip; others in
    chatgen.rlhf.recipe)."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    high = o.clip_eps if o.clip_eps_high is None else o.clip_eps_high
    clipped = ratio.clamp(1 - o.clip_eps, 1 + high) * advantages
    return -torch.minimum(unclipped, clipped), unclipped != clipped


@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """policy_loss's knobs, built once per run from runtime.algorithm (grpo's step.loss_options).
    log_ratio and aggregation are functions (chatgen.rlhf.recipe's registries); module-level
    ones, so that the options pickle by reference to a trainer process."""

    clip_eps: float = 0.2  # the ratio's lower clip 1 - clip_eps
    clip_eps_high: Optional[float] = None  # upper clip 1 + clip_eps_high; None = clip_eps
    dual_clip: Optional[float] = None  # c > 1: a negative advantage A loses at most -c A
    kl_coef: float = 0.0  # weight of the KL(policy, reference) penalty
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    log_ratio: Callable = token_log_ratio
    aggregation: Callable = token_mean
    norm_length: Optional[int] = None  # the constant of seq_mean_token_sum_norm
    surrogate: Callable = ppo_clip  # the per-token loss runtime.algorithm.policy_loss names
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperature where A > 0
    sapo_temperature_neg: float = 1.05  # and where A <= 0


@loss_declares(lambda options=PolicyLossOptions(), **_: options.aggregation)  # its unit
def policy_loss(logprobs: torch.Tensor, batch, options: PolicyLossOptions = PolicyLossOptions()):
    """PPO/GRPO clipped surrogate loss, optionally with a KL penalty to the reference policy.

    logprobs: (B, T) under the policy being trained (requires grad). batch (a TrainBatch):
    old_logprobs (B, T) under the policy that sampled (before this train step); advantages (B, T) or
    (B,) (broadcast over tokens); loss_mask (B, T); ref_logprobs (B, T) under the frozen reference,
    used when set; is_weights (B, T) or (B,), optional importance weights. Per token:
    options.surrogate (ppo_clip: -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps_high) A)) of the
    log-ratio (options.log_ratio: per token, or GSPO's sequence ratio) with r = its exp; dual_clip c
    > 1: for A < 0 the loss is capped at -c A (Ye et al. 2020). Times is_weights, plus kl_coef * KL,
    plus entropy_coef * logp^2 / 2, whose gradient is -entropy_coef times an unbiased sample
    estimate of the entropy's (the entropy bonus from sampled tokens). Reduced by
    options.aggregation. Returns (loss, stats) with stats: clip_fraction, approx_kl (old vs new), kl
    (vs reference), entropy (mean -logp of the sampled tokens: an estimate of the sampling
    distribution's entropy), and old_logprob_diff_max: the largest |logprobs - old_logprobs| over
    unmasked tokens (before a step's update with old log-probs from the engine, that is the
    train/inference mismatch).
    """
    old_logprobs, advantages, mask = batch.old_logprobs, batch.advantages, batch.loss_mask
    o = options
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    log_ratio = o.log_ratio(logprobs, old_logprobs, mask)
    per_token, clipped = o.surrogate(log_ratio, logprobs, advantages, mask, o)
    if o.dual_clip is not None:
        dual_clipped = (advantages < 0) & (-o.dual_clip * advantages < per_token)
        per_token = torch.where(dual_clipped, -o.dual_clip * advantages, per_token)
    weights = batch.is_weights
    if weights is not None:
        per_token = per_token * (weights.unsqueeze(1) if weights.dim() == 1 else weights)
    stats = {}
    if batch.ref_logprobs is not None:
        kl = kl_estimate(logprobs, batch.ref_logprobs, o.kl_kind)
        stats["kl"] = masked_mean(kl.detach(), mask)
        if o.kl_coef:
            per_token = per_token + o.kl_coef * kl
    if o.entropy_coef:
        # grad(-H) = E[log p * grad log p] = E[grad(log p ^ 2 / 2)] over tokens from the policy
        per_token = per_token + o.entropy_coef * 0.5 * logprobs**2
    loss = o.aggregation(per_token, mask, o.norm_length)
    with torch.no_grad():
        stats["clip_fraction"] = masked_mean(clipped.float(), mask)
        stats["approx_kl"] = masked_mean(kl_estimate(old_logprobs, logprobs.detach(), "k3"), mask)
        stats["old_logprob_diff_max"] = ((logprobs.detach() - old_logprobs).abs() * mask).max()
        stats["entropy"] = masked_mean(-logprobs.detach(), mask)
        if o.dual_clip is not None:
            stats["dual_clip_fraction"] = masked_mean(dual_clipped.float(), mask)
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
):
    """Clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2), mean over unmasked
    tokens.

    values: (B, T) requires grad; old_values, returns: (B, T). Returns (loss, stats) with
    clip_fraction.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, {"value_clip_fraction": clip_fraction}


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
) -> torch.Tensor:
    """PPO token rewards: -kl_coef * KL per token, plus the sequence score on its last unmasked
    token.

    scores: (B,); logprobs, ref_logprobs, mask: (B, T). Returns (B, T), zero on masked positions.
    """
    rewards = -kl_coef * kl_estimate(logprobs, ref_logprobs, kl_kind) * mask
    # (B, T) one-hot or empty
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & (mask > 0)
    return rewards + last.to(rewards.dtype) * scores.unsqueeze(1)


def dpo_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    beta: float = 0.1,
    weights: torch.Tensor = None,
):
    """DPO loss (Rafailov et al. 2023; TRL's "sigmoid" loss) on P preference pairs.

    chosen_logratios, rejected_logratios: (P,) log pi(y|x) - log pi_ref(y|x) of each pair's chosen
    and rejected response, summed over its response tokens (`pair_logratios`). The pair's loss is
    -log sigmoid(beta * (chosen - rejected)); the loss is its mean over the P pairs, each times its
    weight (weights: (P,), e.g. 0 for a pair that states no preference; None = all 1). Returns
    (loss, stats): accuracy (share of pairs whose chosen log-ratio is the larger; a tie counts 0.5),
    margin (beta * (chosen - rejected)), chosen_reward and rejected_reward (the implicit rewards
    beta * log-ratio), each a mean over the pairs of nonzero weight.
    """
    margins = beta * (chosen_logratios - rejected_logratios)
    weights = torch.ones_like(margins) if weights is None else weights.to(margins.dtype)
    loss = (-F.logsigmoid(margins) * weights).mean()
    with torch.no_grad():
        counted = (weights > 0).to(margins.dtype)

        def mean(x):
            return (x * counted).sum() / counted.sum().clamp(min=1)

        stats = {
            "accuracy": mean(
                (margins > 0).to(margins.dtype) + 0.5 * (margins == 0).to(margins.dtype)
            ),
            "margin": mean(margins),
            "chosen_reward": mean(beta * chosen_logratios.detach()),
            "rejected_reward": mean(beta * rejected_logratios.detach()),
        }
    return loss, stats


def pair_logratios(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor):
    """(chosen, rejected) sequence log-ratios, each (P,), of 2P rows holding P pairs: row 2k is
    pair k's chosen response, row 2k + 1 its rejected one. logprobs, ref_logprobs, mask: (2P, T);
    a row's log-ratio is the sum of logprobs - ref_logprobs over its masked (response) tokens."""
    if logprobs.shape[0] % 2:
        raise ValueError(
            f"{logprobs.shape[0]} rows do not make (chosen, rejected) pairs; pass an even number"
        )
    ratios = masked_sum(logprobs - ref_logprobs, mask, dim=1)
    return ratios[0::2], ratios[1::2]


def best_worst_pairs(rewards: torch.Tensor, group_size: int):
    """Online DPO's pairs: the best and the worst of each prompt's `group_size` responses.

    rewards: (P * group_size,) with each prompt's responses contiguous. Returns (rows, weights),
    both (2P,): rows[2k], rows[2k + 1] = the indices of prompt k's highest and lowest reward (the
    first one on a tie), and weights 1 for both rows of a pair, 0 when all of the prompt's responses
    got the same reward (no preference: the pair stays in the batch and adds nothing to the loss).
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a pair needs at least 2 responses per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    base = torch.arange(grouped.shape[0]) * group_size
    rows = torch.stack([base + grouped.argmax(dim=1), base + grouped.argmin(dim=1)], dim=1).reshape(
        -1
    )
    preferred = (grouped.max(dim=1).values > grouped.min(dim=1).values).float()
    return rows, preferred.repeat_interleave(2)


# ---- trainer loss functions: loss_fn(logprobs (b, T-1) with grad, micro-batch: a TrainBatch) ->
# (loss, {name: scalar}). Module-level so they pickle by reference to a trainer actor (bind the
# knobs with functools.partial).


@loss_declares("tokens")
def value_loss_fn(values, mb, clip_eps=0.2):
    """PPO critic loss on a micro-batch with old_values, returns, loss_mask (b, T-1)."""
    return value_loss(values, mb.old_values, mb.returns, mb.loss_mask, clip_eps=clip_eps)


@loss_declares("tokens")
def nll_loss_fn(logprobs, mb):
    """Supervised fine-tuning: mean negative log-likelihood of the tokens where loss_mask (b,
    T-1) is 1."""
    return -masked_mean(logprobs, mb.loss_mask), {}


@loss_declares("samples", rows_together=2)
def dpo_loss_fn(logprobs, mb, beta=0.1):
    """DPO on a micro-batch of (chosen, rejected) row pairs (rows 2k, 2k + 1) with loss_mask and
    ref_logprobs (b, T-1), and optional pair_weights (b,) (both rows of a pair carry the pair's
    weight)."""
    weights = mb.pair_weights
    chosen, rejected = pair_logratios(logprobs, mb.ref_logprobs, mb.loss_mask)
    return dpo_loss(chosen, rejected, beta, None if weights is None else weights[0::2])
