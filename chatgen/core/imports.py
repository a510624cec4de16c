"""Classes, functions and modules named in configs ('package.module:ClassName', 'file.py:function',
a plugin's name), imported with an error that says what to fix; `require`: an optional dependency
(vLLM, Ray, the server's stack) checked where a part needs it, with an error naming the setup.py
extra that installs it.

User code imports from the **project directory** (`project_dir`: the directory above the main YAML's
`configs/` folder, where `chatgen init DIR` puts them, else the main YAML's own directory) and then
the current directory. `add_project_dir` puts a directory at the front of this process's import path
and records it in the variable CHATGEN_PROJECT_DIRS, which the run's workers inherit (Ray actors on
any node: chatgen.rlhf.runtime.worker_env forwards it and puts the directories on their PYTHONPATH),
so they search the same directories.
"""

import contextlib
import difflib
import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

PROJECT_DIRS_VAR = "CHATGEN_PROJECT_DIRS"  # os.pathsep-separated, first = searched first


def project_dir(main_yaml) -> str:
    """The project directory of a main YAML: DIR for DIR/configs/<main>.yaml (the layout `chatgen
    init` makes), else the YAML's own directory. Absolute."""
    here = Path(os.path.abspath(os.fspath(main_yaml))).parent
    return str(here.parent if here.name == "configs" else here)


def add_project_dir(directory) -> None:
    """Put `directory` first on this process's import path (once) and record it for the run's
    workers."""
    directory = os.path.abspath(os.fspath(directory))
    dirs = project_dirs()
    if dirs[:1] == [directory] and directory in sys.path:
        return
    os.environ[PROJECT_DIRS_VAR] = os.pathsep.join(dict.fromkeys([directory, *dirs]))
    if directory in sys.path:
        sys.path.remove(directory)
    sys.path.insert(0, directory)


def project_dirs() -> list[str]:
    """The project directories added in this process or its parent (CHATGEN_PROJECT_DIRS), first
    first."""
    return [d for d in os.environ.get(PROJECT_DIRS_VAR, "").split(os.pathsep) if d]


def search_dirs() -> list[str]:
    """Where user code is looked for, in order: the project directories, then the current
    directory."""
    return list(dict.fromkeys([*project_dirs(), os.getcwd()]))


def import_object(path: str, what: str = "object"):
    """'package.module:name' or 'path/to/file.py:name' (relative to the search_dirs, or absolute)
    -> the object.

    A file is imported under the dotted name of its path below the search directory it is found
    in (so that it is the module a plain `import` of it would give, and its own imports of
    sibling modules work). A ValueError names the path, the file looked for and the directories
    searched; the user module's own import errors (a SyntaxError, a missing package) come as a
    ValueError naming the module and the error (the original chained), not disguised as a missing
    file."""
    module, _, name = str(path).partition(":")
    if not name or not module:
        raise ValueError(f"{path!r}: write a {what} as 'package.module:name' or 'file.py:name'")
    dirs = search_dirs()
    if module.endswith(".py"):
        return getattr_or_fail(_import_file(path, module, dirs), name, path)
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None:
        looked = module.replace(".", "/")
        raise ValueError(
            f"{path!r}: no module {module!r} (looked for {looked}.py or {looked}/__init__.py in "
            f"{', '.join(dirs)} and the installed packages); fix the path, or give the file: "
            f"'{looked}.py:{name}'"
        )
    return getattr_or_fail(_run_module(path, lambda: importlib.import_module(module)), name, path)


def _run_module(path: str, load):
    """load() (an import), with an error raised by the module's own code named as such."""
    try:
        return load()
    except MissingPackage:
        raise  # already says what to install
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises while it imports
        raise ValueError(
            f"{path!r}: importing it failed: {type(e).__name__}: {e}; fix that module (python -c "
            f"'import ...' in the project directory shows the traceback)"
        ) from e


