"""Trainer -> generation engine parameter sync (the bridge between the trainer side and the engine
side).

    from chatgen.param_sync import sync_weights, GroupSender, GroupReceiver, ShmSender, ShmReceiver, SyncError

Every transport has one protocol: a sender's `send(source, validate=False)` is called on every
trainer rank (rank 0 moves the bytes, the others take part in the source's collectives), a
receiver's `receive_into(target, mode)` loads one sync into a generation module, and `close()` lets
go of what either holds. The transports, one file each: local.py (same process), group.py (a
torch.distributed group, trainer rank 0 -> 1..N engine ranks), shm.py (a file in /dev/shm, the
handshake passed in), adapter_sync.py (a LoRA adapter alone, in process). What they share: source.py
(where the weights come from), checks.py (manifest, header, finiteness, fingerprints, MAC and
signature, the checked load), wire.py (the group's rendezvous, deadlines, messages and token
challenge).

It reads the trainer only through `hf_weights()` and the engine only through the generation contract
(`weight_manifest`, `load_weights`, `needs_resync`: chatgen.generation.base), importing neither:
both sides import it. `chatgen check-sync` (chatgen.tools.check_sync) proves a sync exact.
docs/param_sync.md.
"""

from chatgen.param_sync.adapter_sync import AdapterSender, sync_adapter
from chatgen.param_sync.checks import (
    Receiver,
    Sender,
    SyncError,
    SyncReport,
    check_manifest,
    plan_manifest,
)
from chatgen.param_sync.group import GroupReceiver, GroupSender
from chatgen.param_sync.local import LocalSender, sync_weights
from chatgen.param_sync.shm import (
    SharedMemoryUnavailable,
    ShmReceiver,
    ShmSender,
    load_shm,
    remove_stale_segments,
)
from chatgen.param_sync.source import LocalWeights, weight_source

__all__ = [
    "sync_weights",
    "sync_adapter",
    "AdapterSender",
    "weight_source",
    "LocalWeights",
    "LocalSender",
    "GroupSender",
    "GroupReceiver",
    "ShmSender",
    "ShmReceiver",
    "load_shm",
    "remove_stale_segments",
    "SyncReport",
    "Sender",
    "Receiver",
    "SyncError",
    "SharedMemoryUnavailable",
    "check_manifest",
    "plan_manifest",
]
