"""The run stops, with a `RunHealthError` saying why and what to change, when it would train on nonsense:

- more than runtime.max_cut_prompt_fraction of the training prompts were cut to the prompt budget
  (`check_cut_prompts`, before the first episode);
- a reward is NaN or inf (`check_rewards`, every scoring; `checked_rewards` also refuses a reward output of the
  wrong type or length, naming the reward);
- runtime.max_bad_train_steps optimizer steps in a row had a zero or non-finite gradient norm (`StepHealth`).
"""
import math

import torch


class RunHealthError(RuntimeError):
    """The run is training on nonsense (cut prompts, NaN rewards, collapsed or diverged gradients)."""


def check_cut_prompts(items: list, limit: float, log) -> None:
    """Stop when more than `limit` of the items' prompts were cut (their "prompt_cut"); warn when any were."""
    cut = sum(1 for item in items if item.get("prompt_cut"))
    if cut and cut / len(items) > limit:
        raise RunHealthError(
            f"{cut} of {len(items)} training prompts ({cut / len(items):.0%}) are longer than the prompt "
            f"budget seq_length - max_new_tokens and were cut, more than runtime.max_cut_prompt_fraction={limit}: "
            "the policy would learn from truncated prompts; raise models.policy seq_length, lower max_new_tokens, "
            "or shorten the prompts")
    if cut:
        log(f"[chatgen] WARNING: {cut} of {len(items)} training prompts were cut to the prompt budget")


def check_rewards(rewards: torch.Tensor, texts: list, who: str = "reward.score") -> None:
    """Stop on a NaN or inf reward, naming `who` returned it, the samples and one response that got it."""
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise RunHealthError(f"{who} returned NaN/inf for samples {bad[:10]} (e.g. response "
                             f"{texts[bad[0]]!r}); fix the reward so it returns a finite number for every response")


def checked_rewards(value, texts: list, who: str) -> torch.Tensor:
    """(S,) float32 rewards from what a reward returned for the S responses `texts`: a list, tuple, array or
    tensor of S finite numbers. The one check of every reward output (each term of chatgen.rlhf.rewards:Rewards,
    and what a reward model's `score` gives the run); anything else (None, a string, a dict, S' != S numbers,
    NaN) is refused naming `who` and what it returned."""
    n = len(texts)
    shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:117] + "..."
    need = f"it must return {n} numbers, one per completion (a list of floats)"
    if value is None or isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise TypeError(f"{who} returned {type(value).__name__} {shown}; {need}")
    if len(value) != n:
        raise ValueError(f"{who} returned {len(value)} values for {n} completions ({shown}); {need}")
    try:
        rewards = torch.as_tensor(value if torch.is_tensor(value) else list(value), dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        kinds = sorted({type(v).__name__ for v in value})
        raise TypeError(f"{who} returned a {type(value).__name__} of {', '.join(kinds)} ({shown}); {need}") from None
    if rewards.shape != (n,):
        raise ValueError(f"{who} returned shape {tuple(rewards.shape)} ({shown}); {need}")
    check_rewards(rewards, texts, who)
    return rewards


class StepHealth:
    """Counts each trainer's optimizer steps in a row whose gradient norm is zero (nothing learns) or not finite
    (the step was skipped); warns on each, stops at `limit` (runtime.max_bad_train_steps)."""

    def __init__(self, limit: int, log):
        self.limit, self.log, self.bad = limit, log, {}

    def check(self, name: str, step: dict) -> None:
        bad = step.get("skipped_step", 0.0) > 0 or not math.isfinite(step["grad_norm"]) or step["grad_norm"] == 0
        self.bad[name] = self.bad.get(name, 0) + 1 if bad else 0
        if not bad:
            return
        what = ", ".join(f"{k}={v:.4g}" for k, v in step.items())
        if self.bad[name] >= self.limit:
            raise RunHealthError(f"{name}: {self.bad[name]} optimizer steps in a row with a zero or non-finite "
                                 f"gradient norm (last: {what}), runtime.max_bad_train_steps={self.limit}: training has "
                                 f"collapsed or diverged; lower models.{name} lr or check the loss and the data")
        self.log(f"[chatgen] WARNING: {name} step with a zero or non-finite gradient norm ({what})")
