"""Rule-based reward models (`backend: python`): score each response text against its prompt record's "answer".

    reward:
      backend: python
      model_class: chatgen.rlhf.rewards:RuleReward
      config: {rule: sort_digits}      # or final_number (GSM8K-style "#### 42" answers)

The rules are the pure functions of chatgen.tasks (`REWARDS`); a reward of your own is any
`chatgen.Module` with a `score(data)` method (docs/extending.md).
"""
import dataclasses
from typing import Literal

import torch

from chatgen.config import opt
from chatgen.module import Module
from chatgen.tasks import REWARDS


@dataclasses.dataclass(kw_only=True)
class RuleRewardConfig:
    rule: Literal[tuple(REWARDS)] = opt("sort_digits", "which rule of chatgen.tasks.REWARDS scores the responses")


class RuleReward(Module):
    config_class = RuleRewardConfig

    def setup(self) -> None:
        self.rule = REWARDS[self.config.rule]

    def score(self, data: dict) -> torch.Tensor:
        """Score S responses. Called by the run once per episode (and per evaluation).

        data: {"texts": list[str] (S response texts), plus every field of the prompt records as lists of length S,
        e.g. "prompt": list[str], "answer": list[str]}. Returns (S,) float32 rewards.
        """
        if "answer" not in data:
            raise KeyError("RuleReward needs an \"answer\" field in every prompt record of the JSONL data")
        return torch.tensor([self.rule(response, answer) for response, answer in zip(data["texts"], data["answer"])],
                            dtype=torch.float32)
