"""Math word problems in GSM8K's format, generated, and the math-verify rewards that score answers
to them.

    python -m chatgen.tasks --task math_words --output outputs/math_words   # train/eval .parquet and .jsonl

A record: {"prompt": "Mia has 12 boxes of 6 pencils. She gives away 15 pencils ... How many ...?
<instruction>", "answer": "12 * 6 = 72 pencils. 72 - 15 = 57. ... #### 57"}: two to four steps of
sums, differences, products and quotients over small whole numbers, the worked solution, and GSM8K's
"#### <number>" line.

Rewards (TRL's shape, `f(completions, answer, **columns) -> list[float]`; `function: math_verify` in
a chatgen.rlhf.rewards:Rewards term):
- `math_verify_reward`: 1.0 when the completion's final answer (`final_answer`: a "#### 42" line,
  else a `\\boxed{}`, else its last number) equals the reference's, as the `math-verify` library
  judges it (LaTeX, fractions: 0.5 == 1/2 == \\frac{1}{2}), else 0.0;
- `math_format_reward`: 1.0 when the completion ends with a final answer in a form the check reads
  (`\\boxed{...}` or a "#### ..." line), else 0.0, to weight in while a model learns the format.
"""

import random
import re
import threading

from chatgen.core.imports import require

INSTRUCTION = "Solve it step by step, then give the final answer on its own line as: #### <number>"
FINAL = re.compile(r"####\s*([^\n]+)")
BOXED = re.compile(r"\\boxed\s*\{")


def _pencils(rng):
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 20)
    name = rng.choice(["Mia", "Leo", "Ava", "Sam", "Noah", "Zoe"])
    total = a * b
    c = min(c, total - 1)
    return (
        f"{name} has {a} boxes of {b} pencils. {name} gives away {c} pencils. How many pencils does {name} "
        f"have left?",
        [f"{a} * {b} = {total} pencils.", f"{total} - {c} = {total - c}."],
        total - c,
    )


def _shop(rng):
    n, price, m, price2, paid = (
        rng.randint(2, 6),
        rng.randint(2, 9),
        rng.randint(1, 5),
        rng.randint(3, 12),
        0,
    )
    cost = n * price + m * price2
    paid = cost + rng.randint(0, 20)
    return (
        f"A notebook costs ${price} and a pen costs ${price2}. Jo buys {n} notebooks and {m} pens and pays "
        f"with ${paid}. How much change does Jo get, in dollars?",
        [
            f"{n} * {price} = {n * price}.",
            f"{m} * {price2} = {m * price2}.",
            f"{n * price} + {m * price2} = {cost}.",
            f"{paid} - {cost} = {paid - cost}.",
        ],
        paid - cost,
    )


def _share(rng):
    people, each, extra = rng.randint(2, 8), rng.randint(2, 10), rng.randint(1, 15)
    total = people * each + extra
    return (
        f"A baker makes {total} cookies. She keeps {extra} and shares the rest equally among {people} friends. "
        f"How many cookies does each friend get?",
        [f"{total} - {extra} = {total - extra}.", f"{total - extra} / {people} = {each}."],
        each,
    )


def _trip(rng):
    speed, hours = rng.randint(20, 60), rng.randint(2, 5)
    back = rng.randint(1, hours - 1)
    there = speed * hours
    return (
        f"A bus drives at {speed} miles per hour for {hours} hours, then drives {back} hours back toward the "
        f"start at the same speed. How many miles from the start is it?",
        [
            f"{speed} * {hours} = {there}.",
            f"{speed} * {back} = {speed * back}.",
            f"{there} - {speed * back} = {there - speed * back}.",
        ],
        there - speed * back,
    )


def _garden(rng):
    rows, per_row, eaten, weeks = (
        rng.randint(2, 9),
        rng.randint(3, 12),
        rng.randint(1, 10),
        rng.randint(2, 4),
    )
    grown = rows * per_row
    eaten = min(eaten, grown - 1)
    return (
        f"Each week a garden grows {rows} rows of {per_row} carrots, and rabbits eat {eaten} of them. How many "
        f"carrots are left after {weeks} weeks?",
        [
            f"{rows} * {per_row} = {grown}.",
            f"{grown} - {eaten} = {grown - eaten}.",
            f"{grown - eaten} * {weeks} = {(grown - eaten) * weeks}.",
        ],
        (grown - eaten) * weeks,
    )


