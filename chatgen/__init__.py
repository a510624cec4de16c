"""chatgen: RLHF post-training with a step-driven vLLM generation module and a Megatron-core
trainer.

Importing `chatgen` is cheap: the classes that pull in vLLM, Megatron or Ray load on first use, so
the algorithm math (`chatgen.rlhf.losses`), the rollout contract and the config system import
without them.

    from chatgen import VLLMModule, VLLMGeneration, MegatronModule, Module, RolloutBatch
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "VLLMModule": "chatgen.generation.vllm.module",
    "VLLMGeneration": "chatgen.generation.standalone",
    "MegatronModule": "chatgen.training.megatron_module",
    "Module": "chatgen.module",
    "RolloutBatch": "chatgen.core.rollout",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'chatgen' has no attribute {name!r}")


__all__ = [*_LAZY, "__version__"]
