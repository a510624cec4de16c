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
