"""chatgen.generation.vllm.ray_free: vLLM imported and started without importing Ray (issue 36: 43 MiB, ~0.8 s).

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
        "from chatgen.generation.vllm.ray_free import without_ray\n"
        "with without_ray():\n"
        "    try:\n"
        "        import ray\n"
        "        print('imported')\n"
        "    except ImportError:\n"
        "        print('hidden')\n"
        "print('ray' in sys.modules)\n"
        "import ray\n"
        "print(ray.is_initialized())\n"
    )
    assert out.split() == ["hidden", "False", "False"]


def test_left_alone_once_imported():
    out = run(
        "import ray, sys\n"
        "from chatgen.generation.vllm.ray_free import without_ray\n"
        "with without_ray():\n"
        "    import ray as again\n"
        "print(again is ray, sys.modules['ray'] is ray)\n"
    )
    assert out.split() == ["True", "True"]


@pytest.mark.integration
def test_adapter_imports_vllm_without_ray():
    out = run(
        "import sys\n"
        "from chatgen.generation.vllm import adapter\n"
        "print('ray' in sys.modules, adapter.LLM.__name__)\n"
    )
    assert out.split() == ["False", "LLM"]
