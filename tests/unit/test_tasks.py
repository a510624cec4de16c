"""Unit tests for chatgen.tasks (pytest tests/unit/test_tasks.py)."""

import json

import pytest

from chatgen import tasks
from chatgen.core.jsonl import read_prompt_records, write_records


def test_sort_digits_records_are_deterministic_and_correct():
    a = tasks.sort_digits.records(50, seed=7)
    assert a == tasks.sort_digits.records(50, seed=7)
    assert a != tasks.sort_digits.records(50, seed=8)
    for r in a:
        digits = r["prompt"].removeprefix("sort: ").removesuffix(" =").split()
        assert 3 <= len(digits) <= 6
        assert r["answer"].split() == sorted(digits)
        assert tasks.sort_digits.reward(r["answer"], r["answer"]) == 1.0


def test_split_has_no_overlap_and_exact_sizes():
    train, held_out = tasks.held_out_split(tasks.sort_digits.records, 3000, 200, seed=0)
    assert len(train) == 3000 and len(held_out) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert tasks.held_out_split(tasks.sort_digits.records, 3000, 200, seed=0) == (train, held_out)


def test_arithmetic_records_are_right_and_held_out():
    import re

    train, held_out = tasks.held_out_split(
        tasks.arithmetic.records, 2000, 100, seed=0, max_operand=20
    )
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    ops = set()
    for r in train + held_out:
        a, op, b = re.fullmatch(
            r"What is (\d+) ([+-]) (\d+)\? Reply with only the result, as a number\.", r["prompt"]
        ).groups()
        assert 1 <= int(a) <= 20 and 1 <= int(b) <= 20 and int(r["answer"]) >= 0
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert (
            tasks.arithmetic.final_number_reward(f"{a} {op} {b} = {r['answer']}", r["answer"])
            == 1.0
        )
        ops.add(op)
    assert ops == {"+", "-"}
    assert tasks.arithmetic.records(50, seed=3) == tasks.arithmetic.records(50, seed=3)


@pytest.mark.parametrize(
    "response, expected",
    [
        (" 1 1 3 4 5", 1.0),
        ("1 1 3 4 5", 1.0),  # spacing is free
        ("11345", 1.0),
        (" 1 1 3 4 9", 4 / 5),  # one wrong position
        (" 1 1 3", 3 / 5),  # too short
        (" 1 1 3 4 5 5", 5 / 6),  # too long: extra digits never help
        (" 5 4 3 1 1", 1 / 5),  # reversed: only the middle matches
        ("no digits", 0.0),
        ("", 0.0),
    ],
)
def test_sort_digits_reward(response, expected):
    assert tasks.sort_digits.reward(response, " 1 1 3 4 5") == pytest.approx(expected)


def test_sort_digits_reward_range_and_exact_match_only_for_correct():
    import random

    rng = random.Random(0)
    for r in tasks.sort_digits.records(200, seed=3):
        guess = " ".join(str(rng.randrange(10)) for _ in range(rng.randint(0, 8)))
        value = tasks.sort_digits.reward(guess, r["answer"])
        assert 0.0 <= value <= 1.0
        assert (value == 1.0) == (guess.split() == r["answer"].split())


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the total is 42", "#### 42", 1.0),
        ("3 + 4 = 7, then 1,200 apples", "#### 1200", 1.0),
        ("it is 41", "#### 42", 0.0),
        ("I don't know", "#### 42", 0.0),
        ("half: 0.5", "0.50", 1.0),
    ],
)
def test_final_number_reward(response, answer, expected):
    assert tasks.arithmetic.final_number_reward(response, answer) == expected


def test_get_reward_fn_names_valid_rules():
    assert tasks.get_reward_fn("sort_digits") is tasks.sort_digits.reward
    with pytest.raises(ValueError, match="final_number"):
        tasks.get_reward_fn("sort")


def test_jsonl_roundtrip_and_errors(tmp_path):
    records = tasks.sort_digits.records(5, seed=1)
    write_records(tmp_path / "d" / "x.jsonl", records)
    assert read_prompt_records(tmp_path / "d" / "x.jsonl") == records
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompt_records(bad)
    bad.write_text(json.dumps({"question": "a"}) + "\n")
    with pytest.raises(ValueError, match='"prompt"'):
        read_prompt_records(bad)


def test_mixed_direction():
    records = tasks.sort_digits.records(2000, seed=4)
    mixed = tasks.sort_digits.mixed_direction(records, 0.7, seed=0)
    assert [r["prompt"] for r in mixed] == [r["prompt"] for r in records]
    flipped = [m["answer"] != r["answer"] for m, r in zip(mixed, records)]
    # 0.7 minus the answers that read the same both ways
    assert 0.6 < sum(flipped) / len(flipped) < 0.75
    for m, r in zip(mixed, records):
        digits = r["answer"].split()
        assert m["answer"].split() in (digits, digits[::-1])  # ascending or descending, same digits
    assert all(
        m == r for m, r in zip(tasks.sort_digits.mixed_direction(records, 0.0, seed=0), records)
    )


def test_cli_writes_files(tmp_path):
    from chatgen.tasks.__main__ import main

    assert main(["--output", str(tmp_path), "--n-train", "40", "--n-eval", "8"]) == 0
    assert len(read_prompt_records(tmp_path / "train.jsonl")) == 40
    assert len(read_prompt_records(tmp_path / "eval.jsonl")) == 8
    sft = read_prompt_records(tmp_path / "sft.jsonl")
    assert [r["prompt"] for r in sft] == [
        r["prompt"] for r in read_prompt_records(tmp_path / "train.jsonl")
    ]


def test_cli_writes_math_words_of_the_asked_difficulty(tmp_path):
    from chatgen.tasks.__main__ import main

    argv = ["--task", "math_words", "--output", str(tmp_path), "--n-train", "40", "--n-eval", "8"]
    assert main([*argv, "--min-steps", "1", "--max-steps", "1"]) == 0
    for name in ("train", "eval"):
        rows = read_prompt_records(tmp_path / f"{name}.jsonl")
        assert len(rows) == {"train": 40, "eval": 8}[name]
        assert all(r["answer"].count("=") == 1 for r in rows)  # one worked step each
