"""The sort-digits task: "sort: 3 1 4 1 5 =" -> " 1 1 3 4 5".

A 2-layer model learns it in minutes on a CPU, which makes it the task of
`examples/train_grpo_tiny.sh`. Its reward gives partial credit (the fraction of positions right) so
that GRPO sees a signal before the first fully correct answer.

The supervised warm start's demonstrations (`mixed_direction`) are as mixed as real ones: the same
prompts, but most answers sorted the other way (descending). The warm-started model can sort both
ways and mostly picks descending; the rule reward asks for ascending, and RL has to find that out
(the way RLHF turns a model that can do what users want into one that does it). `preferences` makes
DPO pairs of the same prompts.
"""

import random
import re

DIGITS = re.compile(r"\d")


def records(n: int, seed: int, min_digits: int = 3, max_digits: int = 6) -> list[dict]:
    """`n` sort-digits problems drawn with `random.Random(seed)`: the same seed gives the same
    list."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_digits, max_digits))]
        out.append(
            {
                "prompt": "sort: " + " ".join(map(str, digits)) + " =",
                "answer": " " + " ".join(map(str, sorted(digits))),
            }
        )
    return out


def mixed_direction(records: list[dict], descending_fraction: float, seed: int) -> list[dict]:
    """Copies of sort-digits records whose answer is sorted descending with probability
    descending_fraction."""
    rng = random.Random(seed)
    return [
        dict(r, answer=" " + " ".join(sorted(r["answer"].split(), reverse=True)))
        if rng.random() < descending_fraction
        else dict(r)
        for r in records
    ]


def preferences(records: list[dict], seed: int) -> list[dict]:
    """Preference records {"prompt", "chosen", "rejected"} of sort-digits records, for DPO:
    chosen is the right (ascending) answer; rejected is, at random, the answer sorted descending
    or a near miss (the right answer with one neighbouring pair of different digits swapped).
    Records whose digits are all equal have no wrong order and are left out."""
    rng = random.Random(seed)
    pairs = []
    for r in records:
        digits = r["answer"].split()
        unequal = [i for i in range(len(digits) - 1) if digits[i] != digits[i + 1]]
        if not unequal:
            continue
        if rng.random() < 0.5:
            wrong = digits[::-1]
        else:
            i = rng.choice(unequal)
            wrong = [*digits[:i], digits[i + 1], digits[i], *digits[i + 2 :]]
        pairs.append(
            {"prompt": r["prompt"], "chosen": r["answer"], "rejected": " " + " ".join(wrong)}
        )
    return pairs


def reward(response: str, answer: str) -> float:
    """Fraction of answer positions the response gets right, in [0, 1]; 1.0 only for an exact match.

    Only digits count (spacing is free). A response of the wrong length is divided by the longer
    length, so padding with extra digits never helps.
    """
    got, want = DIGITS.findall(response), DIGITS.findall(answer)
    if not want:
        raise ValueError(f"answer {answer!r} has no digits")
    right = sum(g == w for g, w in zip(got, want))
    return right / max(len(got), len(want))
