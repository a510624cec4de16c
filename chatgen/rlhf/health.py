"""The run stops, with a `RunHealthError` saying why and what to change, when it would train on
nonsense:

- more than runtime.max_cut_prompt_fraction of the training prompts were cut to the prompt budget
  (`check_cut_prompts`, before the first episode);
- a reward is NaN or inf (`check_rewards`, every scoring; `checked_rewards` also refuses a reward
  output of the wrong type or length, naming the reward);
- runtime.max_bad_train_steps optimizer steps in a row had a non-finite loss or gradient norm, or
  as many episodes in a row had a train/inference log-prob mismatch that is not finite or jumped far
  above the run's own (`StepHealth`): what diverging training looks like.
Equal rewards are no reason to stop: a solved batch, or a hard task at its start, gives every sample
of a group the same reward and nothing to learn from that group. `zero_variance_groups` counts those
groups (metric reward/zero_variance_groups) and warns when it is every group; a zero gradient norm
warns too.
"""

import math
import statistics

import torch

MISMATCH_JUMP = 50.0  # a mismatch this many times the median of the run's earlier episodes...
MISMATCH_FLOOR = {
    "mismatch/logprob_mean_abs": 0.1,  # ...and above this (nats) jumped
    "mismatch/logprob_max_abs": 1.0,
}


class RunHealthError(RuntimeError):
    """The run is training on nonsense (cut prompts, NaN rewards, collapsed or diverged
    gradients)."""


def check_cut_prompts(items: list, limit: float, log) -> None:
    """Stop when more than `limit` of the items' prompts were cut (their "prompt_cut"); warn when
    any were."""
    cut = sum(1 for item in items if item.get("prompt_cut"))
    if cut and cut / len(items) > limit:
        raise RunHealthError(
            f"{cut} of {len(items)} training prompts ({cut / len(items):.0%}) are longer than the prompt "
            f"budget seq_length - max_new_tokens and were cut, more than runtime.max_cut_prompt_fraction={limit}: "
            "the policy would learn from truncated prompts; raise models.policy seq_length, lower max_new_tokens, "
            "or shorten the prompts"
        )
    if cut:
        log(
            f"[chatgen] WARNING: {cut} of {len(items)} training prompts were cut to the prompt budget"
        )


def check_rewards(rewards: torch.Tensor, texts: list, who: str = "reward.score") -> None:
    """Stop on a NaN or inf reward, naming `who` returned it, the samples and one response that
    got it."""
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise RunHealthError(
            f"{who} returned NaN/inf for samples {bad[:10]} (e.g. response "
            f"{texts[bad[0]]!r}); fix the reward so it returns a finite number for every response"
        )


def checked_rewards(value, texts: list, who: str) -> torch.Tensor:
    """(S,) float32 rewards from what a reward returned for the S responses `texts`: a list,
    tuple, array or tensor of S finite numbers. The one check of every reward output (each term
    of chatgen.rlhf.rewards:Rewards, and what a reward model's `score` gives the run); anything
    else (None, a string, a dict, S' != S numbers, NaN) is refused naming `who` and what it
    returned."""
    n = len(texts)
    need = f"it must return {n} numbers, one per completion (a list of floats)"
    if value is None or isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise TypeError(f"{who} returned {type(value).__name__} {_shown(value)}; {need}")
    if len(value) != n:
        raise ValueError(
            f"{who} returned {len(value)} values for {n} completions ({_shown(value)}); {need}"
        )
    try:
        rewards = torch.as_tensor(
            value if torch.is_tensor(value) else list(value), dtype=torch.float32
        )
    except (TypeError, ValueError, RuntimeError):
        kinds = sorted({type(v).__name__ for v in value})
        raise TypeError(
            f"{who} returned a {type(value).__name__} of {', '.join(kinds)} ({_shown(value)}); {need}"
        ) from None
    if rewards.shape != (n,):
        raise ValueError(f"{who} returned shape {tuple(rewards.shape)} ({_shown(value)}); {need}")
    check_rewards(rewards, texts, who)
    return rewards


