"""Adapter-only sync: a LoRA trainer's adapter (A and B of each target, a few percent of the model) goes to a vLLM
engine that keeps the base weights and samples with the adapter on top (vLLM's LoRARequest), instead of the merged
weights of `sync_weights`. docs/lora.md says when each pays.

    report = sync_adapter(trainer, engine)    # a SyncReport: seconds, bytes (the adapter file), tensors

The adapter crosses as a PEFT directory in a private temporary directory (0700) that the engine reads at once and
that is removed after, so this first version needs the trainer in one process beside the engine (TP = PP = DP =
1, colocated); the engine must have `enable_lora` and hold the base weights the trainer started from.
"""

import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from chatgen.models.lora_format import WEIGHTS_FILE
from chatgen.param_sync.checks import SyncError, SyncReport


def sync_adapter(trainer, engine) -> SyncReport:
    """Load `trainer`'s current adapter into `engine` (a VLLMModule with enable_lora); one bucket: the adapter."""
    config = getattr(engine, "config", None)
    if not callable(getattr(engine, "load_lora_adapter", None)) or not getattr(
        config, "enable_lora", False
    ):
        raise SyncError(
            f"adapter-only sync refused: {type(engine).__name__} has no LoRA adapter support enabled; set "
            "enable_lora: true in the vLLM engine's config, or sync the merged weights (sync_weights)"
        )
    lora = getattr(trainer.config, "lora", None)
    if not (lora and lora.rank):
        raise SyncError(
            "adapter-only sync refused: the trainer has no adapter (lora.rank is 0); set lora.rank > 0 or "
            "sync the weights (sync_weights)"
        )
    if (trainer.tp, trainer.pp, trainer.dp) != (1, 1, 1):
        raise SyncError(
            f"adapter-only sync refused: the trainer runs at TP, PP, DP = {(trainer.tp, trainer.pp, trainer.dp)}; "
            "this version syncs an adapter from a one-process trainer only: sync the merged weights "
            "(sync_weights) instead"
        )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chatgen-adapter-") as tmp:
        path = Path(trainer.export_adapter(Path(tmp) / "adapter"))
        nbytes = (path / WEIGHTS_FILE).stat().st_size
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            tensors = len(list(f.keys()))  # noqa: SIM118 - safe_open is not a mapping
        engine.load_lora_adapter(path)
    return SyncReport(time.perf_counter() - start, nbytes, tensors, buckets=1)
