"""The vLLM backend (`backend: vllm`): VLLMModule (module.py) drives an in-process vLLM engine one
step at a time.

module.py is the user-facing class (hooks and the step loop); engine_loop.py the one thread that
steps the engine (every call and weight update goes through it); adapter/ the only package touching
vLLM internals; config.py the per-model keys (VLLMConfig) and their vLLM arguments. Importing this
package imports neither vLLM nor torch.
"""

from chatgen.generation.vllm.config import VLLMConfig as Config  # noqa: F401 (the backend's schema)

MODULE = "chatgen.generation.vllm.module:VLLMModule"
# checked before a run starts anything (chatgen.rlhf.runtime): setup.py's extra `vllm`
REQUIRES = ("vllm",)
