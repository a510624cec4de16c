"""vLLM's LoRA adapters, through its public API: load a PEFT adapter directory into a running engine, retire the
one it replaces. The engine must have been built with `enable_lora` (VLLMConfig.enable_lora)."""

from vllm import LLM
from vllm.lora.request import LoRARequest


def swap_lora(llm: LLM, directory, lora_id: int, previous: LoRARequest | None) -> LoRARequest:
    """Load the adapter in `directory` under a new id (read now: the directory may go away after), then remove
    `previous`; returns the request new generations carry. Call between engine steps, with no request running
    under `previous`."""
    request = LoRARequest(f"chatgen-adapter-{lora_id}", lora_id, str(directory))
    engine = llm.llm_engine
    if not engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the LoRA adapter in {directory}")
    if previous is not None:
        engine.remove_lora(previous.lora_int_id)
    return request
