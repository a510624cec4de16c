"""Importance weights for the train/inference mismatch,
`runtime.algorithm.importance_sampling_level` (with importance_sampling_cap): fn(old_logprobs,
infer_logprobs, mask, cap) -> detached weights, (B, T) per token or (B,) per sequence
(docs/algorithms.md: TIS, verl's rollout_is)."""

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.registry import correction


@correction("token")
def token(old_logprobs, infer_logprobs, mask, cap):
    """min(pi_train / pi_infer, cap) per token (TIS)."""
    return L.truncated_importance_weights(old_logprobs, infer_logprobs, cap)


@correction("sequence")
def sequence(old_logprobs, infer_logprobs, mask, cap):
    """min(prod_t pi_train / pi_infer, cap) per sequence."""
    return L.sequence_importance_weights(old_logprobs, infer_logprobs, mask, cap)


@correction("geometric")
def geometric(old_logprobs, infer_logprobs, mask, cap):
    """min(exp(mean_t log(pi_train / pi_infer)), cap) per sequence."""
    return L.sequence_importance_weights(old_logprobs, infer_logprobs, mask, cap, geometric=True)
