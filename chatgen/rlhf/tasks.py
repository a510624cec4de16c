"""Prompt datasets with rule-based rewards: the synthetic sort-digits and arithmetic tasks, and a final-number
(GSM8K-style) check.

    python -m chatgen.rlhf.tasks --output outputs/sort_digits   # train, eval, sft, preference_{train,eval}.jsonl
    python -m chatgen.rlhf.tasks --task arithmetic --output outputs/arithmetic   # train, eval.jsonl

A record is one JSON object per line: {"prompt": str, "answer": str}; the reward compares the model's
response text with "answer". Rewards are pure functions of text (no model, no torch), so they run anywhere:
inside the reward actor, in a unit test, or on a held-out set after training.

sort-digits: "sort: 3 1 4 1 5 =" -> " 1 1 3 4 5". A 2-layer model learns it in minutes on a CPU, which makes
it the task of `examples/train_grpo_tiny.sh`. Its reward gives partial credit (the fraction of positions
right) so that GRPO sees a signal before the first fully correct answer.

sft.jsonl holds demonstrations for the supervised warm start, as mixed as real ones: the same prompts, but
most answers sorted the other way (descending; `--sft-descending-fraction`, default 0.7). The warm-started
model can sort both ways and mostly picks descending; the rule reward asks for ascending, and RL has to
find that out (the way RLHF turns a model that can do what users want into one that does it).

arithmetic: "What is 13 + 8? Reply with only the result, as a number." -> "21" (sums and differences of numbers
up to `max_operand`, never negative), a question for a chat model: the policy renders it with its chat
template (`chat_template: true`). Scored by `final_number` (1.0 when the last number of the response is the
answer), so "13 + 8 = 21" counts as much as "21". The task of `examples/train_grpo_smollm2.sh`:
SmolLM2-135M-Instruct answers 38% of the held-out questions right before RL (greedy), mostly by getting
the arithmetic wrong ("13 - 6 = 1"); GRPO lifts that within a few episodes (docs/models.md).

preference_train.jsonl / preference_eval.jsonl hold the same train / held-out prompts as preference pairs for
DPO: {"prompt", "chosen": the ascending answer, "rejected": sorted descending or a near miss}.
"""
import argparse
import json
import random
import re
from pathlib import Path

from chatgen.core.jsonl import read_records

DIGITS = re.compile(r"\d")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def sort_digits_records(n: int, seed: int, min_digits: int = 3, max_digits: int = 6) -> list[dict]:
    """`n` sort-digits problems drawn with `random.Random(seed)`: the same seed gives the same list."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_digits, max_digits))]
        records.append({"prompt": "sort: " + " ".join(map(str, digits)) + " =",
                        "answer": " " + " ".join(map(str, sorted(digits)))})
    return records


def arithmetic_records(n: int, seed: int, max_operand: int = 20) -> list[dict]:
    """`n` problems "What is a + b?" / "What is a - b?" (a >= b) with 1 <= a, b <= max_operand, from `seed`."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if rng.random() < 0.5:
            question, result = f"{a} + {b}", a + b
        else:
            question, result = f"{max(a, b)} - {min(a, b)}", abs(a - b)
        records.append({"prompt": f"What is {question}? Reply with only the result, as a number.",
                        "answer": str(result)})
    return records


def held_out_split(make_records, n_train: int, n_eval: int, seed: int = 0, **kwargs) -> tuple[list, list]:
    """Train and held-out sets of a task (`make_records(n, seed, **kwargs)`, e.g. sort_digits_records) with no
    prompt in common: eval prompts are drawn first, train skips them (and may repeat a prompt)."""
    eval_records = make_records(n_eval, seed + 1, **kwargs)
    held_out = {r["prompt"] for r in eval_records}
    train, k = [], 0
    while len(train) < n_train:
        batch = make_records(n_train, seed * 1000 + k, **kwargs)
        train += [r for r in batch if r["prompt"] not in held_out][: n_train - len(train)]
        k += 1
    return train, eval_records


def mixed_direction(records: list[dict], descending_fraction: float, seed: int) -> list[dict]:
    """Copies of sort-digits records whose answer is sorted descending with probability descending_fraction."""
    rng = random.Random(seed)
    return [dict(r, answer=" " + " ".join(sorted(r["answer"].split(), reverse=True)))
            if rng.random() < descending_fraction else dict(r) for r in records]


