"""TRL's generation class under its name: `from chatgen.compat.trl import VLLMGeneration` is TRL's
merged `trl.generation.vllm_generation.VLLMGeneration` (constructor, sync_weights(), generate's
4-tuple) over chatgen's engine. The class lives with the engine (chatgen/generation/trl_merged.py),
above this floor, and loads on first use, as the package root loads its classes. Guide:
docs/migrating_from_trl.md.
"""

_LAZY = {"VLLMGeneration": "chatgen.generation.trl_merged"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
