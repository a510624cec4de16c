"""Fixtures shared by the integration tests of runs: a local Ray for a module's runs, the tiny
task's data.

    python -m pytest tests/integration/test_rlhf_runs.py
"""

import os
from pathlib import Path

import pytest
from helpers import TASK_N_EVAL


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray for the session's runs, started as a run starts it (loopback only; None: Ray was
    already up), its workers importing from tests/integration (the tests' own model classes) and
    tests/ (helpers.py, which those test modules import). One for all: each start costs seconds
    of Ray's processes; the modules that use it run last (tests/conftest.py), so that no other
    module runs beside it."""
    from chatgen.rlhf.runtime import Runtime, init_ray

    here = Path(__file__).parent
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]
    )
    local_ray = init_ray(None, 4)  # as a run starts it: loopback only (None: Ray was already up)
    yield
    Runtime([], {}, local_ray).shutdown()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The tiny sort-digits task: train.jsonl (64 records), eval.jsonl (TASK_N_EVAL), sft.jsonl."""
    from chatgen import tasks

    out = tmp_path_factory.mktemp("sort_digits")
    tasks.write_task_data(str(out), n_train=64, n_eval=TASK_N_EVAL)
    return out
