"""The in-process transport: trainer and engine in the same process (colocated), the weights written
straight from the source's buckets into the engine, without a copy.

    LocalSender(policy).send(trainer)               # on every trainer rank, each with its engine rank
    sync_weights(trainer, policy)                   # the same; sync_weights(trainer, sender) for any transport

The manifest ({HF name: shape}) is checked against the engine's architecture and every weight
checked finite before a byte is written; the stream is checked against the plan, and `validate`
recomputes every tensor by an independent, unbucketed path and compares bit for bit
(chatgen.param_sync.checks).
"""

import time

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.param_sync.checks import (
    SyncReport,
    adapter_config,
    check_adapter_manifest,
    check_adapter_target,
    check_finite,
    check_manifest,
    checked,
    load_into,
    plan_bytes,
    plan_manifest,
)
from chatgen.param_sync.source import weight_source


class LocalSender:
    """Writes into `target`, a generation module of this process (chatgen.generation.base:
    `weight_manifest`, `load_weights`, `needs_resync`). mode: what it does with requests in
    flight (`GenerationModule.load_weights`: wait, keep, recompute, abort)."""

    def __init__(self, target, mode: str = "wait"):
        self.target, self.mode = target, mode

    def send(
        self, source, validate: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> SyncReport:
        """Copy `source`'s weights into the target; collective over the source's ranks."""
        start = time.perf_counter()
        weights = weight_source(source, bucket_bytes)
        adapter = adapter_config(weights)
        if adapter is None:
            check_manifest(plan_manifest(weights.plan), self.target.weight_manifest())
        else:  # a LoRA adapter alone: the engine swaps it (adapter_sync.py's checks)
            check_adapter_target(self.target)
            check_adapter_manifest(
                adapter, plan_manifest(weights.plan), self.target.weight_manifest()
            )
        check_finite(weights)
        n = load_into(
            self.target,
            checked(weights.buckets(), weights.plan, weights, validate),
            self.mode,
            adapter,
        )
        return SyncReport(
            time.perf_counter() - start,
            plan_bytes(weights.plan, weights.dtype),
            n,
            len(weights.plan),
            validate,
        )

    def close(self) -> None:
        """Nothing to release: the target is the caller's."""


def sync_weights(
    source,
    target,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    validate: bool = False,
    mode: str = "wait",
) -> SyncReport:
    """Copy `source`'s weights (a MegatronModule, a torch.nn.Module with HF names, or (name,
    tensor) pairs; see `weight_source`) into `target`: a generation module in this process
    (colocated: call on every trainer rank with that rank's engine), or any sender of
    chatgen.param_sync (the engine lives elsewhere; its receiver picks the mode). Collective over
    the source's ranks. mode: what a module in this process does with requests in flight
    (`GenerationModule.load_weights`: wait, keep, recompute, abort)."""
    sender = target if hasattr(target, "send") else LocalSender(target, mode)
    return sender.send(source, validate, bucket_bytes)