def _import_file(path: str, file: str, dirs: list):
    candidates = [Path(file)] if os.path.isabs(file) else [Path(d) / file for d in dirs]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ValueError(
            f"{path!r}: file {file} not found; looked in {', '.join(dirs)} (the project directory: "
            "the one above the main YAML's configs/ folder, else the YAML's own; then the current "
            "directory); fix the path or give it absolute"
        )
    found = found.resolve()
    for d in dirs:  # the dotted name below a search directory, when it is one
        try:
            parts = found.with_suffix("").relative_to(Path(d).resolve()).parts
        except ValueError:
            continue
        dotted = ".".join(parts)
        cached = sys.modules.get(dotted)
        if cached is not None and Path(getattr(cached, "__file__", "") or "").resolve() != found:
            break  # that name is another file's (another project's, in one process): import this one by its file
        if all(p.isidentifier() for p in parts):
            if d not in sys.path:
                sys.path.insert(0, d)
            return _run_module(path, lambda: importlib.import_module(dotted))
    name = f"_chatgen_user_{abs(hash(str(found)))}"  # outside every search directory: by its file
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, found)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            _run_module(path, lambda: spec.loader.exec_module(module))
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def getattr_or_fail(module, name: str, path: str):
    try:
        return getattr(module, name)
    except AttributeError:
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1)
        raise ValueError(
            f"{path!r}: {module.__file__} has no {name!r}"
            + (f"; did you mean {close[0]!r}?" if close else "")
        ) from None


class MissingPackage(ImportError, ValueError):
    """An optional dependency of the part being used is not installed; the message names the
    extra to install. Also a ValueError: like a bad config value, the CLI prints it without a
    traceback (chatgen.cli.main)."""


# which of setup.py's extras installs each optional top-level package (keep the two in step)
EXTRAS = {
    "vllm": "vllm",
    "ray": "ray",
    "fastapi": "serve",
    "uvicorn": "serve",
    "datasets": "data",
    "math_verify": "math",
    "gymnasium": "gymnasium",
    "verifiers": "verifiers",
    "openenv": "openenv",
    "bm25s": "search",
    "wandb": "wandb",
    "mlflow": "mlflow",
}


# extras whose declared dependencies would change the stack beside vLLM: their pinned set installs
# without resolution (the file says why)
NO_DEPS = {"verifiers": "requirements-verifiers.txt", "openenv": "requirements-verifiers.txt"}


def require(package: str, what: str) -> None:
    """Raise MissingPackage unless `package` (a top-level module in EXTRAS) can be imported;
    `what` names the part that needs it (a backend, a command). Checked before the import, so the
    user reads what to install instead of a ModuleNotFoundError from deep inside chatgen."""
    if importlib.util.find_spec(package) is None:
        extra = EXTRAS[package]
        how = (
            f"`pip install --no-deps -r {NO_DEPS[extra]}` beside vLLM (`pip install "
            f"'chatgen[{extra}]'` alone would resolve their dependencies against it)"
            if extra in NO_DEPS
            else f"`pip install 'chatgen[{extra}]'` (the tested versions: requirements.txt on "
            "CPU, requirements-gpu.txt on CUDA)"
        )
        raise MissingPackage(
            f"{what} needs the Python package {package!r}, which is not installed in this "
            f"environment; install it with {how}",
            name=package,
        )


@contextlib.contextmanager
def hidden_imports(names):
    """Within it, importing a package of `names` raises ImportError (which a library's optional
    import handles as "not installed") unless it was imported before; afterwards each imports as
    usual. For the optional packages a library imports at import time that chatgen never has it
    use (chatgen.generation.vllm.lean_imports; megatron-core's wandb)."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's "not importable" marker
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_class(path: str):
    """'package.module:ClassName' (or 'file.py:ClassName') -> the class; a ValueError names the
    path, the file looked for and the directories searched (import_object)."""
    return import_object(path, "class")


def plugins(package, packages_only: bool = False) -> list[str]:
    """Names of the modules of `package` (a module object; only its subpackages with
    packages_only): the plugins chatgen ships."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(package.__path__)
        if not m.name.startswith("_") and (m.ispkg or not packages_only)
    )


def load_plugin(
    name: str,
    package,
    required: tuple,
    what: str,
    key: str,
    example: str,
    packages_only: bool = False,
):
    """The plugin module `name`: a module of `package` (e.g. "grpo" in chatgen.rlhf.algorithms),
    or the dotted path of the user's own module; it must define every attribute of `required`. A
    ValueError names the config `key`, the choices (with the nearest one) and, for a module that
    lacks something, the `example` to follow."""
    shipped = plugins(package, packages_only)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{key} must be a string, got {name!r}; one of {', '.join(shipped)}")
    path = name if "." in name else f"{package.__name__}.{name}"
    try:
        found = importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        close = difflib.get_close_matches(name, shipped, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown {what} {name!r}; {hint}chatgen ships {', '.join(shipped)}, or give the dotted path "
            "of your own module (importable from the directory you run in)"
        )
    module = importlib.import_module(path)
    missing = [attr for attr in required if not hasattr(module, attr)]
    if missing:
        raise ValueError(
            f"{what} module {path} lacks {', '.join(missing)}; a {what} module defines "
            f"{', '.join(required)} (see {example})"
        )
    return module