def _more(rng):
    have, got = rng.randint(3, 30), rng.randint(2, 20)
    name, thing = rng.choice(NAMES), rng.choice(["stickers", "marbles", "stamps", "shells"])
    return (
        f"{name} has {have} {thing}. {name} finds {got} more. How many {thing} does {name} have now?",
        [f"{have} + {got} = {have + got}."],
        have + got,
    )


def _eaten(rng):
    had, ate = rng.randint(10, 40), rng.randint(2, 9)
    return (
        f"There are {had} apples in a basket. The children eat {ate} of them. How many apples are left?",
        [f"{had} - {ate} = {had - ate}."],
        had - ate,
    )


def _bags(rng):
    bags, each = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"A farmer fills {bags} bags with {each} potatoes each. How many potatoes are in the bags?",
        [f"{bags} * {each} = {bags * each}."],
        bags * each,
    )


def _spent(rng):
    start, spent, earned = rng.randint(20, 50), rng.randint(2, 15), rng.randint(2, 15)
    name = rng.choice(NAMES)
    return (
        f"{name} has ${start}. {name} spends ${spent} on lunch and then earns ${earned} walking a dog. How "
        f"many dollars does {name} have now?",
        [
            f"{start} - {spent} = {start - spent}.",
            f"{start - spent} + {earned} = {start - spent + earned}.",
        ],
        start - spent + earned,
    )


NAMES = ["Mia", "Leo", "Ava", "Sam", "Noah", "Zoe"]
# the steps of each problem's worked solution: `min_steps`/`max_steps` of `records` pick the
# difficulty
PROBLEMS = {
    _more: 1,
    _eaten: 1,
    _bags: 1,
    _pencils: 2,
    _share: 2,
    _spent: 2,
    _trip: 3,
    _garden: 3,
    _shop: 4,
}


def records(
    n: int, seed: int, min_steps: int = 2, max_steps: int = 4, max_operand: int | None = None
) -> list[dict]:
    """`n` word problems from `seed`: {"prompt": question + INSTRUCTION, "answer": worked steps +
    "#### N"}, each of a problem kind whose solution takes `min_steps` to `max_steps` steps
    (PROBLEMS: 1 to 4) and, with `max_operand`, whose question has no number above it (redrawn
    until so)."""
    kinds = [make for make, steps in PROBLEMS.items() if min_steps <= steps <= max_steps]
    if not kinds:
        raise ValueError(
            f"no math_words problem takes {min_steps} to {max_steps} steps (min_steps/max_steps, "
            f"--min-steps/--max-steps); the kinds take {min(PROBLEMS.values())} to "
            f"{max(PROBLEMS.values())}"
        )
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        for _ in range(10_000):
            question, steps, result = rng.choice(kinds)(rng)
            if max_operand is None or max(map(int, re.findall(r"\d+", question))) <= max_operand:
                break
        else:
            raise ValueError(
                f"math_words: no problem of {min_steps}-{max_steps} steps keeps its numbers within "
                f"max_operand={max_operand} (--max-operand): raise it"
            )
        out.append(
            {"prompt": f"{question}\n{INSTRUCTION}", "answer": " ".join(steps) + f"\n#### {result}"}
        )
    return out


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
LATEX = re.compile(r"\$|\\\(|\\\[|\\frac")


def final_answer(text: str) -> str:
    """The part of `text` holding its final answer: after the last "####"; else the whole text
    when it has LaTeX (a \\boxed{}, $...$: math-verify reads those); else its last number, as
    GSM8K's graders read a worked answer ("... so she has 57 left.")."""
    found = FINAL.findall(text)
    if found:
        return found[-1].strip()
    if BOXED.search(text) or LATEX.search(text):
        return text
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else text


def _parse(text: str):
    from math_verify import parse

    # math-verify bounds its parsing with SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer = final_answer(text)
    return parse(
        answer if "\\" in answer or "$" in answer else f"${answer}$", parsing_timeout=timeout
    ) or parse(answer, parsing_timeout=timeout)


def math_verify_reward(completions: list, answer: list, **_) -> list[float]:
    """1.0 per completion whose final answer math-verify finds equal to its reference's, else
    0.0."""
    require("math_verify", "the math_verify reward")
    from math_verify import verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for completion, reference in zip(completions, answer):
        gold, got = _parse(str(reference)), _parse(completion)
        out.append(float(bool(gold and got and verify(gold, got, timeout_seconds=timeout))))
    return out


def math_format_reward(completions: list, **_) -> list[float]:
    """1.0 per completion that states a final answer as "#### ..." or \\boxed{...}, else 0.0."""
    return [float(bool(FINAL.search(c) or BOXED.search(c))) for c in completions]
