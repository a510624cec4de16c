"""python -m chatgen.tasks --output DIR [--task sort_digits|arithmetic|math_words]: write a
task's train/eval files (JSONL; math_words also parquet)."""

import argparse

from chatgen.tasks import TASKS, write_task_data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chatgen.tasks", description="write a task's train/eval JSONL files"
    )
    parser.add_argument("--output", required=True, help="directory for the JSONL files")
    parser.add_argument(
        "--task",
        default="sort_digits",
        choices=TASKS,
        help="sort_digits: also sft.jsonl and preference_{train,eval}.jsonl; arithmetic: chat "
        "questions; math_words: GSM8K-style word problems, .parquet and .jsonl",
    )
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-digits", type=int, default=3, help="sort_digits: shortest list")
    parser.add_argument("--max-digits", type=int, default=6, help="sort_digits: longest list")
    parser.add_argument(
        "--max-operand",
        type=int,
        default=None,
        help="arithmetic (default 20), math_words (default: no limit): largest number in a question",
    )
    parser.add_argument(
        "--min-steps", type=int, default=2, help="math_words: fewest steps of a solution (1-4)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=4, help="math_words: most steps of a solution (1-4)"
    )
    parser.add_argument(
        "--sft-descending-fraction",
        type=float,
        default=0.7,
        help="sort_digits: share of sft.jsonl answers sorted the other way",
    )
    args = vars(parser.parse_args(argv))
    print(write_task_data(args.pop("output"), **args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
