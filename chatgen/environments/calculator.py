"""The built-in `calculator` environment (multi-turn GRPO's tiny recipe): sort digits, read a
calculator.

    chatgen train configs/grpo_multiturn_tiny.yaml    # runtime.algorithm.environment: calculator
    python -m chatgen.environments.calculator --write-template outputs/tiny-llama-sft   # its chat template

One episode (the chat template below renders it as plain text for the tiny model):

    user        sort: 3 1 2 =
    assistant   (the model's first answer)              reward 0 (logged: env/first_turn_reward)
    tool        1 2 3                                   (a real computation on the prompt's digits)
    user        sort: 3 1 2 =                           (the question again)
    assistant   (the model's final answer)              reward: the sort_digits rule on it; done
"""

import argparse
import re
from pathlib import Path

from chatgen.core.checkpoint_io import atomic_file
from chatgen.environments.base import Environment, Step
from chatgen.tasks import REWARDS

# A plain-text chat template for the tiny model (its tokenizer has none): turn 1 renders exactly as
# the task's prompt (what the warm start saw), each assistant turn ends with EOS (the server counts
# EOS tokens to keep earlier turns token-exact), and a tool message reads " calculator: <result>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% elif m['role'] == 'tool' %}{{ ' calculator:' + m['content'] }}"
    "{% else %}{{ ' ' + m['content'] }}{% endif %}"
    "{% endfor %}"
)


def calculator(prompt: str) -> str:
    """The tool: the digits of a sort prompt, sorted (" 1 2 3" for "sort: 3 1 2 =")."""
    return "".join(f" {d}" for d in sorted(re.findall(r"\d", prompt)))


class CalculatorEnv(Environment):
    """Two model turns with a calculator turn between them; reward = the sort_digits rule on the final
    reply."""

    def reset(self, record: dict) -> list:
        self.record, self.turn = record, 0
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, message: dict) -> Step:
        self.turn += 1
        score = REWARDS["sort_digits"](message.get("content") or "", self.record["answer"])
        if self.turn == 1:
            prompt = self.record["prompt"]
            return Step(
                messages=[
                    {"role": "tool", "content": calculator(prompt)},
                    {"role": "user", "content": prompt},
                ],
                metrics={"first_turn_reward": score},
            )
        return Step(reward=score, done=True)


def write_template(model_dir: Path) -> None:
    """Write CHAT_TEMPLATE as the model's chat_template.jinja (transformers reads it with the
    tokenizer)."""
    with atomic_file(model_dir / "chat_template.jinja") as tmp:
        Path(tmp).write_text(CHAT_TEMPLATE)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write-template",
        type=Path,
        required=True,
        metavar="MODEL_DIR",
        help="write the environment's chat template into this Hugging Face model directory",
    )
    args = parser.parse_args()
    if not (args.write_template / "config.json").is_file():
        raise SystemExit(
            f"--write-template {args.write_template}: no config.json there; give a model directory"
        )
    write_template(args.write_template)
    print(f"wrote {args.write_template / 'chat_template.jinja'}")
