"""`Trainer`: what every trainer backend (MegatronModule, FSDPModule) offers the run besides its
own steps: the memory handoff's declared entry points (its MemoryHandoff:
chatgen/training/memory.py) and the device its parameters live on."""

import torch

from chatgen.module import Module, remote


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

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the current CUDA device, or the CPU)."""
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
