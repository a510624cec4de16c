"""What the ranks of the suite's multi-process jobs import, imported once by the server they are
forked from (chatgen.training.launcher.fork_ranks_from; tests/conftest.py): each rank of each job
then starts in a fraction of a second instead of seconds of imports (vLLM's engine: ~5 s a rank on
an idle core). vLLM configures its logging when imported, from VLLM_LOGGING_LEVEL: quiet.apply()
sets it here as it does in a spawned rank."""

import importlib

from chatgen.core import quiet

quiet.apply()  # before megatron-core's import notices, as a spawned rank applies it
for module in (
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "transformers",
    "chatgen.training.launcher",
    "chatgen.training.megatron_module",
    "chatgen.training.fsdp_module",
    "helpers",
    "vllm.v1.engine.llm_engine",
    "vllm.model_executor.models.llama",
    "chatgen.generation.vllm.module",
):
    try:
        importlib.import_module(module)
    except ImportError:  # absent or hidden (scripts/gpu_run.sh hides vLLM): a rank imports its own
        pass
