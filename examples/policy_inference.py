# .venv/bin/python examples/policy_inference.py --config configs/policy_inference.yaml load=outputs/tiny-llama
"""A policy-inference module: the VLLMModule subclass an RLHF loop uses to sample responses for training.

    chatgen make-tiny-model --config configs/models/tiny_llama.yaml --output outputs/tiny-llama
    .venv/bin/python examples/policy_inference.py --config configs/policy_inference.yaml load=outputs/tiny-llama

It overrides two hooks (docs/vllm_module.md walks through them):
  build_dataset    wraps each question in a prompt template before tokenizing
  decode_internal  turns finished requests into the trainer's tensors: tokens, loss mask, old logprobs
                   (from chatgen.generation.batching.generation_output, the layout generate() returns)
and keeps the framework's defaults for model_provider, setup, _add_request and forward_step.
"""
import argparse
import sys

import torch

from chatgen import VLLMModule
from chatgen.config import load_model_config, VLLMConfig
from chatgen.generation.batching import generation_output, iter_samples

TEMPLATE = "Question: {question}\nAnswer:"


class PolicyInference(VLLMModule):
    def build_dataset(self, prompts, is_eval=False):
        """Questions -> dataset items of the templated prompt (the default tokenizes and cuts to the prompt budget)."""
        items = super().build_dataset([TEMPLATE.format(question=q) for q in prompts], is_eval)
        for item, question in zip(items, prompts):
            item["question"] = question
        return items

    def decode_internal(self, batched_outputs):
        """Finished requests -> what the trainer consumes, S = prompts x n samples, L = longest sequence:

            all_tokens     (S, L) long   prompt + response, right-padded with pad_token_id
            prompt_lengths (S,)   long   response_lengths (S,) long
            loss_mask      (S, L) float  1 on response tokens (the ones the policy is trained on), else 0
            old_logprobs   (S, L) float  vLLM's logprob of each response token at its position, else 0
            str_outputs    list[str]     response texts;  prompt_str list[str]  the prompts
        """
        # output_ids / logprobs (S, T + longest response), prompt-major, right-padded: trimmed to L below
        out = generation_output(batched_outputs, max(len(r.prompt_token_ids) for r in batched_outputs),
                                self.pad_token_id)
        ends = out["unpadded_sequence_lengths"]                       # (S,) prompt + response
        starts = ends - out["generation_lengths"]                     # (S,) prompt lengths
        positions = torch.arange(int(ends.max()))                     # (L,)
        width = len(positions)
        samples = list(iter_samples(batched_outputs))
        return {
            "all_tokens": out["output_ids"][:, :width],
            "prompt_lengths": starts,
            "response_lengths": out["generation_lengths"],
            "loss_mask": ((positions >= starts[:, None]) & (positions < ends[:, None])).float(),
            "old_logprobs": out["logprobs"][:, :width],
            "str_outputs": [sample.text or "" for _, sample in samples],
            "prompt_str": [request.prompt for request, _ in samples],
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/policy_inference.yaml", help="per-model YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="per-model keys, e.g. load=DIR n=2")
    args = parser.parse_args(argv)

    policy = PolicyInference(load_model_config(args.config, VLLMConfig, args.overrides))
    policy.setup()
    questions = ["What is two plus two?", "Name a colour.", "Why is the sky blue?"]
    batch = policy.run_generation(policy.build_dataset(questions))
    m = policy.metrics
    print(f"{len(questions)} prompts x n={policy.config.n}: all_tokens {tuple(batch['all_tokens'].shape)}, "
          f"{int(batch['loss_mask'].sum())} response tokens in {m['engine_steps']} engine steps, "
          f"{m['generation_tokens_per_s']:.0f} tokens/s, peak KV-cache use {100 * m['kv_cache_usage_peak']:.1f}%")
    for prompt, text in zip(batch["prompt_str"][::policy.config.n], batch["str_outputs"][::policy.config.n]):
        print(f"  {prompt!r} -> {text!r}")
    evaluation = policy.run_generation(policy.build_dataset(questions, is_eval=True), is_eval=True)
    print(f"eval (greedy, one response each): {evaluation['str_outputs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