def _shown(value) -> str:
    """`value` as an error message quotes it (120 characters at most). Only on an error: two
    reprs of a 256-reward tensor (~2.3 ms) ran on every score."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def equal_reward_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(P,) bool: the groups of `n` consecutive rewards (one prompt's samples) that are all equal
    (advantages 0: no gradient). rewards: (S,), S = P * n."""
    groups = rewards.reshape(-1, n)
    return (groups == groups[:, :1]).all(dim=1)


def zero_variance_groups(rewards: torch.Tensor, n: int, log) -> int:
    """How many groups of `n` consecutive rewards are all equal (`equal_reward_groups`); warns
    when every group is (the episode teaches nothing). rewards: (S,), S a multiple of n."""
    groups = rewards.reshape(-1, n)
    count = int(equal_reward_groups(rewards, n).sum())
    if count == len(groups) and n > 1:
        log(
            f"[chatgen] WARNING: every group's {n} rewards are equal this episode ({count} groups, "
            f"e.g. {groups[0, 0].item():.4g}): nothing to learn from it (solved, or too hard)"
        )
    return count


class StepHealth:
    """Counts each trainer's optimizer steps in a row whose loss or gradient norm is not finite (the
    step was skipped), and the episodes in a row whose log-prob mismatch is not finite or jumped;
    warns on each, stops at `limit` (runtime.max_bad_train_steps). A zero gradient norm only
    warns."""

    def __init__(self, limit: int, log):
        self.limit, self.log, self.bad = limit, log, {}
        self.mismatches = {}  # metric name -> its values in the earlier episodes

    def check(self, name: str, step: dict) -> None:
        what = ", ".join(f"{k}={v:.4g}" for k, v in step.items())
        bad = (
            step.get("skipped_step", 0.0) > 0
            or not math.isfinite(step["grad_norm"])
            or not math.isfinite(step.get("loss", 0.0))
        )
        self._count(
            name,
            bad,
            f"{name}: an optimizer step with a non-finite loss or gradient norm ({what})",
            f"lower models.{name} lr or check the loss",
        )
        if not bad and step["grad_norm"] == 0:
            self.log(
                f"[chatgen] WARNING: {name} step with a zero gradient norm ({what}): nothing "
                "to learn from its batch (e.g. every group's rewards equal)"
            )

    def check_mismatch(self, metrics: dict) -> None:
        """An episode's train/inference log-prob mismatch (mismatch/logprob_*): not finite, or a
        jump to MISMATCH_JUMP times the median of the earlier episodes (and over MISMATCH_FLOOR), is
        bad."""
        for key, floor in MISMATCH_FLOOR.items():
            if key not in metrics:
                continue
            value, earlier = metrics[key], self.mismatches.setdefault(key, [])
            median = statistics.median(earlier) if len(earlier) >= 2 else None
            jumped = median is not None and value > max(floor, MISMATCH_JUMP * median)
            bad = not math.isfinite(value) or jumped
            self._count(
                key,
                bad,
                f"{key} = {value:.4g} is not finite or jumped (the median of "
                f"the run's earlier episodes: {median})",
                "the trainer and the engine no longer compute the same model: lower lr, "
                "or check the weight sync (chatgen check-sync)",
            )
            if math.isfinite(value):
                earlier.append(value)

    def _count(self, key: str, bad: bool, event: str, fix: str) -> None:
        self.bad[key] = self.bad.get(key, 0) + 1 if bad else 0
        if not bad:
            return
        if self.bad[key] >= self.limit:
            raise RunHealthError(
                f"{event}; {self.bad[key]} in a row, runtime.max_bad_train_steps"
                f"={self.limit}: training has diverged; {fix}"
            )
        self.log(
            f"[chatgen] WARNING: {event} ({self.bad[key]} in a row; the run stops at {self.limit})"
        )
