"""chatgen.generation.vllm.lean_imports: vLLM imported and started without importing Ray or OpenTelemetry
(issue 36: 43 + 13 MiB, ~1 s).

Each check runs in a fresh interpreter, whose sys.modules has not seen ray yet."""

from pathlib import Path

import pytest
from helpers import fresh_interpreters

REPO = Path(__file__).resolve().parents[2]


HIDDEN_INSIDE = (
    "import sys\n"
    "from chatgen.generation.vllm.lean_imports import without_unused_imports\n"
    "with without_unused_imports():\n"
    "    for name in ('ray', 'opentelemetry.trace'):\n"
    "        try:\n"
    "            __import__(name)\n"
    "            print('imported')\n"
    "        except ImportError:\n"
    "            print('hidden')\n"
    "print('ray' in sys.modules, 'opentelemetry' in sys.modules)\n"
    "import ray\n"
    "from opentelemetry import trace\n"
    "print(ray.is_initialized(), callable(trace.get_tracer))\n"
)
LEFT_ALONE = (
    "import ray, sys\n"
    "from chatgen.generation.vllm.lean_imports import without_unused_imports\n"
    "with without_unused_imports():\n"
    "    import ray as again\n"
    "print(again is ray, sys.modules['ray'] is ray)\n"
)
ADAPTER = (
    "import sys\n"
    "from chatgen.generation.vllm import adapter\n"
    "print('ray' in sys.modules, 'opentelemetry' in sys.modules, 'grpc' in sys.modules, "
    "adapter.LLM.__name__)\n"
)
# MegatronModule.init imports megatron-core inside hidden_imports(("wandb",)): nothing chatgen
# imports before it (the CLI, the trainer's module) may have loaded megatron-core already
WANDB_HIDDEN = (
    "import sys\n"
    "import chatgen.cli.train, chatgen.training.megatron_module\n"
    "print('megatron.core' in sys.modules)\n"
    "from chatgen.core.imports import hidden_imports\n"
    "with hidden_imports(('wandb',)):\n"
    "    from megatron.core import parallel_state\n"
    "print('wandb' in sys.modules)\n"
    "import wandb\n"
    "print(callable(wandb.init))\n"
)
CODES = {
    "test_hidden_inside_importable_after": HIDDEN_INSIDE,
    "test_left_alone_once_imported": LEFT_ALONE,
    "test_adapter_imports_vllm_without_ray_or_opentelemetry": ADAPTER,
    "test_megatron_core_loads_without_wandb_which_imports_as_usual_after": WANDB_HIDDEN,
}


@pytest.fixture(scope="module")
def processes(request):
    """test name -> its fresh interpreter, all started when the module begins (each is seconds of
    imports on one core); only the selected tests'."""
    yield from fresh_interpreters(
        request, __file__, CODES, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    )


def run(processes, name: str) -> str:
    out, err = processes[name].communicate(timeout=600)
    assert processes[name].returncode == 0, err[-3000:]
    return out.strip()


def test_hidden_inside_importable_after(processes):
    out = run(processes, "test_hidden_inside_importable_after")
    assert out.split() == ["hidden", "hidden", "False", "False", "False", "True"]


def test_left_alone_once_imported(processes):
    out = run(processes, "test_left_alone_once_imported")
    assert out.split() == ["True", "True"]


@pytest.mark.integration
def test_adapter_imports_vllm_without_ray_or_opentelemetry(processes):
    out = run(processes, "test_adapter_imports_vllm_without_ray_or_opentelemetry")
    assert out.split() == ["False", "False", "False", "LLM"]


def test_megatron_core_loads_without_wandb_which_imports_as_usual_after(processes):
    out = run(processes, "test_megatron_core_loads_without_wandb_which_imports_as_usual_after")
    assert out.split()[-3:] == ["False", "False", "True"]
