"""Megatron -> vLLM parameter sync (the bridge: the only package importing both sides, lazily).

    from chatgen.param_sync import sync_weights, SyncSender, SyncReceiver, SyncError

layout.py: pure HF <-> Megatron tensor layouts; gather.py: sharded trainer -> HF tensor buckets;
sync.py: manifest check, streaming into vLLM, validation, cross-process channel. docs/param_sync.md.
"""
from chatgen.param_sync.sync import SyncError, SyncReceiver, SyncReport, SyncSender, check_manifest, sync_weights

__all__ = ["sync_weights", "SyncSender", "SyncReceiver", "SyncReport", "SyncError", "check_manifest"]
