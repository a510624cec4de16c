"""Trainer -> generation engine parameter sync (the bridge between the trainer side and the engine side).

    from chatgen.param_sync import sync_weights, SyncSender, SyncReceiver, SyncError

sync.py: weight sources (a MegatronModule's `hf_weights()`, a torch.nn.Module, (name, tensor) pairs), the
manifest and finiteness checks, streaming into the engine, validation, the cross-process channel (a
torch.distributed group); shared_memory.py: the same-host channel (a file in /dev/shm that both processes map).
It reads the trainer only through `hf_weights()` and the engine only through the generation contract
(`weight_manifest`, `load_weights`, `needs_resync`: chatgen.generation.base), importing neither: both sides
import it. `chatgen check-sync` (chatgen.tools.check_sync) proves a sync exact. docs/param_sync.md.
"""
from chatgen.param_sync.shared_memory import SharedMemoryUnavailable, ShmReceiver, ShmSender
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

__all__ = ["sync_weights", "weight_source", "LocalWeights", "SyncSender", "SyncReceiver", "ShmSender", "ShmReceiver",
           "SyncReport", "SyncError", "SharedMemoryUnavailable", "check_manifest"]
