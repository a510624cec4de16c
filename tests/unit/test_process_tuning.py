"""Engines apart get cores of their own (chatgen.core.process_tuning.own_cores, pin_process)."""

import os
import subprocess
import sys
from pathlib import Path

from chatgen.core.process_tuning import own_cores

REPO = Path(__file__).resolve().parents[2]


def test_each_engine_takes_its_own_cores_in_order_or_floats_when_they_run_out():
    allowed = {3, 0, 5, 1}
    assert [own_cores(first, 1, allowed) for first in range(4)] == [{0}, {1}, {3}, {5}]
    assert own_cores(1, 2, allowed) == {1, 3}
    assert own_cores(4, 1, allowed) is None  # a fifth engine on four cores floats
    assert own_cores(3, 2, allowed) is None


def test_pinning_reaches_the_threads_already_running_and_those_started_later():
    core = min(os.sched_getaffinity(0))
    script = f"""
import os, threading
ready, done = threading.Event(), threading.Event()
early = threading.Thread(target=lambda: (ready.set(), done.wait()))
early.start(); ready.wait()
from chatgen.core.process_tuning import pin_process
pin_process({{{core}}})
late = threading.Thread(target=done.wait)
late.start()
masks = {{tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}}
done.set()
print(len(masks), sorted(set(map(frozenset, masks.values())), key=sorted))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
        check=True,
    ).stdout.split(" ", 1)
    assert int(out[0]) >= 3  # the main thread, the early and the late one
    assert out[1].strip() == f"[frozenset({{{core}}})]"


def test_exit_without_teardown_flushes_a_file_left_open_and_skips_the_heap_walk_without_one(
    tmp_path,
):
    script = """
import sys
from chatgen.core.process_tuning import exit_without_teardown, open_written_files
before = open_written_files()
if sys.argv[1] != "-":
    log = open(sys.argv[1], "w")  # never closed: its buffered line is lost unless flushed
    log.write("last line\\n")
print(before, open_written_files(), end="")  # buffered stdout: flushed too
exit_without_teardown(0)
"""
    for target in ("-", str(tmp_path / "log.txt")):
        done = subprocess.run(
            [sys.executable, "-c", script, target],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        if target == "-":
            assert done.stdout == "False False"
        else:
            assert done.stdout == "False True"
            assert (tmp_path / "log.txt").read_text() == "last line\n"
