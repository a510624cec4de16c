"""Toy prompt datasets with rule-based rewards: the tasks the examples, tests and benchmarks train
on.

    python -m chatgen.tasks --output outputs/sort_digits                      # train, eval, sft, preference_*.jsonl
    python -m chatgen.tasks --task arithmetic --output outputs/arithmetic     # train, eval.jsonl

A record is one JSON object per line: {"prompt": str, "answer": str}; the reward compares the
model's response text with "answer". Rewards are pure functions of text (no model, no torch), so
they run anywhere: inside the reward actor, in a unit test, or on a held-out set after training. One
file per task: sort_digits.py (the tiny examples' task, with its SFT and DPO data), arithmetic.py
(chat questions for an instruct model), math_words.py (GSM8K-style word problems, also written as
parquet, and the math-verify rewards), code_exec.py (a program run with tests in chatgen.sandbox).
REWARDS names the rules a `chatgen.rlhf.rewards:RuleReward` can use.
"""

from pathlib import Path

from chatgen.core.jsonl import write_records
from chatgen.tasks import arithmetic, code_exec, math_words, sort_digits

REWARDS = {
    "sort_digits": sort_digits.reward,
    "final_number": arithmetic.final_number_reward,
    "code_exec": code_exec.reward,  # the response's program + the answer's tests, in the sandbox
}
TASKS = ("sort_digits", "arithmetic", "math_words")


def get_reward_fn(name: str):
    """The rule named `name` (a key of REWARDS); a clear error lists the valid names."""
    if name not in REWARDS:
        raise ValueError(f"reward rule {name!r} is unknown; use one of {sorted(REWARDS)}")
    return REWARDS[name]


def write_parquet(path: Path, rows: list[dict]) -> None:
    """`rows` as a parquet file (pyarrow, which the `datasets` library brings), written
    atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def held_out_split(
    make_records, n_train: int, n_eval: int, seed: int = 0, **kwargs
) -> tuple[list, list]:
    """Train and held-out sets of a task (`make_records(n, seed, **kwargs)`, e.g.
    sort_digits.records) with no prompt in common: eval prompts are drawn first, train skips them
    (and may repeat a prompt)."""
    eval_records = make_records(n_eval, seed + 1, **kwargs)
    held_out = {r["prompt"] for r in eval_records}
    train, k = [], 0
    while len(train) < n_train:
        batch = make_records(n_train, seed * 1000 + k, **kwargs)
        train += [r for r in batch if r["prompt"] not in held_out][: n_train - len(train)]
        k += 1
    return train, eval_records


def write_task_data(
    output,
    task: str = "sort_digits",
    n_train: int = 20000,
    n_eval: int = 256,
    seed: int = 0,
    min_digits: int = 3,
    max_digits: int = 6,
    max_operand: int | None = None,
    sft_descending_fraction: float = 0.7,
    min_steps: int = 2,
    max_steps: int = 4,
) -> str:
    """Write a task's JSONL files into the directory `output`; returns a one-line summary.

    sort_digits: train.jsonl, eval.jsonl, sft.jsonl (the warm start's demonstrations,
    sft_descending_fraction of them sorted the other way) and preference_{train,eval}.jsonl (DPO
    pairs of the same prompts); arithmetic: train.jsonl and eval.jsonl; math_words: train and
    eval as .parquet and .jsonl (the same records), problems whose worked solution takes
    min_steps to max_steps steps and whose question's numbers are at most max_operand (the
    difficulty). max_operand: the arithmetic task's default is 20, math_words' none."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is unknown; use one of {', '.join(TASKS)}")
    out = Path(output)
    if task == "math_words":
        train, held_out = held_out_split(
            math_words.records,
            n_train,
            n_eval,
            seed,
            min_steps=min_steps,
            max_steps=max_steps,
            max_operand=max_operand,
        )
        for name, rows in (("train", train), ("eval", held_out)):
            write_records(out / f"{name}.jsonl", rows)
            write_parquet(out / f"{name}.parquet", rows)
        return f"wrote {len(train)} train and {len(held_out)} eval math word problems to {out} (.parquet, .jsonl)"
    if task == "arithmetic":
        train, held_out = held_out_split(
            arithmetic.records,
            n_train,
            n_eval,
            seed,
            max_operand=20 if max_operand is None else max_operand,
        )
        write_records(out / "train.jsonl", train)
        write_records(out / "eval.jsonl", held_out)
        return f"wrote {len(train)} train and {len(held_out)} eval arithmetic records to {out}"
    train, held_out = held_out_split(
        sort_digits.records, n_train, n_eval, seed, min_digits=min_digits, max_digits=max_digits
    )
    write_records(out / "train.jsonl", train)
    write_records(out / "eval.jsonl", held_out)
    write_records(
        out / "sft.jsonl", sort_digits.mixed_direction(train, sft_descending_fraction, seed)
    )
    write_records(out / "preference_train.jsonl", sort_digits.preferences(train, seed))
    write_records(out / "preference_eval.jsonl", sort_digits.preferences(held_out, seed + 1))
    return (
        f"wrote {len(train)} train (+ sft.jsonl, preference_train.jsonl) and {len(held_out)} eval (+ "
        f"preference_eval.jsonl) sort-digits records to {out}"
    )
