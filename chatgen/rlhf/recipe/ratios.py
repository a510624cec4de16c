"""Policy ratios, `runtime.algorithm.ratio_level`: fn(logprobs, old_logprobs, mask) -> (B, T)
log-ratio whose exp policy_loss clips (docs/algorithms.md)."""

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.registry import ratio


def _sequence_rules(algo):
    if algo.importance_sampling_cap is not None and algo.importance_sampling_level == "token":
        yield (
            "ratio_level",
            "sequence (GSPO) with token-level importance_sampling_cap weights mixes a sequence "
            "ratio with per-token corrections; set importance_sampling_level: sequence or "
            "geometric (or importance_sampling_cap: null)",
        )


ratio("token")(L.token_log_ratio)
ratio("sequence", check=_sequence_rules)(L.sequence_log_ratio)
