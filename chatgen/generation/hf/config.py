"""The hf backend's per-model config: `HFConfig`, the keys every generation backend reads and none of its own.

Every key of chatgen.generation.config means what docs/generation_keys.md says; where the hf backend differs in
how (not what), docs/hf_backend.md says so: `generation_batch_size` is the sequences of one forward batch (null =
256, vLLM's CPU default), `seed` seeds the backend's one sampling generator at `setup()`. Pure Python.
"""

import dataclasses

from chatgen.generation.config import GenerationConfig


@dataclasses.dataclass(kw_only=True)
class HFConfig(GenerationConfig):
    """The keys of a `backend: hf` model: GenerationConfig's (the name says which backend a config is for)."""
