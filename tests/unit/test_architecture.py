"""chatgen's layering (docs/architecture.md), enforced with import-linter's contracts in .importlinter.

    pytest tests/unit/test_architecture.py

Every import, function-level ones included, points down the floors; a generation backend is its own files; the
ground floor, the config system and the algorithm math import no engine, trainer or cluster library; a weight
transport of chatgen.param_sync is its own file. And no module imports another module's private (`_name`) names.
No file of chatgen/ runs over 500 lines, the MegatronModule class stays under 350, and no test module imports
another test module. The tree is as `ruff format` (ruff.toml: lines of 100) leaves it.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the `chatgen` package under `root` (its graph is read from the source, not imported)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--config",
            str(REPO / ".importlinter"),
            "--no-cache",
            "--no-logo",
        ],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_contract_is_kept():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, upward",
    [
        ("core/tensors.py", "from chatgen.rlhf import run"),  # the ground floor reaching the top
        ("config/loader.py", "import chatgen.generation.base"),  # config knowing a backend
        (
            "param_sync/local.py",
            "from chatgen.generation.vllm import adapter",
        ),  # sync talking to vLLM, not the contract
        (
            "param_sync/shm.py",
            "from chatgen.param_sync import group",
        ),  # one transport leaning on another
        (
            "rlhf/run.py",
            "from chatgen.generation.hf import module",
        ),  # a run naming a backend, not `backend: hf`
    ],
)
def test_an_upward_import_breaks_a_contract(tmp_path, module, upward):
    """The contracts bite: one upward import, even inside a function, fails the lint naming the import."""
    shutil.copytree(
        REPO / "chatgen", tmp_path / "chatgen", ignore=shutil.ignore_patterns("__pycache__")
    )
    target = tmp_path / "chatgen" / module
    target.write_text(target.read_text() + f"\n\ndef _sneaky():\n    {upward}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout
    # the offending module is named
    assert f"chatgen.{module[:-3].replace('/', '.')}" in result.stdout


def private_imports(root: Path) -> list:
    """`path: from module import _name` for every import, anywhere in a file under `root`, of a private name (one
    leading underscore, not a dunder) from another module of chatgen."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and not (node.module or "").startswith("chatgen"):
                continue  # another library's internals are the adapters' business (and their tests')
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(
                        f"{path.relative_to(root.parent)}:{node.lineno}: from {'.' * node.level}"
                        f"{node.module or ''} import {alias.name}"
                    )
    return found


def test_no_module_imports_a_private_name_of_another():
    """A name with a leading underscore is its file's own business; a file that needs it elsewhere makes it
    public (or the two belong together). Tests are exempt: they may reach in to build a hostile peer."""
    assert private_imports(REPO / "chatgen") == []


def test_a_private_import_is_caught(tmp_path):
    package = tmp_path / "chatgen"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from chatgen.core.tensors import _hidden\n")
    (package / "b.py").write_text("from .a import f as _f, __doc__\nfrom os import _exit\n")
    assert private_imports(package) == ["chatgen/a.py:2: from chatgen.core.tensors import _hidden"]


MAX_FILE_LINES = (
    500  # a file past this holds more than one topic: split it by topic (docs/architecture.md)
)
MAX_MEGATRON_MODULE_LINES = (
    350  # the class keeps the lifecycle and the train/forward steps; jobs are mixins
)


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> list:
    """`path: N lines` for every Python file under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root.parent)}: {lines} lines")
    return found


def test_no_file_of_chatgen_is_over_500_lines():
    assert long_files(REPO / "chatgen") == []


def test_a_long_file_is_caught(tmp_path):
    (tmp_path / "chatgen").mkdir()
    (tmp_path / "chatgen" / "short.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "chatgen" / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert long_files(tmp_path / "chatgen") == [f"chatgen/long.py: {MAX_FILE_LINES + 1} lines"]


MAX_WIDE_SHARE = 0.03  # of chatgen's non-blank lines over 100 columns


def wide_share(root: Path) -> float:
    """The share of non-blank lines of the Python files under `root` wider than 100 columns: the prose
    `ruff format` leaves as written (docstrings, comments, string literals)."""
    lines = [
        line
        for path in root.rglob("*.py")
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    return sum(len(line) > 100 for line in lines) / max(1, len(lines))


def test_prose_is_wrapped_at_100_columns():
    share = wide_share(REPO / "chatgen")
    assert share <= MAX_WIDE_SHARE, (
        f"{share:.1%} of chatgen's lines are over 100 columns (at most {MAX_WIDE_SHARE:.0%}): "
        "python scripts/wrap_prose.py chatgen/ wraps docstrings and comments"
    )


def test_a_wide_tree_is_caught(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" * 96 + "# " + "w" * 120 + "\n" * 1 + "y = 2\n" * 3)
    assert wide_share(tmp_path) == pytest.approx(0.01)
    (tmp_path / "b.py").write_text(('"""' + "long words " * 20 + '"""\n') * 5)
    assert wide_share(tmp_path) > MAX_WIDE_SHARE


def test_the_megatron_module_class_is_under_350_lines():
    path = REPO / "chatgen" / "training" / "megatron_module.py"
    (cls,) = [
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "MegatronModule"
    ]
    assert cls.end_lineno - cls.lineno + 1 < MAX_MEGATRON_MODULE_LINES


def imported_test_modules(root: Path) -> list:
    """`path:line: import` for every import, anywhere in a test file under `root`, of another test module
    (`test_*`, as pytest puts each test directory on sys.path) or of `tests.*`: shared helpers live in
    conftest.py fixtures or tests/helpers.py, so a test module runs (and fails) on its own."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if (
                    name.split(".")[-1].startswith("test_")
                    or name == "tests"
                    or name.startswith("tests.")
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_no_test_module_imports_another():
    assert imported_test_modules(REPO / "tests") == []


def test_a_test_module_import_is_caught(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text(
        "import os\nfrom helpers import x\n\n\ndef f():\n    from test_b import y\n"
    )
    (tmp_path / "unit" / "test_c.py").write_text("import tests.helpers\n")
    assert imported_test_modules(tmp_path) == [
        "unit/test_a.py:6: test_b",
        "unit/test_c.py:1: tests.helpers",
    ]


def unformatted_files(root: Path) -> list:
    """Python files under `root` that `ruff format` (the repository's ruff.toml) would change."""
    ruff = [sys.executable, "-m", "ruff"]
    done = subprocess.run(
        [
            *ruff,
            "format",
            "--check",
            "--output-format",
            "concise",
            "--config",
            str(REPO / "ruff.toml"),
            ".",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode not in (0, 1):  # 2: ruff itself failed (a syntax error, a bad config)
        raise RuntimeError(f"ruff format --check failed: {done.stderr or done.stdout}")
    return sorted(
        line.split(":", 1)[0] for line in done.stdout.splitlines() if "unformatted:" in line
    )


def test_the_tree_is_formatted_at_100_columns():
    assert unformatted_files(REPO) == [], "run `ruff format` at the repository root (ruff.toml)"


def test_an_unformatted_file_is_caught(tmp_path):
    (tmp_path / "tidy.py").write_text("x = [1, 2]\n")
    (tmp_path / "messy.py").write_text("x = [ 1,2 ]\n")
    assert unformatted_files(tmp_path) == ["messy.py"]
