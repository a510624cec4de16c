"""GDPO (Liu et al. 2026, "Group reward-Decoupled Normalization Policy Optimization"), the advantage
estimator `runtime.algorithm.advantage_estimator: gdpo` for a reward that is a weighted sum of terms
(chatgen.rlhf.rewards:Rewards with `terms:`): each term is normalised within its group before the
weighted sum, so a term with a small spread is not drowned by one with a large spread (GRPO of the
sum collapses them), then the sum is whitened over the batch:

    A_k = (r_k - mean_group r_k) / (std_group r_k + eps)       per term k (the std: normalize_advantage_std)
    A = sum_k w_k A_k;   A <- (A - mean_batch A) / (std_batch A + eps)

The terms come with the batch (Run.score keeps them: RolloutBatch.reward_terms, reward_weights) and
reach the estimator as the batch's extras `reward_terms` and `reward_weights`. A reward shaping
(DAPO's overlong penalty, the length penalties: shaped minus scored reward, the extra
`reward_shaping`) is centred in its group and added to the sum before the whitening, not divided by
its std: dividing would give a penalty of coefficient 0.01 the weight of a whole reward term, while
centred its coefficients keep setting its size. Each term's normalised advantage is logged as
advantage/<term> (its mean absolute value; term_metrics), the centred shaping as advantage/shaping.
"""

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.advantages import no_kl_in_reward
from chatgen.rlhf.recipe.registry import advantage

EPS = 1e-6


def term_advantages(terms: dict, n: int, normalize_std: bool = True) -> dict:
    """{term: (S,) its group-normalised advantage} of {term: (S,) values}, S = groups x n."""
    return {
        name: L.group_advantages(values.float(), n, normalize_std=normalize_std, eps=EPS)
        for name, values in terms.items()
    }


def gdpo_advantages(terms: dict, weights: dict, n: int, normalize_std: bool = True, shaping=None):
    """(S,) GDPO advantages: the weighted sum of the terms' group-normalised advantages, plus the
    group-centred shaping (S,) when given, whitened over the batch (unbiased std)."""
    per_term = term_advantages(terms, n, normalize_std)
    total = sum(weights[name] * adv for name, adv in per_term.items())
    if shaping is not None:
        total = total + L.group_advantages(shaping.float(), n, normalize_std=False)
    if total.numel() < 2:
        return total - total.mean()
    return (total - total.mean()) / (total.std() + EPS)


def term_metrics(terms: dict, n: int, normalize_std: bool = True, shaping=None) -> dict:
    """advantage/<term>: the mean |A_k| of each term (0: no group saw that term vary); with a
    shaping, advantage/shaping: the mean |group-centred shaping|."""
    metrics = {
        f"advantage/{name}": adv.abs().mean().item()
        for name, adv in term_advantages(terms, n, normalize_std).items()
    }
    if shaping is not None:
        centred = L.group_advantages(shaping.float(), n, normalize_std=False)
        metrics["advantage/shaping"] = centred.abs().mean().item()
    return metrics


@advantage("gdpo", check=no_kl_in_reward)
def gdpo(rewards, n, batch, algo):
    """GDPO (module docstring): per-term group normalisation, weighted sum, batch whitening."""
    terms, weights = batch.extras.get("reward_terms"), batch.extras.get("reward_weights")
    if not terms:
        raise ValueError(
            "runtime.algorithm.advantage_estimator: gdpo normalises each reward term, and "
            "models.reward gave none: use model_class: chatgen.rlhf.rewards:Rewards with "
            "config.terms (docs/rewards.md), or advantage_estimator: grpo"
        )
    shaping = batch.extras.get("reward_shaping")
    adv = gdpo_advantages(terms, weights, n, algo.normalize_advantage_std, shaping)
    return adv.to(rewards.dtype)


def with_terms(batch, rewards, shaped) -> dict:
    """The extras the estimator reads: the batch's reward terms and weights, and `reward_shaping`
    (the shaped minus the scored reward) when a shaping is on; {} without terms."""
    if not batch.reward_terms:
        return {}
    extras = {
        "reward_terms": dict(batch.reward_terms),
        "reward_weights": dict(batch.reward_weights),
    }
    if shaped is not rewards:
        extras["reward_shaping"] = shaped - rewards
    return extras
