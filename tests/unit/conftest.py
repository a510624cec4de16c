"""Fixtures of the unit tests of a run's config: `data`, the overrides that point a run at the tiny task's data.

pytest tests/unit
"""

import pytest

from chatgen import tasks


@pytest.fixture
def data(tmp_path):
    tasks.write_task_data(str(tmp_path), n_train=64, n_eval=8)
    return [
        f"runtime.data_path={tmp_path}/train.jsonl",
        f"runtime.eval_data_path={tmp_path}/eval.jsonl",
    ]
