# chatgen train configs/grpo_tiny.yaml   (loads this as `policy: {model_class: examples.sort_policy_inference:SortPolicyInference}`; ppo_tiny too)
"""Policy inference for the sort-digits task: PolicyInference (examples/policy_inference.py) without its
question template, because the task's prompts ("sort: 3 1 4 =") are already what the model sees.

decode_internal is PolicyInference's: all_tokens, loss_mask, old_logprobs (vLLM's), prompt/response lengths
and str_outputs, the batch the RLHF engine turns into trainer inputs.
"""
from chatgen import VLLMModule
from examples.policy_inference import PolicyInference


class SortPolicyInference(PolicyInference):
    def build_dataset(self, prompts, is_eval=False):
        """prompts: list[str] -> [{"input_ids": list[int] (BOS + prompt tokens), "prompt": str}] (no template)."""
        return VLLMModule.build_dataset(self, prompts, is_eval)
