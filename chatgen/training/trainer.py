"""`Trainer`: what every trainer backend (MegatronModule, FSDPModule) offers the run besides its
own steps: the memory handoff's declared entry points (its MemoryHandoff:
chatgen/training/memory.py), the device its parameters live on and how a batch becomes
micro-batches (chatgen/training/micro_batches.py)."""

import torch

from chatgen.core.train_batch import TrainBatch
from chatgen.module import Module, remote
from chatgen.training import micro_batches


class Trainer(Module):
    """A trainer backend's shared surface; a subclass sets `self.memory` (a MemoryHandoff with
    its backend's movers) in its __init__."""

    @remote("all")
    def offload(self, params: bool = True) -> None:
        """Before a colocated engine takes the GPU: the pieces of the training state the config's
        offload_* keys name (the weights only with `params`) to host memory; a no-op without
        CUDA. Not collective."""
        self.memory.offload(params)

    @remote("all")
    def onload(self, pieces=("params", "grads", "optimizer")) -> None:
        """Back to the GPU, what `offload` moved of `pieces` (a forward pass needs only the
        params). Not collective."""
        self.memory.onload(pieces)

    @remote("first")
    def memory_stats(self) -> dict:
        """`memory/*` figures since the last call, in GiB (MemoryHandoff.stats)."""
        return self.memory.stats()

    def micro_batch_plan(self, data, loss_fn=None, packs: bool = False, dp_group=None):
        """`data`'s micro-batches under this trainer's micro_batch_size or
        max_tokens_per_micro_batch (chatgen.training.micro_batches.plan_micro_batches), with
        loss_fn's pairs kept together; `packs`: the trainer packs each one."""
        cfg = self.config
        return micro_batches.plan_micro_batches(
            data,
            cfg.micro_batch_size or len(TrainBatch.of(data)),
            cfg.max_tokens_per_micro_batch,
            packs=packs,
            together=1 if loss_fn is None else micro_batches.rows_together(loss_fn),
            dp_group=dp_group,
        )

    def loss_weights(self, plan, loss_fn, dp_group=None) -> list | None:
        """Each micro-batch's weight in the step's loss under token micro-batches
        (micro_batches.loss_weights); None with fixed micro-batches: their mean."""
        if self.config.max_tokens_per_micro_batch is None:
            return None
        unit = micro_batches.loss_unit(loss_fn)
        return micro_batches.loss_weights(plan.micro_batches, unit, dp_group)

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the current CUDA device, or the CPU)."""
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
