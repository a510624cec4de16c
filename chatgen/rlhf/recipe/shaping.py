"""Length control as reward shapers, added to the scores before the advantages (grpo's
step.shaped_rewards, beside DAPO's overlong penalty chatgen.rlhf.losses.overlong_penalty). Pure
torch; docs/algorithms.md has the formulas, tests/unit/test_rlhf_length_shaping.py checks them by
hand.
"""

import torch


def group_length_penalty(lengths: torch.Tensor, correct: torch.Tensor, n: int) -> torch.Tensor:
    """Kimi k1.5's length reward (Kimi Team 2025, sec. 2.3.3), per group of n responses.

    lengths: (S,) response tokens; correct: (S,) bool; S = groups x n, prompt-major. Returns (S,):
    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len) over the response's group, for a
    correct response, and min(0, lambda_i) for an incorrect one (a short wrong answer earns
    nothing); 0 in a group whose responses are all of one length.
    """
    grouped = lengths.float().view(-1, n)
    low = grouped.min(dim=1, keepdim=True).values
    spread = grouped.max(dim=1, keepdim=True).values - low
    lam = torch.where(spread > 0, 0.5 - (grouped - low) / spread.clamp(min=1), 0.0).reshape(-1)
    return torch.where(correct, lam, lam.clamp(max=0.0))


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float):
    """ProRL's stop-properly penalty (Liu et al. 2025; NeMo RL's stop_properly_penalty_coef): a
    response cut at the token limit keeps coef times its reward. rewards: (S,); truncated: (S,)
    bool. Only a positive reward shrinks: coef times a negative one would be a gain for not
    stopping. Returns (S,) the rewards after the penalty."""
    return torch.where(truncated & (rewards > 0), coef * rewards, rewards)
