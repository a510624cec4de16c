"""The run stops, with a `RunHealthError` saying why and what to change, when it would train on nonsense:

- more than runtime.max_cut_prompt_fraction of the training prompts were cut to the prompt budget
  (`check_cut_prompts`, before the first episode);
- a reward is NaN or inf (`check_rewards`, every scoring);
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


def check_rewards(rewards: torch.Tensor, texts: list) -> None:
    """Stop on a NaN or inf reward, naming the samples and one response that got it."""
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise RunHealthError(f"reward.score returned NaN/inf for samples {bad[:10]} (e.g. response "
                             f"{texts[bad[0]]!r}); fix the reward so it returns a finite number for every response")


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
