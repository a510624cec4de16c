"""RLHF algorithms, one file each: grpo.py, grpo_multiturn.py, ppo.py, dpo.py, online_dpo.py (or your own module).

`runtime.algorithm.name` in the main YAML picks one: a name here (`grpo`), or the dotted path of your own module
(`my_pkg.my_algo`, importable from the directory you run in). An algorithm module declares everything about
itself; nothing else in chatgen lists algorithms:

    Config      a dataclass subclassing chatgen.rlhf.config.AlgorithmConfig: its own keys of the `runtime.algorithm:`
                section, each `name: type = opt(default, "doc")`, with a `check()` for ranges (typed, typo-checked
                and documented like every other config section)
    MODELS      {model name: chatgen.rlhf.config.Role(backend, trainable=..., optional=..., syncs_to=...)}: the models
                it needs; the config is checked against it before anything starts
    check(cfg)  optional: yields "key: problem; fix" strings for rules across models and sections
    trainer_rows(cfg) -> int   optional: rows each trainer call of an episode gets, when not sample_per_episode
                (Online DPO: one pair per prompt); the batch-size checks count these
    train(cfg, resume=False, log=print) -> dict   the episode loop, top to bottom (chatgen.rlhf.run.Run
                gives it data, generation, scoring, trainer calls, sync, checkpoints, eval and logging)

docs/extending.md walks through adding one.
"""
import importlib
import importlib.util
import pkgutil
from pathlib import Path

REQUIRED = ("Config", "MODELS", "train")


def available() -> list[str]:
    """The algorithms shipped with chatgen (the modules of this package)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]))


def load(name: str):
    """The algorithm module for `runtime.algorithm.name`; ValueError naming the choices when there is none."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"runtime.algorithm.name must be a string, got {name!r}; one of {available()}")
    path = name if "." in name else f"{__name__}.{name}"
    try:
        found = importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        import difflib

        close = difflib.get_close_matches(name, available(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown algorithm {name!r}; {hint}chatgen ships {available()}, or give the dotted "
                         "path of your own module (importable from the directory you run in)")
    module = importlib.import_module(path)
    missing = [attr for attr in REQUIRED if not hasattr(module, attr)]
    if missing:
        raise ValueError(f"algorithm module {path} lacks {missing}; an algorithm module defines Config, MODELS and "
                         "train (see chatgen/rlhf/algorithms/grpo.py)")
    return module