def sort_digits_preferences(records: list[dict], seed: int) -> list[dict]:
    """Preference records {"prompt", "chosen", "rejected"} of sort-digits records, for DPO: chosen is the right
    (ascending) answer; rejected is, at random, the answer sorted descending or a near miss (the right answer
    with one neighbouring pair of different digits swapped). Records whose digits are all equal have no wrong
    order and are left out."""
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
            wrong = [*digits[:i], digits[i + 1], digits[i], *digits[i + 2:]]
        pairs.append({"prompt": r["prompt"], "chosen": r["answer"], "rejected": " " + " ".join(wrong)})
    return pairs


def sort_digits_reward(response: str, answer: str) -> float:
    """Fraction of answer positions the response gets right, in [0, 1]; 1.0 only for an exact match.

    Only digits count (spacing is free). A response of the wrong length is divided by the longer length,
    so padding with extra digits never helps.
    """
    got, want = DIGITS.findall(response), DIGITS.findall(answer)
    if not want:
        raise ValueError(f"answer {answer!r} has no digits")
    right = sum(g == w for g, w in zip(got, want))
    return right / max(len(got), len(want))


def final_number_reward(response: str, answer: str) -> float:
    """1.0 if the last number in the response equals the answer's last number (GSM8K "#### 42"), else 0.0."""
    got, want = NUMBER.findall(response), NUMBER.findall(answer)
    if not want:
        raise ValueError(f"answer {answer!r} has no number")
    if not got:
        return 0.0
    try:
        return float(float(got[-1].replace(",", "")) == float(want[-1].replace(",", "")))
    except ValueError:
        return 0.0


REWARDS = {"sort_digits": sort_digits_reward, "final_number": final_number_reward}


def get_reward_fn(name: str):
    """The rule named `name` (a key of REWARDS); a clear error lists the valid names."""
    if name not in REWARDS:
        raise ValueError(f"reward rule {name!r} is unknown; use one of {sorted(REWARDS)}")
    return REWARDS[name]


def read_jsonl(path) -> list[dict]:
    """Records of a JSONL prompt file; each line must have "prompt" (and "answer" for rule rewards)."""
    return read_records(path, lambda r: None if "prompt" in r else 'each line must be an object with a "prompt" key')


def write_jsonl(path, records) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="write a task's train/eval JSONL files")
    parser.add_argument("--output", required=True, help="directory for the JSONL files")
    parser.add_argument("--task", default="sort_digits", choices=["sort_digits", "arithmetic"],
                        help="sort_digits: also sft.jsonl and preference_{train,eval}.jsonl; arithmetic: chat questions")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-digits", type=int, default=3, help="sort_digits: shortest list")
    parser.add_argument("--max-digits", type=int, default=6, help="sort_digits: longest list")
    parser.add_argument("--max-operand", type=int, default=20, help="arithmetic: largest number in a question")
    parser.add_argument("--sft-descending-fraction", type=float, default=0.7,
                        help="sort_digits: share of sft.jsonl answers sorted the other way")
    args = parser.parse_args(argv)
    out = Path(args.output)
    if args.task == "arithmetic":
        train, held_out = held_out_split(arithmetic_records, args.n_train, args.n_eval, args.seed,
                                         max_operand=args.max_operand)
        write_jsonl(out / "train.jsonl", train)
        write_jsonl(out / "eval.jsonl", held_out)
        print(f"wrote {len(train)} train and {len(held_out)} eval arithmetic records to {out}")
        return 0
    train, held_out = held_out_split(sort_digits_records, args.n_train, args.n_eval, args.seed,
                                     min_digits=args.min_digits, max_digits=args.max_digits)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", held_out)
    write_jsonl(out / "sft.jsonl", mixed_direction(train, args.sft_descending_fraction, args.seed))
    write_jsonl(out / "preference_train.jsonl", sort_digits_preferences(train, args.seed))
    write_jsonl(out / "preference_eval.jsonl", sort_digits_preferences(held_out, args.seed + 1))
    print(f"wrote {len(train)} train (+ sft.jsonl, preference_train.jsonl) and {len(held_out)} eval (+ "
          f"preference_eval.jsonl) sort-digits records to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
