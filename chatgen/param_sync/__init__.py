"""Trainer -> vLLM parameter sync (the bridge between the trainer side and the engine side).

    from chatgen.param_sync import sync_weights, SyncSender, SyncReceiver, SyncError

sync.py: weight sources (a MegatronModule's `hf_weights()`, a torch.nn.Module, (name, tensor) pairs), the
manifest and finiteness checks, streaming into vLLM, validation, the cross-process channel (a torch.distributed
group); shared_memory.py: the same-host channel (a file in /dev/shm that both processes map);
check_sync.py: `chatgen check-sync`. It reads the trainer only through `MegatronModule.hf_weights()` and
the engine only through chatgen.generation (VLLMModule.update_weights / vllm_adapter). docs/param_sync.md.
"""
from chatgen.param_sync.sync import (
    LocalWeights,
    SyncError,
    SyncReceiver,
    SyncReport,
    SyncSender,
    check_manifest,
    sync_weights,
    weight_source,
)
from chatgen.param_sync.shared_memory import SharedMemoryUnavailable, ShmReceiver, ShmSender

__all__ = ["sync_weights", "weight_source", "LocalWeights", "SyncSender", "SyncReceiver", "ShmSender", "ShmReceiver",
           "SyncReport", "SyncError", "SharedMemoryUnavailable", "check_manifest"]
