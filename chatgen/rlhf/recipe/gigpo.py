"""GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", verl-agent),
the step-wise advantage estimator `runtime.algorithm.advantage_estimator: gigpo` of grpo_multiturn:
credit for each model turn, not only for the episode.

The episode advantage is GRPO's, of the episode return (the sum of its turn rewards) over the n
episodes of a prompt. The step advantage groups turns by the state they answered (anchor states:
`Episode.turn_states`, a digest of what the environment showed before the turn): within the n
episodes of a prompt, every turn that answered the same state is compared with the others on its
discounted return from that turn on:

    R_{i,t} = sum_{k >= t} gamma^(k - t) r_{i,k}                      gamma: step_discount
    A_S(i, t) = (R_{i,t} - mean_{same state} R) / (std_{same state} R + eps)   (std: normalize_advantage_std)
    A(i, t) = A_E(i) + w * A_S(i, t)                                  w: step_advantage_weight

A state one turn alone answered gets A_S = 0 (nothing to compare it with). Every generated token of
turn t carries A(i, t): a (S, L-1) per-token advantage. With one turn per episode the first state is
the prompt, shared by the whole group, and A = (1 + w) x GRPO's.

The turns reach the estimator as batch extras (grpo_multiturn.turn_extras): turn_index (S, L-1)
long, each response token's model turn at its loss position (-1 elsewhere); turn_rewards and
turn_states, per episode a list per turn.
"""

import collections

import torch

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.advantages import no_kl_in_reward
from chatgen.rlhf.recipe.registry import advantage

EPS = 1e-6


def step_returns(turn_rewards: list, gamma: float) -> list:
    """Per episode, per turn: its discounted return R_t = r_t + gamma R_{t+1}."""
    out = []
    for rewards in turn_rewards:
        acc, returns = 0.0, []
        for r in reversed(rewards):
            acc = r + gamma * acc
            returns.append(acc)
        out.append(returns[::-1])
    return out


def step_advantages(returns: list, states: list, n: int, normalize_std: bool = True) -> list:
    """Per episode, per turn: its return against those of the turns of its group (the n episodes
    of its prompt, contiguous) that answered the same state; 0 for a state answered once."""
    advantages = [[0.0] * len(r) for r in returns]
    for g in range(0, len(returns), n):
        by_state = collections.defaultdict(list)
        for i in range(g, g + n):
            for t, key in enumerate(states[i]):
                by_state[key].append((i, t))
        for members in by_state.values():
            if len(members) < 2:
                continue
            values = torch.tensor([returns[i][t] for i, t in members], dtype=torch.float64)
            centred = values - values.mean()
            if normalize_std:
                centred = centred / (values.std() + EPS)
            for (i, t), a in zip(members, centred.tolist()):
                advantages[i][t] = a
    return advantages


def gigpo_advantages(
    rewards, n, turn_index, turn_rewards, turn_states, weight, gamma, normalize_std=True
):
    """(S, L-1) advantages (module docstring). rewards: (S,) episode returns; turn_index: (S, L-1)
    long; turn_rewards / turn_states: per episode, per turn."""
    episode = L.group_advantages(rewards.float(), n, normalize_std=normalize_std, eps=EPS)  # (S,)
    steps = step_advantages(step_returns(turn_rewards, gamma), turn_states, n, normalize_std)
    width = max(1, max(len(s) for s in steps))
    table = torch.zeros(len(steps), width + 1)  # column `width`: the -1 (untrained) positions
    for i, row in enumerate(steps):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    trained = turn_index >= 0
    index = torch.where(trained, turn_index.clamp(max=width), width)
    per_token = episode.unsqueeze(1) + weight * torch.gather(table, 1, index)
    return torch.where(trained, per_token, torch.zeros_like(per_token))


def _rules(algo):
    yield from no_kl_in_reward(algo)
    if not hasattr(algo, "step_advantage_weight"):
        yield (
            "advantage_estimator",
            "gigpo credits the turns of multi-turn episodes: use it with name: grpo_multiturn",
        )


@advantage("gigpo", check=_rules)
def gigpo(rewards, n, batch, algo):
    """GiGPO (module docstring): the episode's group advantage plus each turn's anchor-state one."""
    extras = batch.extras
    if "turn_index" not in extras:
        raise ValueError(
            "runtime.algorithm.advantage_estimator: gigpo needs the turns of multi-turn "
            "episodes; use it with name: grpo_multiturn"
        )
    states = [
        list(s)
        if len(s) == len(r)
        else [f"{i}/{t}" for t in range(len(r))]  # no states: none shared
        for i, (s, r) in enumerate(zip(extras["turn_states"], extras["turn_rewards"]))
    ]
    adv = gigpo_advantages(
        rewards,
        n,
        extras["turn_index"],
        extras["turn_rewards"],
        states,
        algo.step_advantage_weight,
        algo.step_discount,
        algo.normalize_advantage_std,
    )
    return adv.to(rewards.dtype)
