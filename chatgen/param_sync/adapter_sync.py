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

In-process only: the engine is a generation module of this process (colocated). The group and
shared-memory transports carry a full weight set into `load_weights`; an adapter through them is
refused naming the fix (the merged sync, `sync_weights`, crosses processes with every check).
"""

import time

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.models.lora_format import split_name
from chatgen.param_sync.checks import (
    SyncError,
    SyncReport,
    check_finite,
    checked,
    nonfinite,
    plan_bytes,
    plan_manifest,
)

REFUSED = "adapter-only sync refused, the engine keeps its weights and adapter"


class AdapterTensors:
    """An adapter held in this process, (adapter_config.json as a dict, {PEFT name: tensor}), as
    a weight source (one bucket, in name order)."""

    def __init__(self, config: dict, tensors: dict):
        self.config, self._tensors = config, dict(sorted(tensors.items()))
        dtypes = {t.dtype for t in self._tensors.values()}
        if len(dtypes) != 1:
            raise SyncError(f"{REFUSED}: the adapter holds {len(dtypes)} dtypes ({dtypes})")
        self.dtype = dtypes.pop()
        self.plan = [[(name, tuple(t.shape)) for name, t in self._tensors.items()]]

    def buckets(self):
        yield list(self._tensors.items())

    def reference(self, index: int) -> list:
        return list(self._tensors.values())

    def nonfinite(self) -> list[str]:
        return nonfinite(self._tensors.items())


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


def check_adapter_manifest(weights, engine_manifest: dict) -> None:
    """Every adapted weight exists in the engine with (out, in) matching its pair's B (out, r)
    and A (r, in), each pair complete, every rank the config's `r`; a SyncError listing every
    mismatch."""
    rank, pairs, problems = weights.config.get("r"), {}, []
    for name, shape in plan_manifest(weights.plan).items():
        try:
            hf_weight, matrix = split_name(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        pairs.setdefault(hf_weight, {})[matrix] = shape
    for hf_weight, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            problems.append(
                f"{hf_weight}: the adapter sends {sorted(pair)} only, not lora_A and lora_B"
            )
            continue
        (r_a, n_in), (n_out, r_b) = pair["lora_A"], pair["lora_B"]
        if r_a != rank or r_b != rank:
            problems.append(
                f"{hf_weight}: rank {r_a} / {r_b} (lora_A / lora_B), the adapter's config says r={rank}"
            )
        want = engine_manifest.get(hf_weight)
        if want is None:
            problems.append(f"{hf_weight}: the adapter adapts it, the engine has no such weight")
        elif tuple(want) != (n_out, n_in):
            problems.append(
                f"{hf_weight}: the adapter is for shape {(n_out, n_in)}, the engine's is {tuple(want)}"
            )
    if problems:
        raise SyncError(
            f"{REFUSED}; {len(problems)} mismatch(es) between the adapter and the engine:\n  "
            + "\n  ".join(problems[:50])
        )


def check_engine(target) -> None:
    """A SyncError unless `target` takes adapters: a generation module of this process with
    enable_lora."""
    if hasattr(target, "send"):
        raise SyncError(
            f"{REFUSED}: {type(target).__name__} carries full weight sets to an engine in another process, "
            "not adapters; colocate the engine with the trainer for an adapter-only sync, or sync the merged "
            "weights (sync_weights) through it"
        )
    if not callable(getattr(target, "load_lora_tensors", None)) or not getattr(
        getattr(target, "config", None), "enable_lora", False
    ):
        raise SyncError(
            f"{REFUSED}: {type(target).__name__} has no LoRA adapter support enabled; set enable_lora: true in "
            "the engine's config, or sync the merged weights (sync_weights)"
        )


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
            check_adapter_manifest(weights, self.target.weight_manifest())
        check_finite(weights)  # collective: the gather, on every rank
        tensors = {}
        for bucket in checked(weights.buckets(), weights.plan, weights, validate, finite=True):
            tensors.update(bucket)
        if self.target is not None:
            try:
                self.target.load_lora_tensors(weights.config, tensors)
            except Exception as e:  # built before the swap: the previous adapter stays
                raise SyncError(f"{REFUSED}: the engine refused it: {type(e).__name__}: {e}") from e
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
