"""The arithmetic task, a question for a chat model, and the final-number (GSM8K-style) check that
scores it.

"What is 13 + 8? Reply with only the result, as a number." -> "21" (sums and differences of numbers
up to `max_operand`, never negative): the policy renders it with its chat template (`chat_template:
true`). Scored by `final_number_reward` (1.0 when the last number of the response is the answer), so
"13 + 8 = 21" counts as much as "21". The task of `examples/train_grpo_smollm2.sh`:
SmolLM2-135M-Instruct answers 38% of the held-out questions right before RL (greedy), mostly by
getting the arithmetic wrong ("13 - 6 = 1"); GRPO lifts that within a few episodes (docs/models.md).
"""

import random
import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def records(n: int, seed: int, max_operand: int = 20) -> list[dict]:
    """`n` problems "What is a + b?" / "What is a - b?" (a >= b) with 1 <= a, b <= max_operand,
    from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if rng.random() < 0.5:
            question, result = f"{a} + {b}", a + b
        else:
            question, result = f"{max(a, b)} - {min(a, b)}", abs(a - b)
        out.append(
            {
                "prompt": f"What is {question}? Reply with only the result, as a number.",
                "answer": str(result),
            }
        )
    return out


def final_number_reward(response: str, answer: str) -> float:
    """1.0 if the last number in the response equals the answer's last number (GSM8K "#### 42"),
    else 0.0."""
    got, want = NUMBER.findall(response), NUMBER.findall(answer)
    if not want:
        raise ValueError(f"answer {answer!r} has no number")
    if not got:
        return 0.0
    try:
        return float(float(got[-1].replace(",", "")) == float(want[-1].replace(",", "")))
    except ValueError:
        return 0.0
