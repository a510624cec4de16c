"""The built-in `tool_math` environment: chat arithmetic with a `python` tool run in
chatgen.sandbox.

    runtime.algorithm: {environment: tool_math, tool_call_parser: hermes}   # the policy's call format

Records are the arithmetic task's ({"prompt": question, "answer": "#### 42"}: `python -m
chatgen.tasks --task arithmetic`). The model may call `python` (its parsed `tool_calls`); each
call's output comes back as a tool message; the first reply without a call is the answer, scored by
the final_number rule (1.0 when its last number is the answer's). Tool calls earn nothing by
themselves.

    python -m chatgen.environments.tool_math --demonstrations-for MODEL_DIR --data DIR

writes DIR/sft.jsonl: first turns of DIR/train.jsonl's questions rendered with MODEL_DIR's chat
template and answered with a hermes tool call (`<tool_call>{"name": "python", ...}</tool_call>`),
the warm start examples/train_tool_math_smollm2.sh gives SmolLM2-135M-Instruct, which writes no
call from its template alone. What follows the tool's answer is left for RL (not learned in the
measured run: docs/agents.md).
"""

import argparse
import json
import re
from pathlib import Path

from chatgen.core.jsonl import write_records
from chatgen.environments.base import Environment, Step
from chatgen.environments.tools import PYTHON_TOOL, run_tool_calls
from chatgen.tasks import REWARDS

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


def demonstrations(model_dir: Path, data_dir: Path, n: int = 2000, system: str = SYSTEM) -> str:
    """sft.jsonl in data_dir: the first turn of n train questions in the model's chat template
    (the environment's system turn and the question), answered with a python tool call that
    prints the arithmetic."""
    from transformers import AutoTokenizer

    tokenizer, rows = AutoTokenizer.from_pretrained(model_dir), []
    for line in (data_dir / "train.jsonl").read_text().splitlines()[:n]:
        record = json.loads(line)
        a, op, b = QUESTION.search(record["prompt"]).groups()
        chat = [
            {"role": "system", "content": system},
            {"role": "user", "content": record["prompt"]},
        ]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        rows.append({"prompt": prompt, "answer": tool_call_text(f"print({a} {op} {b})")})
    write_records(data_dir / "sft.jsonl", rows)
    return f"wrote {len(rows)} tool-call demonstrations to {data_dir / 'sft.jsonl'}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demonstrations-for", type=Path, required=True, metavar="MODEL_DIR")
    parser.add_argument("--data", type=Path, required=True, metavar="DIR", help="has train.jsonl")
    args = parser.parse_args()
    print(demonstrations(args.demonstrations_for, args.data))
