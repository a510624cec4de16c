"""megatron-core's distributed checkpoint format (`torch_dist`), as chatgen writes and reads it: the
one place that touches megatron.core.dist_checkpointing.

    save(sharded_state_dict, directory)        # collective: every rank writes its own shards
    state = load(sharded_state_dict, directory)  # collective: every rank reads what its layout needs
    tensors = chatgen.core.dcp.read_full_tensors(directory)   # one process, no torch.distributed

A sharded state dict maps names to megatron `ShardedTensor`s (a local tensor plus where it sits in
the global one: `GPTModel.sharded_state_dict()`, `DistributedOptimizer.sharded_state_dict(...)`).
Saving writes each global tensor once, split over the ranks that hold it; loading asks for the
slices the *current* layout needs, so a checkpoint saved at one TP x PP x DP loads at another.

Three changes to how megatron does it:

- Writing happens in this process. megatron's torch_dist writer forks one writer process per file
  and starts a multiprocessing Manager, even for a synchronous save: a process that hosts a vLLM
  engine (colocated runs) should not fork, and a daemonic process (a test rank) cannot have
  children.
- Nothing is unpickled freely, so a tampered checkpoint cannot run code when it is loaded
  (chatgen.core.dcp: `.metadata` through an allow-list unpickler, bytes values and tensors with
  `torch.load(weights_only=True)`, as megatron's `common.pt` is by torch's default).
- Restoring the distributed optimizer's state into torch's AdamW (no Transformer Engine or Apex:
  every CPU run) gives each parameter its own restored step count: megatron 0.16 shares one step
  tensor between all of them (AdamW would then count it up once per parameter) and looks the step up
  in the checkpoint, which does not store it (`_restore_adamw_step_separately`).
"""

from chatgen.core.dcp import read_safely


def _strategies():
    """megatron's torch_dist save strategy writing in this process, and its load strategy
    (reading safely)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed import checkpoint as dcp

    read_safely()

    class InProcessSave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp.save(
                mcore_torch.mcore_to_pyt_state_dict(state, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=mcore_torch.MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                ),
            )

    return InProcessSave("torch_dist", 1), mcore_torch.TorchDistLoadShardedStrategy()


def save(sharded_state_dict: dict, directory) -> None:
    """Write `sharded_state_dict` into the existing directory `directory`; collective over every
    rank."""
    from megatron.core import dist_checkpointing

    save_strategy, _ = _strategies()
    dist_checkpointing.save(sharded_state_dict, str(directory), sharded_strategy=save_strategy)


def load(sharded_state_dict: dict, directory) -> dict:
    """The state `sharded_state_dict` asks for (its tensors filled in), read from `directory`;
    collective."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    _, load_strategy = _strategies()
    _restore_adamw_step_separately()
    try:
        return dist_checkpointing.load(
            sharded_state_dict, str(directory), sharded_strategy=load_strategy
        )
    except (
        CheckpointException
    ) as e:  # a BaseException in torch: an ordinary error here, like every other read error
        raise RuntimeError(f"torch.distributed.checkpoint could not read it: {e}") from e


def _restore_adamw_step_separately() -> None:
    """megatron's DistributedOptimizer, loading its `fully_reshardable` state into torch's AdamW
    (no Transformer Engine / Apex: every CPU run), sets every parameter's "step" to ONE shared
    tensor (AdamW then increments it once per parameter at the next step, so the bias correction
    of parameter k uses step + k), then copies each per-parameter state tensor from the
    checkpoint, "step" included, which that format does not store. Each parameter gets its own
    copy of the restored step instead, and the copy from the checkpoint skips it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    setter = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(setter, "_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[
                self.optimizer.param_groups[group_index]["params"][group_order]
            ]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        setter(self, model_param, tensors)

    set_states._keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
