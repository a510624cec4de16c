"""The hf backend (`backend: hf`): HFGeneration (module.py) generates with a transformers model,
token by token.

The reference: what vLLM computes, computed by the model's own transformers code, for check-sync and
tests to compare vLLM against, and for debugging an RL loop where vLLM does not install. module.py
is the class (setup, the decode loop, weight writes); sampling.py the request settings and the
choice of each token (vLLM's order); config.py the per-model keys. Importing this package does not
import transformers (module.py does). docs/hf_backend.md.
"""

from chatgen.generation.hf.config import HFConfig as Config  # noqa: F401 (the backend's schema)

MODULE = "chatgen.generation.hf.module:HFGeneration"
