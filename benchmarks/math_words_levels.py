# .venv/bin/python benchmarks/math_words_levels.py --model DIR --output outputs/math_words_levels.json
"""How often a model solves chatgen.tasks.math_words problems of each difficulty, before any training: the
measurement that picks the math recipe's level (GRPO learns only where a group's samples disagree, so a level
the model solves 0% or 100% of the time teaches nothing).

For each --levels entry MIN-MAX (steps of a worked solution) it writes --problems held-out problems, and
`chatgen generate` answers all levels in one engine per mode, with the recipe's policy YAML
(configs/grpo_smollm2_math/policy.yaml: chat template, stop token): greedy, then --samples samples per problem
at --temperature. Each answer is scored by the recipe's `math_verify` reward. Printed and saved per level:
greedy accuracy, sampled accuracy (mean over samples), pass@samples, and the groups with both right and
wrong samples ("mixed": the groups GRPO learns from). Generation only: minutes on 2 CPU cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLICY_YAML = REPO / "configs" / "grpo_smollm2_math" / "policy.yaml"


def generate(model, prompts: Path, out: Path, temperature: float, n: int, args) -> list[dict]:
    """`chatgen generate` over the prompts file: one record per sample (index, sample, text)."""
    cmd = [
        *(sys.executable, "-m", "chatgen.cli", "generate", "--model", str(model)),
        *("--config", str(POLICY_YAML), "--input", str(prompts), "--output", str(out)),
        *("--temperature", str(temperature), "--n", str(n), "--seed", str(args.seed)),
        *("--max-new-tokens", str(args.max_new_tokens)),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "POLICY_LOAD": str(model)})
    return [json.loads(line) for line in out.read_text().splitlines()]


def score(rows: list[dict], problems: list[dict], level_of: list[str]) -> dict:
    """level -> accuracy, pass@n (any sample right) and mixed groups over its problems."""
    from chatgen.tasks.math_words import math_verify_reward

    right = math_verify_reward(
        [r["text"] for r in rows], [problems[r["index"]]["answer"] for r in rows]
    )
    per_problem: dict[int, list[float]] = {}
    for r, ok in zip(rows, right):
        per_problem.setdefault(r["index"], []).append(ok)
    out = {}
    for level in dict.fromkeys(level_of):
        means = [sum(v) / len(v) for i, v in per_problem.items() if level_of[i] == level]
        out[level] = {
            "accuracy": round(sum(means) / len(means), 4),
            "pass@n": round(sum(m > 0 for m in means) / len(means), 4),
            "mixed_groups": sum(0 < m < 1 for m in means),
            "problems": len(means),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory (e.g. outputs/smollm2)")
    parser.add_argument("--output", default="outputs/math_words_levels.json")
    parser.add_argument("--levels", default="1-1,1-2,2-4", help="MIN-MAX steps, comma-separated")
    parser.add_argument(
        "--max-operand", type=int, default=None, help="largest number in a question (default: none)"
    )
    parser.add_argument("--problems", type=int, default=32, help="held-out problems per level")
    parser.add_argument(
        "--samples", type=int, default=8, help="samples per problem at --temperature"
    )
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from chatgen.tasks import math_words

    problems, level_of = [], []
    for level in args.levels.split(","):
        low, _, high = level.partition("-")
        batch = math_words.records(
            args.problems,
            seed=1,
            min_steps=int(low),
            max_steps=int(high),
            max_operand=args.max_operand,
        )
        problems += batch
        level_of += [level] * len(batch)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="chatgen-math-levels-") as work:
        prompts = Path(work) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p["prompt"]}) + "\n" for p in problems))
        greedy = generate(args.model, prompts, Path(work) / "greedy.jsonl", 0.0, 1, args)
        sampled = generate(
            args.model, prompts, Path(work) / "sampled.jsonl", args.temperature, args.samples, args
        )
    result = {
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "greedy": score(greedy, problems, level_of),
        "sampled": score(sampled, problems, level_of),
        "seconds": round(time.time() - start, 1),
        "load_average": os.getloadavg(),
    }
    for level in dict.fromkeys(level_of):
        g, s = result["greedy"][level], result["sampled"][level]
        print(
            f"steps {level}: greedy {g['accuracy']:.3f} · T={args.temperature} accuracy "
            f"{s['accuracy']:.3f}, pass@{args.samples} {s['pass@n']:.3f}, mixed groups "
            f"{s['mixed_groups']}/{s['problems']}"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output} ({result['seconds']} s, load {result['load_average'][0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
