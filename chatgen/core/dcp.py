"""torch.distributed.checkpoint files (megatron-core's `torch_dist` format) read safely, in one
process.

    tensors = read_full_tensors(directory)      # {key: whole tensor}, no torch.distributed, no Megatron import
    read_safely()                               # from here on torch's checkpoint reader unpickles nothing freely

The index file that torch.distributed.checkpoint writes (`.metadata`) is a pickle: it is read with
an unpickler that builds only torch's checkpoint-metadata classes and the plain types they hold, so
a tampered checkpoint cannot run code when it is loaded. The non-tensor values it stores as bytes
(optimizer hyper-parameters, modules' extra state) are read with `torch.load(weights_only=True)`
(torch's reader uses weights_only=False there). Writing and resharded loading of a trainer's
checkpoint are chatgen.training.dist_checkpoint's; this is the ground-floor part that an engine
starting from a checkpoint, and `chatgen convert`, need too.
"""

import io
import pickle
import warnings
from pathlib import Path

import torch

METADATA_FILE = (
    "metadata.json"  # megatron's marker of a complete distributed checkpoint (written last)
)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch.distributed.checkpoint's metadata classes and plain values only (see the
    module docstring): a class of the modules that define that metadata (a dataclass or an enum:
    building one runs no other code), torch's dtypes, layouts and memory formats, and a few plain
    types. Never a function, which a pickle could call with arguments of its choosing."""

    _MODULES = {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed._shard.metadata",
        "torch.distributed._shard.sharded_tensor.metadata",
    }
    _NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
    _TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module, name):
        found = (
            super().find_class(module, name)
            if (module in self._MODULES or (module, name) in self._NAMES or module == "torch")
            else None
        )
        if (
            (module, name) in self._NAMES
            or (module in self._MODULES and isinstance(found, type))
            or (module == "torch" and isinstance(found, self._TORCH_VALUES))
        ):
            return found
        raise pickle.UnpicklingError(
            f"a distributed checkpoint's .metadata names {module}.{name}, which is not "
            "checkpoint metadata; refusing to load it (the file was not written by "
            "torch.distributed.checkpoint, or was altered)"
        )


class _SafePickle:
    """The `pickle` that torch.distributed.checkpoint's file reader sees: loads through
    `_MetadataUnpickler`."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _MetadataUnpickler(file, **kwargs).load()

    @staticmethod
    def loads(data, **kwargs):
        return _MetadataUnpickler(io.BytesIO(data), **kwargs).load()


class _TorchLoadsWeightsOnly:
    """The `torch` that torch.distributed.checkpoint's load planner sees: `load` with
    weights_only=True."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, weights_only=True, **kwargs):
        return torch.load(f, *args, weights_only=True, **kwargs)


def read_safely() -> None:
    """From here on torch.distributed.checkpoint's reader unpickles nothing freely (see the
    module docstring)."""
    from torch.distributed.checkpoint import default_planner, filesystem

    filesystem.pickle = _SafePickle()
    default_planner.torch = _TorchLoadsWeightsOnly()


def is_dist_checkpoint(directory) -> bool:
    return (Path(directory) / METADATA_FILE).is_file() and (Path(directory) / ".metadata").is_file()


def read_full_tensors(directory, skip: tuple = ()) -> dict:
    """{key: whole tensor} of every tensor in the checkpoint whose key does not start with one of
    `skip`, in this process alone (no torch.distributed, no Megatron import): what `chatgen
    convert` reads."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    read_safely()
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith(skip)
    }
    # torch warns that it assumes one process even when told so (no_dist)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state
