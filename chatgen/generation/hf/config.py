"""The hf backend's per-model config: `HFConfig`, the keys every generation backend reads and none
of its own.

Every key of chatgen.generation.config means what docs/generation_keys.md says; where the hf backend
differs in how (not what), docs/hf_backend.md says so: `generation_batch_size` is the sequences of
one forward batch (null = 256, vLLM's CPU default), `seed` seeds the backend's one sampling
generator at `setup()`. Pure Python.
"""

import dataclasses

from chatgen.config import opt
from chatgen.generation.config import GenerationConfig


@dataclasses.dataclass(kw_only=True)
class HFConfig(GenerationConfig):
    """The keys of a `backend: hf` model: GenerationConfig's (the name says which backend a
    config is for), and enable_lora (vLLM's name) for an adapter-only sync's target."""

    enable_lora: bool = opt(
        False,
        "take a LoRA adapter on top of the base weights (an adapter-only sync: the adapted weights are "
        "computed from a kept copy of the base ones; docs/lora.md)",
    )
