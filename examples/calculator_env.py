"""A multi-turn tool environment for chatgen's multi-turn GRPO (what a user writes): sort digits, ask a calculator.

    python -m chatgen.environments.calculator --write-template outputs/tiny-llama-sft   # its chat template
    chatgen train configs/grpo_multiturn_tiny.yaml runtime.algorithm.environment=examples.calculator_env:CalculatorEnv

An environment written as a class with `episode` (the other way to write one is the reset/step protocol of
chatgen.environments, as the built-in `calculator` is). One episode, a chat with the policy through the
official `openai` client (chatgen serves the policy over
OpenAI HTTP during the run; this file never touches the engine or the trainer):

    user        sort: 3 1 2 =
    assistant   (the model's first answer)
    tool        calculator: 1 2 3          (a real computation on the prompt's digits)
    user        sort: 3 1 2 =              (the question again)
    assistant   (the model's final answer)  -> reward: the sort_digits rule on it

Each assistant message goes back to the server as it came (with its prompt_token_ids and
generation_token_ids), so the server keeps the chat token-exact and the episode is one token sequence the
trainer can learn from (chatgen/rlhf/algorithms/grpo_multiturn.py). docs/multiturn_rl.md walks through it.
"""

import openai

# the tool is the built-in environment's (chatgen.environments.calculator, which also writes the chat template;
# the same episode written in the reset/step protocol: what configs/grpo_multiturn_tiny.yaml runs)
from chatgen.environments.calculator import calculator
from chatgen.rlhf.algorithms.grpo_multiturn import Episode
from chatgen.tasks import REWARDS


class CalculatorEnv:
    """Two model turns with a calculator call between them; reward = the sort_digits rule on the final reply.
    One instance per run; `episode` runs on many threads at once (it keeps no state on self)."""

    def __init__(self, base_url: str, api_key: str, model: str):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
        self.model = model

    def reply(self, messages: list, temperature: float, max_tokens: int) -> dict:
        response = self.client.chat.completions.create(
            model=self.model, messages=messages, temperature=temperature, max_tokens=max_tokens
        )
        # with the token ids and log-probs
        return response.choices[0].message.model_dump(exclude_none=True)

    def episode(self, record: dict, temperature: float, max_tokens: int) -> Episode:
        rule = REWARDS["sort_digits"]
        messages = [{"role": "user", "content": record["prompt"]}]
        first = self.reply(messages, temperature, max_tokens)
        messages += [
            first,
            {"role": "tool", "content": calculator(record["prompt"])},
            {"role": "user", "content": record["prompt"]},
        ]
        final = self.reply(messages, temperature, max_tokens)
        return Episode(
            turns=[first, final],
            reward=rule(final["content"], record["answer"]),
            text=final["content"],
            metrics={"first_turn_reward": rule(first["content"], record["answer"])},
        )
