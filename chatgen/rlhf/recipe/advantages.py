"""Advantage estimators, `runtime.algorithm.advantage_estimator` (docs/algorithms.md).

fn(rewards (S,), n, batch, algo) -> (S,) per sample or (S, L-1) per token: rewards are the shaped
scores of S = prompts x n samples (prompt-major); batch a TrainBatch with loss_mask (the response
tokens), old_logprobs and (with a reference) ref_logprobs; algo the runtime.algorithm section.
"""

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.registry import advantage


def _no_std_option(algo):
    if not algo.normalize_advantage_std:
        yield (
            "normalize_advantage_std",
            f"is a grpo option; {algo.advantage_estimator} never divides by the group std: "
            "remove the key",
        )


def no_kl_in_reward(algo):
    if algo.kl_in_reward:
        yield (
            "kl_in_reward",
            f"only reinforce_pp has token rewards to put the KL in (advantage_estimator is "
            f"{algo.advantage_estimator}); set kl_in_reward: false or advantage_estimator: "
            "reinforce_pp",
        )


def _grpo_rules(algo):
    yield from no_kl_in_reward(algo)


def _rloo_rules(algo):
    yield from _no_std_option(algo)
    yield from no_kl_in_reward(algo)


@advantage("grpo", check=_grpo_rules)
def grpo(rewards, n, batch, algo):
    """Reward minus its group's mean, over the group's std (normalize_advantage_std; off: Dr.
    GRPO)."""
    return L.group_advantages(rewards, n, normalize_std=algo.normalize_advantage_std)


@advantage("rloo", check=_rloo_rules)
def rloo(rewards, n, batch, algo):
    """Reward minus the mean of its group's other samples (Ahmadian et al. 2024)."""
    return L.rloo_advantages(rewards, n)


@advantage("reinforce_pp", check=_no_std_option)
def reinforce_pp(rewards, n, batch, algo):
    """REINFORCE++: each token's return (with kl_coef * KL in the token rewards when
    kl_in_reward), whitened over the batch (Hu 2025)."""
    kl_coef = algo.kl_coef if algo.kl_in_reward else 0.0
    old = batch.old_logprobs
    ref = old if batch.ref_logprobs is None else batch.ref_logprobs
    mask = batch.loss_mask
    token_rewards = L.kl_shaped_rewards(rewards, old, ref, mask, kl_coef, algo.kl_estimator)
    return L.reinforce_pp_advantages(token_rewards, mask)
