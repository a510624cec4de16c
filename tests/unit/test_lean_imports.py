"""chatgen.generation.vllm.lean_imports: vLLM imported and started without importing Ray or OpenTelemetry
(issue 36: 43 + 13 MiB, ~1 s).

Each check runs in a fresh interpreter, whose sys.modules has not seen ray yet."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_hidden_inside_importable_after():
    out = run(
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
    assert out.split() == ["hidden", "hidden", "False", "False", "False", "True"]


def test_left_alone_once_imported():
    out = run(
        "import ray, sys\n"
        "from chatgen.generation.vllm.lean_imports import without_unused_imports\n"
        "with without_unused_imports():\n"
        "    import ray as again\n"
        "print(again is ray, sys.modules['ray'] is ray)\n"
    )
    assert out.split() == ["True", "True"]


@pytest.mark.integration
def test_adapter_imports_vllm_without_ray_or_opentelemetry():
    out = run(
        "import sys\n"
        "from chatgen.generation.vllm import adapter\n"
        "print('ray' in sys.modules, 'opentelemetry' in sys.modules, 'grpc' in sys.modules, "
        "adapter.LLM.__name__)\n"
    )
    assert out.split() == ["False", "False", "False", "LLM"]


def test_megatron_core_loads_without_wandb_which_imports_as_usual_after():
    # MegatronModule.init imports megatron-core inside hidden_imports(("wandb",)): nothing chatgen
    # imports before it (the CLI, the trainer's module) may have loaded megatron-core already
    out = run(
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
    assert out.split()[-3:] == ["False", "False", "True"]
