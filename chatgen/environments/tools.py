"""Tools an environment offers the model, called with the arguments of its parsed `tool_calls`.

    PYTHON_TOOL.schema                      # {"type": "function", "function": {"name": "python", ...}}
    run_tool_calls({"python": PYTHON_TOOL}, message)   # -> the tool messages answering its calls

A model's bad call (an unknown tool, arguments that are not JSON or do not fit) is answered with an
error observation, as a failing tool is: the model reads it and may try again.
"""

import dataclasses
import json

from chatgen.sandbox import Limits, run_python


@dataclasses.dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments
    fn: object  # fn(**arguments) -> str, the observation

    @property
    def schema(self) -> dict:
        """The OpenAI tool schema (chat requests' `tools`)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


PYTHON_LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512, processes=16, output_bytes=16 << 10)


def python(code: str) -> str:
    """The `python` tool: `code` run in chatgen.sandbox; its output, or the error and its output."""
    return run_python(code, PYTHON_LIMITS).observation()


PYTHON_TOOL = Tool(
    "python",
    "Run a Python program in a sandbox (no network, no files but its own) and return what it printed.",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print the result"}},
        "required": ["code"],
    },
    python,
)


def run_tool_calls(tools: dict, message: dict) -> list:
    """The tool messages answering each of `message`'s `tool_calls` (in order)."""
    answers = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        name = function.get("name")
        answers.append(
            {
                "role": "tool",
                "tool_call_id": call.get("id"),
                "name": name,
                "content": _call(tools, name, function.get("arguments")),
            }
        )
    return answers


def _call(tools: dict, name, arguments) -> str:
    if name not in tools:
        return f"error: there is no tool {name!r}; the tools are {', '.join(sorted(tools))}"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
    except ValueError as e:
        return f"error: the arguments are not JSON ({e})"
    if not isinstance(args, dict):
        return "error: the arguments must be a JSON object"
    try:
        return str(tools[name].fn(**args))
    except TypeError as e:  # arguments that do not fit the tool
        return f"error: {e}"
