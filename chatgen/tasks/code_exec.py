"""The `code_exec` reward: run the program a response wrote with the record's tests, in the sandbox.

    REWARDS["code_exec"](response, answer)   # answer: test code, e.g. "assert add(1, 2) == 3"

The program is the response's last ```python fenced block (the whole response when it has none);
the answer's test code runs after it, in one `chatgen.sandbox.run_python` call (no network, a
read-only filesystem but a scratch directory, time, memory, process and output limits). 1.0 when it
exits 0, else 0.0: a program that fails, hangs or floods its output scores 0, the run goes on.
"""

import re

from chatgen.sandbox import Limits, run_python

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512, processes=16, output_bytes=16 << 10)


def program(response: str) -> str:
    """The code of a response: its last fenced block, else all of it."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def reward(response: str, answer: str) -> float:
    """1.0 if the response's program followed by the answer's tests exits 0 in the sandbox."""
    return float(run_python(f"{program(response)}\n\n{answer}\n", LIMITS).ok)
