"""megatron-core's distributed checkpoint format (`torch_dist`), as chatgen writes and reads it: the one place
that touches megatron.core.dist_checkpointing.

    save(sharded_state_dict, directory)        # collective: every rank writes its own shards
    state = load(sharded_state_dict, directory)  # collective: every rank reads what its layout needs
    tensors = read_full_tensors(directory)     # one process, no torch.distributed: {key: whole tensor}

A sharded state dict maps names to megatron `ShardedTensor`s (a local tensor plus where it sits in the global
one: `GPTModel.sharded_state_dict()`, `DistributedOptimizer.sharded_state_dict(...)`). Saving writes each
global tensor once, split over the ranks that hold it; loading asks for the slices the *current* layout
needs, so a checkpoint saved at one TP x PP x DP loads at another.

Three changes to how megatron does it:

- Writing happens in this process. megatron's torch_dist writer forks one writer process per file and starts a
  multiprocessing Manager, even for a synchronous save: a process that hosts a vLLM engine (colocated runs)
  should not fork, and a daemonic process (a test rank) cannot have children.
- Nothing is unpickled freely, so a tampered checkpoint cannot run code when it is loaded. The index file that
  torch.distributed.checkpoint writes (`.metadata`) is a pickle: it is read with an unpickler that builds only
  torch's checkpoint-metadata classes and the plain types they hold. The non-tensor values it stores as bytes
  (optimizer hyper-parameters, modules' extra state) are read with `torch.load(weights_only=True)` (torch's
  reader uses weights_only=False there), as are its tensors and megatron's `common.pt` (torch's default).
- Restoring the distributed optimizer's state into torch's AdamW (no Transformer Engine or Apex: every CPU run)
  gives each parameter its own restored step count: megatron 0.16 shares one step tensor between all of them
  (AdamW would then count it up once per parameter) and looks the step up in the checkpoint, which does not
  store it (`_restore_adamw_step_separately`).
"""
import io
import pickle
from pathlib import Path

import torch

METADATA_FILE = "metadata.json"  # megatron's marker of a complete distributed checkpoint (written last)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch.distributed.checkpoint's metadata classes and plain values only (see the module docstring): a
    class of the modules that define that metadata (a dataclass or an enum: building one runs no other code),
    torch's dtypes, layouts and memory formats, and a few plain types. Never a function, which a pickle could call
    with arguments of its choosing."""

    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed._shard.metadata", "torch.distributed._shard.sharded_tensor.metadata"}
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
    _TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module, name):
        found = super().find_class(module, name) if (module in self._MODULES or (module, name) in self._NAMES
                                                     or module == "torch") else None
        if ((module, name) in self._NAMES or (module in self._MODULES and isinstance(found, type))
                or (module == "torch" and isinstance(found, self._TORCH_VALUES))):
            return found
        raise pickle.UnpicklingError(f"a distributed checkpoint's .metadata names {module}.{name}, which is not "
                                     "checkpoint metadata; refusing to load it (the file was not written by "
                                     "torch.distributed.checkpoint, or was altered)")


class _SafePickle:
    """The `pickle` that torch.distributed.checkpoint's file reader sees: loads through `_MetadataUnpickler`."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _MetadataUnpickler(file, **kwargs).load()

    @staticmethod
    def loads(data, **kwargs):
        return _MetadataUnpickler(io.BytesIO(data), **kwargs).load()


class _TorchLoadsWeightsOnly:
    """The `torch` that torch.distributed.checkpoint's load planner sees: `load` with weights_only=True."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, weights_only=True, **kwargs):
        return torch.load(f, *args, weights_only=True, **kwargs)


def _read_safely() -> None:
    """From here on torch.distributed.checkpoint's reader unpickles nothing freely (see the module docstring)."""
    from torch.distributed.checkpoint import default_planner, filesystem

    filesystem.pickle = _SafePickle()
    default_planner.torch = _TorchLoadsWeightsOnly()


def _strategies():
    """megatron's torch_dist save strategy writing in this process, and its load strategy (reading safely)."""
    from torch.distributed import checkpoint as dcp

    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    _read_safely()

    class InProcessSave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                                 self.keep_only_main_replica)
            dcp.save(mcore_torch.mcore_to_pyt_state_dict(state, False),
                     storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                          flatten_state_dict=False))

    return InProcessSave("torch_dist", 1), mcore_torch.TorchDistLoadShardedStrategy()


def save(sharded_state_dict: dict, directory) -> None:
    """Write `sharded_state_dict` into the existing directory `directory`; collective over every rank."""
    from megatron.core import dist_checkpointing

    save_strategy, _ = _strategies()
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=save_strategy)


def load(sharded_state_dict: dict, directory) -> dict:
    """The state `sharded_state_dict` asks for (its tensors filled in), read from `directory`; collective."""
    from megatron.core import dist_checkpointing

    from torch.distributed.checkpoint.api import CheckpointException

    _, load_strategy = _strategies()
    _restore_adamw_step_separately()
    try:
        return dist_checkpointing.load(sharded_state_dict, str(directory), sharded_strategy=load_strategy)
    except CheckpointException as e:  # a BaseException in torch: an ordinary error here, like every other read error
        raise RuntimeError(f"torch.distributed.checkpoint could not read it: {e}") from e


def is_dist_checkpoint(directory) -> bool:
    return (Path(directory) / METADATA_FILE).is_file() and (Path(directory) / ".metadata").is_file()


def read_full_tensors(directory, skip: tuple = ()) -> dict:
    """{key: whole tensor} of every tensor in the checkpoint whose key does not start with one of `skip`, in this
    process alone (no torch.distributed, no Megatron import): what `chatgen convert` reads."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _read_safely()
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata) and not key.startswith(skip)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _restore_adamw_step_separately() -> None:
    """megatron's DistributedOptimizer, loading its `fully_reshardable` state into torch's AdamW (no Transformer
    Engine / Apex: every CPU run), sets every parameter's "step" to ONE shared tensor (AdamW then increments it
    once per parameter at the next step, so the bias correction of parameter k uses step + k), then copies each
    per-parameter state tensor from the checkpoint, "step" included, which that format does not store. Each
    parameter gets its own copy of the restored step instead, and the copy from the checkpoint skips it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    setter = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(setter, "_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        setter(self, model_param, tensors)

    set_states._keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
