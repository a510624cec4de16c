"""The recipe knobs of the RL algorithms, each a registry of small functions found by the YAML value
that names it (chatgen.rlhf.recipe.registry):

    advantage     runtime.algorithm.advantage_estimator   grpo, rloo, reinforce_pp     (advantages.py)
                                                          gdpo (gdpo.py), opd (distill.py),
                                                          gigpo (gigpo.py: per turn)
    ratio         runtime.algorithm.ratio_level           token, sequence (GSPO)       (ratios.py)
    aggregation   runtime.algorithm.loss_aggregation      token_mean, seq_mean_...     (aggregations.py)
    correction    runtime.algorithm.importance_sampling_level   token, sequence, geometric
                                                                                       (corrections.py)
    policy_loss   runtime.algorithm.policy_loss     ppo_clip, cispo, sapo, gmpo        (policy_losses.py)

shaping.py holds the length shapers grpo's step.shaped_rewards applies (no registry: keys turn them
on).

Every module of this package is imported here, so a new built-in is a new file that registers
itself; a user's own function is named by its path in the YAML (docs/extending.md).
"""

import importlib
import pkgutil

from chatgen.rlhf.recipe.registry import advantage, aggregation, correction, policy_loss, ratio

__all__ = ["advantage", "aggregation", "correction", "policy_loss", "ratio"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")
