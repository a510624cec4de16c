# chatgen train configs/grpo_tiny.yaml   (loads this as `reward: {backend: python, model_class: examples.rule_reward:RuleReward}`)
"""A rule-based reward model (backend: python): scores each response text against its prompt's "answer".

The rule is one of chatgen.rlhf.tasks.REWARDS, picked with the model's `rule` key:
    reward:
      backend: python
      model_class: examples.rule_reward:RuleReward
      config: {rule: sort_digits}      # or final_number (GSM8K-style "#### 42" answers)
"""
import torch

from chatgen.rlhf.tasks import get_reward_fn


class RuleReward:
    KEYS = {"rule"}

    def __init__(self, config: dict | None = None):
        config = dict(config or {})
        unknown = sorted(set(config) - self.KEYS)
        if unknown:
            raise ValueError(f"models.reward.config: unknown key(s) {unknown}; RuleReward takes {sorted(self.KEYS)}")
        self.rule = get_reward_fn(config.get("rule", "sort_digits"))

    def forward_step(self, data: dict) -> torch.Tensor:
        """Score S responses. Called by the engine once per episode (and per evaluation).

        data: {"str_outputs": list[str] (S response texts), plus every field of the prompt records as lists of
        length S, e.g. "prompt": list[str], "answer": list[str]}. Returns (S,) float32 rewards.
        """
        if "answer" not in data:
            raise KeyError("RuleReward needs an \"answer\" field in every prompt record of the JSONL data")
        return torch.tensor([self.rule(response, answer) for response, answer in
                             zip(data["str_outputs"], data["answer"])], dtype=torch.float32)
