"""The algorithm registry: the algorithm module a config names, and the ones chatgen ships.

The plugins themselves are the modules of chatgen.rlhf.algorithms (a plain package, one file each);
this module finds and loads them, so that config.py and run.py, which every algorithm imports, need
not import the plugins' package for its functions (an arrow pointing back up).
"""

from chatgen.core.imports import load_plugin, plugins
from chatgen.rlhf import algorithms as package

REQUIRED = ("Config", "MODELS", "train")


def available() -> list[str]:
    """The algorithms shipped with chatgen (the modules of chatgen.rlhf.algorithms)."""
    return plugins(package)


def load(name: str):
    """The algorithm module for `runtime.algorithm.name`; ValueError naming the choices when there is none."""
    return load_plugin(
        name,
        package,
        REQUIRED,
        "algorithm",
        "runtime.algorithm.name",
        "chatgen/rlhf/algorithms/grpo.py",
    )
