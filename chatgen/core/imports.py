"""Classes and modules named in configs ('package.module:ClassName'), imported with an error that says what to fix."""
import importlib


def import_class(path: str):
    """'package.module:ClassName' -> the class; a ValueError names the path and what went wrong."""
    module, _, name = str(path).partition(":")
    if not name:
        raise ValueError(f"{path!r}: write a class as 'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path!r} cannot be imported ({e}); check the module path and that it is importable "
                         "from the directory you run in") from e
