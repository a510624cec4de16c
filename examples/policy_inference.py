# .venv/bin/python examples/policy_inference.py --config configs/policy_inference.yaml load=outputs/tiny-llama
"""A policy-inference module: a VLLMModule subclass that shapes its prompts and its samples with two hooks.

    chatgen make-tiny-model --config configs/models/tiny_llama.yaml --output outputs/tiny-llama
    .venv/bin/python examples/policy_inference.py --config configs/policy_inference.yaml load=outputs/tiny-llama

It overrides (docs/vllm_module.md walks through them):
  build_dataset    wraps each question in a few-shot prompt before tokenizing (a one-line `prompt_template`
                   in the YAML covers the simple case; code covers anything else)
  decode_internal  takes the framework's RolloutBatch and stops training on what follows the first line of each
                   response (loss_mask = 0 there), the kind of shaping a task with a one-line answer wants
and keeps the framework's defaults for model_provider, setup, _add_request and forward_step. Name it in a main
YAML as `model_class: examples.policy_inference:PolicyInference` (run from the repository root).
"""

import argparse
import sys

from chatgen.core import quiet

quiet.apply()  # before vLLM loads (imported below for the class); CHATGEN_VERBOSE=1 shows all it says

from chatgen import VLLMModule  # noqa: E402

FEW_SHOT = "Question: What is one plus one?\nAnswer: two\n\nQuestion: {question}\nAnswer:"


class PolicyInference(VLLMModule):
    def build_dataset(self, prompts, is_eval=False):
        """Questions -> dataset items of the few-shot prompt (the default tokenizes and cuts to the prompt budget)."""
        items = super().build_dataset([FEW_SHOT.format(question=q) for q in prompts], is_eval)
        for item, question in zip(items, prompts):
            item["prompt"] = question  # what rewards and logs see
        return items

    def decode_internal(self, batched_outputs):
        """The default RolloutBatch (S = prompts x n samples), with loss_mask zeroed after each response's first
        newline token: entry t of loss_mask (S, L-1) trains token t+1."""
        batch = super().decode_internal(batched_outputs)
        newline = (
            self.tokenizer.convert_tokens_to_ids("<0x0A>") if self.tokenizer is not None else None
        )
        for s in range(len(batch)):
            start, end = (
                int(batch.prompt_lengths[s]),
                int(batch.prompt_lengths[s] + batch.response_lengths[s]),
            )
            tokens = batch.input_ids[s, start:end].tolist()
            if newline in tokens:
                cut = start + tokens.index(newline) + 1  # keep the newline itself
                batch.loss_mask[s, cut - 1 :] = 0.0
        return batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/policy_inference.yaml", help="per-model YAML")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="per-model keys, e.g. load=DIR n=2"
    )
    args = parser.parse_args(argv)

    from chatgen.config import load_model_config
    from chatgen.generation.vllm.config import VLLMConfig

    policy = PolicyInference(load_model_config(args.config, VLLMConfig, args.overrides)).start()
    questions = ["What is two plus two?", "Name a colour.", "Why is the sky blue?"]
    batch = policy.run_generation(policy.build_dataset(questions))
    m = policy.metrics
    print(
        f"{len(questions)} prompts x n={policy.config.n}: input_ids {tuple(batch.input_ids.shape)}, "
        f"{int(batch.loss_mask.sum())} trained response tokens of {int(batch.response_lengths.sum())} in "
        f"{m['engine_steps']} engine steps, {m['generation_tokens_per_s']:.0f} tokens/s, peak KV-cache use "
        f"{100 * m['kv_cache_usage_peak']:.1f}%"
    )
    for i in range(0, len(batch), policy.config.n):
        print(f"  {questions[int(batch.prompt_index[i])]!r} -> {batch.texts[i]!r}")
    evaluation = policy.run_generation(policy.build_dataset(questions, is_eval=True), is_eval=True)
    print(f"eval (greedy, one response each): {evaluation.texts}")
    policy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
