"""Generation: the contract every backend implements (base.py: `GenerationModule`, and the registry
that a model entry's `backend:` names), the keys every backend reads (config.py), token batches in
and out (batching.py), token-exact multi-turn chats (chat_tokens.py), and `VLLMGeneration` for any
PyTorch trainer (standalone.py). One package per backend: vllm/ (`VLLMModule`, driven one engine
step at a time), hf/ (transformers, the reference). Guides: docs/architecture.md,
docs/vllm_module.md, docs/hf_backend.md, docs/vllm_generation.md. Importing this package is cheap:
vLLM loads with chatgen.generation.vllm.module.
"""

from chatgen.generation.batching import verify_right_padding
from chatgen.generation.chat_tokens import replace_prefix_tokens

__all__ = ["replace_prefix_tokens", "verify_right_padding"]
