"""A replay of informative groups (TRL's GRPO with a replay buffer): a group whose n rewards are all
equal teaches nothing (advantage 0), so it is replaced by a stored group of a recent episode whose
rewards varied most.

    runtime: {algorithm: {name: grpo, replay_buffer_size: 16, replay_max_age: 4,
                          importance_sampling_cap: 2.0}}

Each episode, after scoring (and the shapings: the groups are judged on the rewards the advantages
see): the zero-variance groups are swapped for the buffer's highest-std groups at most
replay_max_age episodes old (each replayed once, then gone), and the episode's own varied groups
enter the buffer, which keeps the replay_buffer_size of highest std and forgets groups past the age.
A replayed group keeps its samples, the engine's log-probs, per-token weight versions and rewards:
it is off-policy by its age, which the rollout correction weighs (importance_sampling_cap or
old_logprobs: rollout is required, as for overlap_generation). With max_staleness the replay comes
before the staleness bound, so a replayed group older than the bound allows is dropped like any
other (async/stale_groups) and async/staleness_* count its tokens. The buffer is not checkpointed: a
resumed run starts it empty.

Metrics: replay/replaced_groups, replay/unreplaced_groups (zero-variance groups left for want of a
stored one), replay/age_mean (episodes, of the replayed groups), replay/buffer_groups,
replay/expired_groups (forgotten by age this episode).
"""

import torch

from chatgen.core.rollout import RolloutBatch
from chatgen.rlhf.algorithms.grpo.step import shaped_rewards


def check_keys(algo):
    """(key, problem) pairs of the replay keys of GRPO's Config."""
    if algo.replay_buffer_size < 0:
        yield "replay_buffer_size", f"must be >= 0, got {algo.replay_buffer_size}; 0 = off"
    if algo.replay_max_age < 1:
        yield "replay_max_age", f"must be >= 1 episode, got {algo.replay_max_age}"
    if not algo.replay_buffer_size:
        return
    if algo.old_logprobs == "recompute" and algo.importance_sampling_cap is None:
        yield (
            "replay_buffer_size",
            "replayed groups were sampled by older weights, which recomputed old log-probs do "
            "not see; set importance_sampling_cap (e.g. 2.0) or old_logprobs: rollout",
        )
    if algo.dynamic_sampling:
        yield (
            "replay_buffer_size",
            "dynamic_sampling already replaces zero-variance groups (with fresh ones); set one "
            "of them off",
        )
    if algo.max_staleness and algo.stale_samples == "regenerate":
        yield (
            "replay_buffer_size",
            "stale_samples: regenerate generates a stale group's prompt again, and a replayed "
            "group's prompt is not this batch's; use stale_samples: drop",
        )


class ReplayBuffer:
    """The stored groups: (std, episode, group batch of n samples, its (n,) rewards)."""

    def __init__(self, capacity: int, max_age: int):
        self.capacity, self.max_age = capacity, max_age
        self.groups = []

    def __len__(self) -> int:
        return len(self.groups)

    def expire(self, episode: int) -> int:
        """Forget the groups more than max_age episodes older than `episode`; how many went."""
        before = len(self.groups)
        self.groups = [g for g in self.groups if episode - g[1] <= self.max_age]
        return before - len(self.groups)

    def take(self, count: int) -> list:
        """Up to `count` stored groups, highest reward std first (ties: the newest), each
        removed."""
        self.groups.sort(key=lambda g: (g[0], g[1]), reverse=True)
        taken, self.groups = self.groups[:count], self.groups[count:]
        return taken

    def add(self, std: float, episode: int, batch, rewards) -> None:
        """Store a group; past capacity the lowest-std (then oldest) group goes."""
        self.groups.append((std, episode, batch, rewards))
        if len(self.groups) > self.capacity:
            self.groups.sort(key=lambda g: (g[0], g[1]), reverse=True)
            self.groups.pop()


def refill(buffer: ReplayBuffer, cfg, batch, rewards, n: int, episode: int):
    """`batch` with its zero-variance groups replaced by stored ones, then its varied groups
    stored. Returns (batch, rewards, metrics); the batch and rewards unchanged when nothing was
    replaced."""
    expired = buffer.expire(episode)
    std = shaped_rewards(cfg, batch, rewards)[0].view(-1, n).std(dim=1)
    flat = (std == 0).tolist()
    taken = buffer.take(sum(flat))
    for g, is_flat in enumerate(flat):
        if not is_flat:
            rows = torch.arange(g * n, (g + 1) * n)
            buffer.add(std[g].item(), episode, batch.select(rows), rewards[rows])
    metrics = {
        "replay/replaced_groups": len(taken),
        "replay/unreplaced_groups": sum(flat) - len(taken),
        "replay/age_mean": sum(episode - t[1] for t in taken) / len(taken) if taken else 0.0,
        "replay/buffer_groups": len(buffer),
        "replay/expired_groups": expired,
    }
    if not taken:
        return batch, rewards, metrics
    parts, scores, stored = [], [], list(taken)
    for g, is_flat in enumerate(flat):
        if is_flat and stored:  # the first flat groups, while stored ones last
            _, _, group, group_rewards = stored.pop(0)
            parts.append(group)
            scores.append(group_rewards)
        else:
            rows = torch.arange(g * n, (g + 1) * n)
            parts.append(batch.select(rows))
            scores.append(rewards[rows])
    out = RolloutBatch.concat(parts, cfg.models["policy"].config.pad_token_id or 0)
    out.prompt_index = torch.arange(len(flat)).repeat_interleave(n)
    return out, torch.cat(scores), metrics
