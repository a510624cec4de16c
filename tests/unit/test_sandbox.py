"""The code sandbox (chatgen.sandbox): what a model's code may not do, each contained and reported as an
error observation, and nothing left running afterwards; with bubblewrap where this machine has it, and
the documented fallback.

    .venv/bin/python -m pytest tests/unit/test_sandbox.py
"""

import os
import uuid
from pathlib import Path

import pytest

from chatgen import sandbox
from chatgen.sandbox import Limits, run_python

MODES = ["fallback"] + (["bwrap"] if sandbox.isolation() == "bwrap" else [])
FAST = Limits(wall_s=6, cpu_s=4, memory_mb=256, processes=16, output_bytes=4096)


def still_running(marker: str) -> list:
    """Processes whose command line holds `marker` (the code's own text holds it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(pid))
    return found


def contained(code: str, mode: str, limits=FAST):
    """Run `code` (tagged with a marker); assert nothing of it is left running; its Result."""
    marker = f"chatgen-test-{uuid.uuid4().hex}"
    result = run_python(f"# {marker}\n{code}", limits, mode)
    assert still_running(marker) == [], "the sandbox left processes running"
    return result


@pytest.mark.parametrize("mode", MODES)
def test_plain_code_runs_and_can_write_its_scratch_directory(mode):
    result = contained("open('out.txt', 'w').write('x' * 3)\nprint(open('out.txt').read())", mode)
    assert result.ok and result.stdout == "xxx\n" and result.returncode == 0
    assert result.isolation == mode and result.observation() == "xxx\n"
    failing = contained("raise SystemExit('bad input')", mode)
    assert not failing.ok and failing.error == "exit status 1" and "bad input" in failing.stderr
    assert failing.observation().startswith("error: exit status 1")


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode):
    code = (
        "import socket\n"
        "s = socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
        "print('connected')"
    )
    result = contained(code, mode)
    assert not result.ok and "connected" not in result.stdout
    assert "OSError" in result.stderr or "unreachable" in result.stderr


@pytest.mark.parametrize("mode", MODES)
def test_no_write_outside_scratch(mode, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    result = contained(f"open({str(outside / 'x.txt')!r}, 'w').write('escaped')", mode)
    assert not result.ok and not (outside / "x.txt").exists()
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_contained(mode):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = contained(code, mode, Limits(wall_s=3, cpu_s=2, processes=16))
    assert not result.ok and result.error.startswith("killed")


@pytest.mark.parametrize("mode", MODES)
def test_a_memory_bomb_is_contained(mode):
    result = contained("x = bytearray(2 << 30)\nprint('allocated')", mode)
    assert not result.ok and "allocated" not in result.stdout and "MemoryError" in result.stderr


@pytest.mark.parametrize("mode", MODES)
def test_an_infinite_loop_is_killed_at_the_limit(mode):
    result = contained("while True:\n    pass", mode, Limits(wall_s=2, cpu_s=30))
    assert result.error == "killed at the wall-time limit (2 s)" and result.returncode is None
    assert 1.5 < result.seconds < 10
    cpu = contained("while True:\n    pass", mode, Limits(wall_s=20, cpu_s=1))
    assert cpu.error.startswith("killed by") and cpu.seconds < 15


@pytest.mark.parametrize("mode", MODES)
def test_an_output_flood_is_cut_and_killed(mode):
    result = contained("while True:\n    print('y' * 1000)", mode)
    assert result.error == "killed at the output limit (4096 bytes)"
    assert len(result.stdout) <= 4096
    assert len(result.observation(max_chars=500)) < 600


@pytest.mark.parametrize("mode", MODES)
def test_a_daemonized_child_is_killed_too(mode):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "print('parent done')"
    )
    if mode == "fallback":
        pytest.skip("the fallback does not stop a process that leaves the session (documented)")
    result = contained(code, mode)
    assert result.ok and result.stdout == "parent done\n"


def test_an_unknown_isolation_is_refused():
    with pytest.raises(ValueError, match="sandbox isolation 'docker'"):
        run_python("print(1)", mode="docker")


def test_code_exec_rewards_a_program_that_passes_its_tests():
    from chatgen.tasks import REWARDS

    tests = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
    right = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert REWARDS["code_exec"](right, tests) == 1.0
    assert REWARDS["code_exec"](wrong, tests) == 0.0
    assert REWARDS["code_exec"]("def add(a, b): return a + b", tests) == 1.0  # no fence: all of it
    assert REWARDS["code_exec"](hangs, "add(1, 2)") == 0.0  # killed at its CPU-time limit
