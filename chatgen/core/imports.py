"""Classes and modules named in configs ('package.module:ClassName', a plugin's name), imported with an error
that says what to fix; `require`: an optional dependency (vLLM, Ray, the server's stack) checked where a part needs
it, with an error naming the setup.py extra that installs it."""
import difflib
import importlib
import importlib.util
import pkgutil


class MissingPackage(ImportError, ValueError):
    """An optional dependency of the part being used is not installed; the message names the extra to install.
    Also a ValueError: like a bad config value, the CLI prints it without a traceback (chatgen.cli.main)."""


# which of setup.py's extras installs each optional top-level package (keep the two in step)
EXTRAS = {"vllm": "vllm", "ray": "ray", "fastapi": "serve", "uvicorn": "serve"}


def require(package: str, what: str) -> None:
    """Raise MissingPackage unless `package` (a top-level module in EXTRAS) can be imported; `what` names the part
    that needs it (a backend, a command). Checked before the import, so the user reads what to install instead of
    a ModuleNotFoundError from deep inside chatgen."""
    if importlib.util.find_spec(package) is None:
        extra = EXTRAS[package]
        raise MissingPackage(f"{what} needs the Python package {package!r}, which is not installed in this "
                             f"environment; install it with `pip install 'chatgen[{extra}]'` (the tested versions: "
                             "requirements.txt on CPU, requirements-gpu.txt on CUDA)", name=package)


def import_class(path: str):
    """'package.module:ClassName' -> the class; a ValueError names the path and what went wrong."""
    module, _, name = str(path).partition(":")
    if not name:
        raise ValueError(f"{path!r}: write a class as 'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except MissingPackage:
        raise  # already says what to install
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path!r} cannot be imported ({e}); check the module path and that it is importable "
                         "from the directory you run in") from e


def plugins(package, packages_only: bool = False) -> list[str]:
    """Names of the modules of `package` (a module object; only its subpackages with packages_only): the plugins
    chatgen ships."""
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_") and (m.ispkg or not packages_only))


def load_plugin(name: str, package, required: tuple, what: str, key: str, example: str, packages_only: bool = False):
    """The plugin module `name`: a module of `package` (e.g. "grpo" in chatgen.rlhf.algorithms), or the dotted
    path of the user's own module; it must define every attribute of `required`. A ValueError names the config
    `key`, the choices (with the nearest one) and, for a module that lacks something, the `example` to follow."""
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
        raise ValueError(f"unknown {what} {name!r}; {hint}chatgen ships {', '.join(shipped)}, or give the dotted path "
                         "of your own module (importable from the directory you run in)")
    module = importlib.import_module(path)
    missing = [attr for attr in required if not hasattr(module, attr)]
    if missing:
        raise ValueError(f"{what} module {path} lacks {', '.join(missing)}; a {what} module defines "
                         f"{', '.join(required)} (see {example})")
    return module
