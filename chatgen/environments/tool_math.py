"""The built-in `tool_math` environment: chat arithmetic with a `python` tool run in
chatgen.sandbox.

    runtime.algorithm: {environment: tool_math, tool_call_parser: hermes}   # the policy's call format

Records are the arithmetic task's ({"prompt": question, "answer": "#### 42"}: `python -m
chatgen.tasks --task arithmetic`). The model may call `python` (its parsed `tool_calls`); each
call's output comes back as a tool message; the first reply without a call is the answer, scored by
the final_number rule (1.0 when its last number is the answer's). Tool calls earn nothing by
themselves.
"""

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
