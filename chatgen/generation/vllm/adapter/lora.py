"""vLLM's LoRA adapters: a PEFT adapter directory served under a name (vLLM's own path,
`add_lora_dir`), and an adapter held in memory (its adapter_config.json as a dict, its tensors by
PEFT name) replaced in place under one adapter id, and the LoRARequest new generations carry. The
engine must have been built with `enable_lora` (VLLMConfig.enable_lora).

vLLM 0.32 loads adapters only from a directory (`LoRARequest.lora_path`); verl subclasses
LoRARequest with the tensors and patches the worker's loader. Here the in-process worker
(collective_rpc with a function) builds the adapter with vLLM's own `LoRAModel.from_lora_tensors`
(patches.replace_lora_in_worker) and does what vLLM's in-place reload does after loading (remove the
old adapter of that id, add, activate): no file, no global patch. What this needs of vLLM is listed
in patches.RELIES_ON["replace_lora_in_worker"] (tests/integration/test_vllm_patches.py checks it).
"""

from pathlib import Path

from vllm import LLM
from vllm.lora.request import LoRARequest

from chatgen.generation.vllm.adapter.patches import replace_lora_in_worker

IN_MEMORY = "chatgen://in-memory"  # the lora_path of an adapter given as tensors: never read


def add_lora_dir(llm: LLM, name: str, lora_id: int, directory) -> LoRARequest:
    """Load the PEFT adapter in `directory` as `name` (vLLM reads it again should it evict the
    adapter); returns the request that samples with it."""
    request = LoRARequest(name, lora_id, str(Path(directory).resolve()))
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the LoRA adapter in {directory}")
    return request


def replace_lora(llm: LLM, lora_id: int, config: dict, tensors: dict) -> LoRARequest:
    """Make `tensors` the adapter of id `lora_id` in every worker of `llm` (the previous adapter
    of that id stays if building the new one fails: a ValueError from vLLM's checks, e.g. a rank
    above max_lora_rank). Returns the request new generations carry. Call between engine steps,
    with no request running under that id."""
    # copies: vLLM scales lora_B in place (LoRALayerWeights.optimize), and these may be a trainer's
    # parameters
    tensors = {name: t.clone() for name, t in tensors.items()}
    llm.collective_rpc(replace_lora_in_worker, args=(lora_id, config, tensors))
    return LoRARequest(f"chatgen-adapter-{lora_id}", lora_id, IN_MEMORY)
