"""The built-in `tool_math` environment: chat arithmetic with a `python` tool run in
chatgen.sandbox.

    runtime.algorithm: {environment: tool_math, tool_call_parser: hermes}   # the policy's call format

Records are the arithmetic task's ({"prompt": question, "answer": "#### 42"}: `python -m
chatgen.tasks --task arithmetic`). The model may call `python` (its parsed `tool_calls`); each
call's output comes back as a tool message; the first reply without a call is the answer, scored by
the final_number rule (1.0 when its last number is the answer's). Tool calls earn nothing by
themselves.

    python -m chatgen.environments.tool_math --demonstrations-for MODEL_DIR --data DIR

writes DIR/tool_math_sft.jsonl: whole episodes of DIR/train.jsonl's questions in MODEL_DIR's chat
template, one row per model turn. 18.5% (--call-fraction) go through the tool: the first turn a
hermes call that prints the arithmetic (`<tool_call>{"name": "python", ...}</tool_call>`), the
second, after the tool's output, the number; the rest answer the number directly
(demonstration_rows). A short SFT on them (examples/train_tool_math_smollm2.sh) is the warm start of
SmolLM2-135M-Instruct, which writes no call from its template alone.
"""

import argparse
import json
import random
import re
from pathlib import Path

from chatgen.core.jsonl import write_records
from chatgen.environments.base import Environment, Step
from chatgen.environments.tools import PYTHON_TOOL, run_tool_calls
from chatgen.tasks import REWARDS

SFT_FILE = "tool_math_sft.jsonl"  # beside train.jsonl, which other recipes share
# After the recipe's 12 SFT steps P(call) is a cliff in this (0.175: 0.04, 0.185: 0.08, 0.19: 0.37;
# docs/agents.md): here sampled first turns call in ~8% and greedy never, so RL has both paths
CALL_FRACTION = 0.185
SYSTEM = "Answer the question. You may call the python tool to compute; end with the final number."


class ToolMathEnv(Environment):
    tools = [PYTHON_TOOL.schema]

    def __init__(self, system: str = SYSTEM):
        self.system = system

    def reset(self, record: dict) -> list:
        self.answer, self.calls = record["answer"], 0
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": record["prompt"]},
        ]

    def step(self, message: dict) -> Step:
        if message.get("tool_calls"):
            self.calls += len(message["tool_calls"])
            return Step(messages=run_tool_calls({"python": PYTHON_TOOL}, message))
        reward = REWARDS["final_number"](message.get("content") or "", self.answer)
        return Step(reward=reward, done=True, metrics={"tool_calls": float(self.calls)})


QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def tool_call_text(code: str) -> str:
    """A hermes-format call of the python tool (what vLLM's hermes parser reads)."""
    call = {"name": "python", "arguments": {"code": code}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def demonstration_rows(record: dict, render, system: str = SYSTEM, call: bool = True) -> list:
    """SFT rows ({"prompt", "answer"}) for the whole episode of one arithmetic record, a row per
    model turn. With `call`: the first turn answered by a python call printing the arithmetic, the
    second (after the tool's output, "27\n" as the sandbox prints it) by the number; the output lies
    in the second row's prompt, so the SFT loss never trains on it. Without: one turn, the number
    (the model's own arithmetic). `render(messages)`: the chat in the model's template with the
    generation prompt."""
    a, op, b = QUESTION.search(record["prompt"]).groups()
    result = str(int(a) + int(b) if op == "+" else int(a) - int(b))
    chat = [{"role": "system", "content": system}, {"role": "user", "content": record["prompt"]}]
    if not call:
        return [{"prompt": render(chat), "answer": result}]
    code = tool_call_text(f"print({a} {op} {b})")
    observed = chat + [
        {"role": "assistant", "content": code},
        {"role": "tool", "name": "python", "content": result + "\n"},
    ]
    return [
        {"prompt": render(chat), "answer": code},
        {"prompt": render(observed), "answer": result},
    ]


def demonstrations(
    model_dir: Path,
    data_dir: Path,
    n: int = 2000,
    system: str = SYSTEM,
    call_fraction=CALL_FRACTION,
) -> str:
    """SFT_FILE in data_dir: n train questions' episodes in the model's chat template
    (demonstration_rows), a call_fraction of them through the tool, the rest answered directly
    (CALL_FRACTION: where greedy does not call yet; from 0.19 on it always does and the warm start
    already solves the held-out set)."""
    from transformers import AutoTokenizer

    tokenizer, rows, calls, episodes = AutoTokenizer.from_pretrained(model_dir), [], 0, 0
    rng = random.Random(0)

    def render(chat):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    for line in (data_dir / "train.jsonl").read_text().splitlines()[:n]:
        call = rng.random() < call_fraction
        calls, episodes = calls + call, episodes + 1
        rows += demonstration_rows(json.loads(line), render, system, call)
    write_records(data_dir / SFT_FILE, rows)
    through = f"{calls} of {episodes} episodes through the tool"
    return f"wrote {len(rows)} demonstration turns ({through}) to {data_dir / SFT_FILE}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demonstrations-for", type=Path, required=True, metavar="MODEL_DIR")
    parser.add_argument("--data", type=Path, required=True, metavar="DIR", help="has train.jsonl")
    parser.add_argument(
        "--call-fraction",
        type=float,
        default=CALL_FRACTION,
        help="episodes demonstrated through the tool",
    )
    args = parser.parse_args()
    if not 0 <= args.call_fraction <= 1:
        parser.error(f"--call-fraction {args.call_fraction} is not a fraction: give 0 to 1")
    print(demonstrations(args.demonstrations_for, args.data, call_fraction=args.call_fraction))
