"""The run checks of release_during_training (chatgen.rlhf.checks.release_problems and the vLLM
config's own): the engine must be a CPU one colocated with its trainer, in a synchronous run with
full weight syncs; each problem names the key and the fix.

    python -m pytest tests/unit/test_release_checks.py
"""

import pytest

from chatgen.config import ConfigError
from chatgen.rlhf.checks import release_problems
from chatgen.rlhf.config import load_config

ON = "policy.release_during_training=true"


def problems(*overrides) -> list:
    return list(release_problems(load_config("configs/grpo_tiny.yaml", [ON, *overrides])))


def test_colocated_synchronous_cpu_run_is_accepted():
    assert problems() == []
    assert list(release_problems(load_config("configs/grpo_tiny.yaml", []))) == []


@pytest.mark.parametrize(
    "override, says",
    [
        ("runtime.algorithm.max_staleness=2", "max_staleness / overlap_generation generate while"),
        ("runtime.algorithm.overlap_generation=true", "remove one of them"),
        ("runtime.colocation=[]", "in a runtime.colocation group with the trainer"),
    ],
)
def test_a_run_it_cannot_serve_is_refused(override, says):
    (problem,) = problems(override)
    assert problem.startswith("models.policy: release_during_training") and says in problem


def test_with_an_adapter_only_sync_it_is_refused():
    with pytest.raises(ConfigError, match="release_during_training: needs syncs that write every"):
        load_config("configs/grpo_tiny.yaml", [ON, "policy.enable_lora=true"])
