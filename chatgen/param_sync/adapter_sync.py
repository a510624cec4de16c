"""The adapter-only transport: a LoRA trainer's adapter (A and B of each target, a few percent of
the model) goes to an engine that keeps its base weights and samples with the adapter on top (vLLM's
LoRA path; the hf backend merges it), instead of the merged weights of `sync_weights`. docs/lora.md
says when each pays.

    report = sync_adapter(trainer, engine)          # on every trainer rank, each with its engine rank (or None)
    AdapterSender(engine).send(trainer)             # the same, as a sender

The source is `trainer.adapter_weights()` (chatgen.training.lora_sync.AdapterWeights: PEFT's names,
gathered over TP and PP, so any trainer layout sends the whole adapter) or a (adapter_config dict,
{PEFT name: tensor}) pair. The checks are the full sync's (chatgen.param_sync.checks): the manifest
(every pair's shapes against the engine's own weight of that name, the rank against the config),
finiteness before a byte is written, the stream against its plan (`validate`: bit for bit against a
second gather), and the engine's own check of the values it receives; then the engine swaps the
adapter in place (`load_lora_tensors`, in memory: no file). A refused adapter leaves the engine's
weights and adapter as they were.

Here the engine is a generation module of this process (colocated). Across processes the group and
shared-memory transports carry an adapter the same way: `sender.send(trainer.adapter_weights())`
(or a (config, tensors) pair); the header names the adapter's config, the engine makes the same
checks (chatgen.param_sync.checks: check_adapter_manifest, finiteness, fingerprints) and swaps it
with `load_lora_tensors` (`load_into(..., adapter=config)`).
"""

import time

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.param_sync.checks import (
    ADAPTER_REFUSED,
    SyncError,
    SyncReport,
    check_adapter_manifest,
    check_adapter_target,
    check_finite,
    checked,
    load_into,
    plan_bytes,
    plan_manifest,
)
from chatgen.param_sync.source import AdapterTensors

REFUSED = ADAPTER_REFUSED


def adapter_source(source):
    """The adapter weight source of a LoRA trainer (`adapter_weights()`) or of a (config,
    tensors) pair."""
    if isinstance(source, tuple) and len(source) == 2:
        return AdapterTensors(*source)
    lora = getattr(getattr(source, "config", None), "lora", None)
    if not callable(getattr(source, "adapter_weights", None)) or not (lora and lora.rank):
        raise SyncError(
            f"{REFUSED}: {type(source).__name__} has no adapter (a MegatronModule with lora.rank > 0, or a "
            "(adapter_config, tensors) pair); set lora.rank > 0 or sync the weights (sync_weights)"
        )
    return source.adapter_weights()


def check_engine(target) -> None:
    """A SyncError unless `target` takes adapters: a generation module of this process with
    enable_lora (a transport's sender carries an adapter too: `send(trainer.adapter_weights())`)."""
    if hasattr(target, "send"):
        raise SyncError(
            f"{REFUSED}: {type(target).__name__} is a sender; send the adapter through it "
            "(sender.send(trainer.adapter_weights()), or a (config, tensors) pair)"
        )
    check_adapter_target(target)


class AdapterSender:
    """Swaps the adapter of `target`, a generation module of this process with `enable_lora`
    (None on a trainer rank whose engine lives on another rank: it takes part in the gathers
    only)."""

    def __init__(self, target):
        if target is not None:
            check_engine(target)
        self.target = target

    def send(
        self, source, validate: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> SyncReport:
        """Check and load `source`'s adapter (see the module docstring); collective over the
        trainer's ranks. bucket_bytes: unused (the adapter is one bucket), for the senders'
        common signature."""
        start = time.perf_counter()
        weights = adapter_source(source)
        if self.target is not None:
            check_adapter_manifest(
                weights.config, plan_manifest(weights.plan), self.target.weight_manifest()
            )
        check_finite(weights)  # collective: the gather, on every rank
        tensors = {}
        for bucket in checked(weights.buckets(), weights.plan, weights, validate, finite=True):
            tensors.update(bucket)
        if self.target is not None:
            load_into(self.target, [list(tensors.items())], adapter=weights.config)
        return SyncReport(
            time.perf_counter() - start,
            plan_bytes(weights.plan, weights.dtype),
            len(tensors),
            1,
            validate,
        )

    def close(self) -> None:
        """Nothing to release: the target is the caller's."""


def sync_adapter(source, target, validate: bool = False) -> SyncReport:
    """Load `source`'s adapter (a LoRA MegatronModule, or a (config, tensors) pair) into
    `target`, a generation module of this process with enable_lora (None: this trainer rank only
    takes part); collective over the trainer's ranks. See the module docstring."""
    return AdapterSender(target).send(source, validate)
