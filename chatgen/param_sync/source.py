"""Where a sync's weights come from: `weight_source(x)` turns a MegatronModule (its `hf_weights()`
stream), a torch.nn.Module with HF parameter names, or (name, tensor) pairs into a weight source.

A source is an object with: `plan` ([[(hf name, shape)] per bucket], the same on every rank of the
source), `dtype`, `buckets()` (yields [(hf name, tensor)] per bucket of the plan; collective over
the source's ranks), `reference(i)` (bucket i by an independent path, for validation) and
`nonfinite()` (HF names of parameters holding NaN/inf). `MegatronModule.hf_weights()` is one;
`LocalWeights` wraps tensors held in this process.
"""

import torch

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.param_sync.checks import ADAPTER_REFUSED, SyncError, nonfinite


class LocalWeights:
    """HF-named tensors held whole in this process (a transformers model, a list of pairs) as a
    weight source."""

    def __init__(self, named_tensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._tensors = [(name, t.detach()) for name, t in named_tensors]
        if not self._tensors:
            raise SyncError(
                "weight sync refused, the engine keeps its old weights: the source holds no tensors"
            )
        dtypes = {t.dtype for _, t in self._tensors}
        if len(dtypes) > 1:
            raise SyncError(
                f"weight sync refused, the engine keeps its old weights: the source mixes dtypes "
                f"{sorted(map(str, dtypes))}; cast the model to one dtype"
            )
        self.dtype = dtypes.pop()
        self._buckets, size = [[]], 0
        for name, t in self._tensors:
            nbytes = t.numel() * t.element_size()
            if self._buckets[-1] and size + nbytes > bucket_bytes:
                self._buckets.append([])
                size = 0
            self._buckets[-1].append((name, t))
            size += nbytes
        self.plan = [[(name, tuple(t.shape)) for name, t in bucket] for bucket in self._buckets]

    def buckets(self):
        yield from self._buckets

    def reference(self, index: int) -> list[torch.Tensor]:
        return [t for _, t in self._buckets[index]]

    def nonfinite(self) -> list[str]:
        return nonfinite(self._tensors)


class AdapterTensors:
    """A LoRA adapter held in this process, (adapter_config.json as a dict, {PEFT name: tensor}),
    as a weight source (one bucket, in name order); its `config` marks it an adapter
    (checks.adapter_config)."""

    def __init__(self, config: dict, tensors: dict):
        self.config, self._tensors = config, dict(sorted(tensors.items()))
        dtypes = {t.dtype for t in self._tensors.values()}
        if len(dtypes) != 1:
            raise SyncError(f"{ADAPTER_REFUSED}: the adapter holds {len(dtypes)} dtypes ({dtypes})")
        self.dtype = dtypes.pop()
        self.plan = [[(name, tuple(t.shape)) for name, t in self._tensors.items()]]

    def buckets(self):
        yield list(self._tensors.items())

    def reference(self, index: int) -> list:
        return list(self._tensors.values())

    def nonfinite(self) -> list[str]:
        return nonfinite(self._tensors.items())


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _module_tensors(module: torch.nn.Module):
    """(HF name, full tensor) of a model's parameters, wrappers (DDP/FSDP `.module`,
    torch.compile) unwrapped."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):  # DDP, FSDP1
        module = module.module
    module = getattr(module, "_orig_mod", module)  # torch.compile
    for name, p in module.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        # FSDP2 DTensor -> whole tensor
        yield (
            name,
            (p.full_tensor() if hasattr(p, "full_tensor") else p),
        )


def weight_source(source, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """The weight source (see above) of a MegatronModule, a torch.nn.Module, an iterable of
    (name, tensor), a LoRA adapter alone (`trainer.adapter_weights()`, or an (adapter_config,
    {PEFT name: tensor}) pair), or a weight source already."""
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], dict):
        return AdapterTensors(*source)
    if callable(getattr(source, "buckets", None)) and hasattr(source, "plan"):
        return source  # a weight source (AdapterWeights)
    if hasattr(source, "hf_weights"):  # chatgen.MegatronModule
        return source.hf_weights(bucket_bytes)
    if isinstance(source, torch.nn.Module):
        return LocalWeights(_module_tensors(source), bucket_bytes)
    if isinstance(source, dict):
        return LocalWeights(source.items(), bucket_bytes)
    try:
        pairs = list(source)
    except TypeError:
        raise TypeError(
            f"sync_weights: cannot read weights from a {type(source).__name__}; pass a MegatronModule, "
            "a torch.nn.Module with HF parameter names, or an iterable of (name, tensor)"
        ) from None
    if not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and torch.is_tensor(p[1])
        for p in pairs
    ):
        raise TypeError("sync_weights: an iterable source must yield (HF name, tensor) pairs")
    return LocalWeights(pairs, bucket_bytes)
