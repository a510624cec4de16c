"""vLLM generation: `VLLMModule` (vllm_module.py) driven step by step by the framework.

vllm_adapter.py is the only module touching vLLM internals; engine_loop.py is the thread that steps the engine
(every call and weight update goes through it); engine_config.py maps the per-model YAML to vLLM arguments;
batching.py builds token batches in and out; chat_tokens.py keeps multi-turn chats token-exact; cli.py is
`chatgen generate`; standalone.py is `VLLMGeneration`, the generator any PyTorch trainer can use. Guides:
docs/vllm_module.md, docs/serving.md, docs/vllm_generation.md.
Importing this package is cheap: vLLM loads with vllm_adapter / vllm_module.
"""
from chatgen.generation.batching import verify_right_padding
from chatgen.generation.chat_tokens import replace_prefix_tokens

__all__ = ["replace_prefix_tokens", "verify_right_padding"]
