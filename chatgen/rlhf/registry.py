"""The algorithm registry: the algorithm module a config names, and the ones chatgen ships.

The plugins themselves are the modules of chatgen.rlhf.algorithms (a plain package, a file or a
package each); this module finds them by the package's name, never importing it, so that
config.py and run.py, which every algorithm imports, have no arrow pointing back up to the
algorithms.
"""

import importlib.util
import types

from chatgen.core.imports import load_plugin, plugins

PACKAGE = "chatgen.rlhf.algorithms"


def _package():
    """The algorithms package as a bare module object (its name and path), not executed."""
    spec = importlib.util.find_spec(PACKAGE)
    package = types.ModuleType(PACKAGE)
    package.__path__ = list(spec.submodule_search_locations)
    return package


REQUIRED = ("Config", "MODELS", "train")


def available() -> list[str]:
    """The algorithms shipped with chatgen (the modules of chatgen.rlhf.algorithms)."""
    return plugins(_package())


def load(name: str):
    """The algorithm module for `runtime.algorithm.name`; ValueError naming the choices when
    there is none."""
    return load_plugin(
        name,
        _package(),
        REQUIRED,
        "algorithm",
        "runtime.algorithm.name",
        "chatgen/rlhf/algorithms/ppo.py",
    )
