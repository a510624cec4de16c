"""`MegatronModule`'s memory handoff: `offload()` / `onload()` move the training state to host
memory and back around a colocated engine's turn on the GPU; `memory_stats()` reports the peaks of
each phase.

`MemoryHandoff` is an object `chatgen.training.megatron_module.MegatronModule` holds
(`self.memory`): it keeps what is offloaded and each phase's peak itself, and reads the module's DDP
buffers and optimizer when it moves them; the module's `offload` / `onload` / `memory_stats` are its
declared entry points.

The optimizer's state moves through `move_optimizer_state`, not megatron's `offload_to_cpu` /
`restore_from_cpu`, which (megatron-core 0.16) replace every parameter of the optimizer by a
pageable host copy and back: the fp32 main weights of fp32 parameters (a bf16 model's norms, or a
whole fp32 model) are views of the model's weight buffer, and the copies stop sharing it (the
optimizer then updates weights the model never sees); Adam's step counters, host tensors, went to
the GPU (a device sync per parameter per step); each tensor was copied through pageable memory.
Weight buffers here include the expert-parallel ones (a mixture-of-experts model's experts).
"""

import torch


def weight_storages(ddp) -> set:
    """Data pointers of the model's weight buffers (dense and expert-parallel): an optimizer
    tensor that lives in one of them is a view of the weights, moved with them (offload_params),
    never copied apart."""
    return {
        b.param_data.untyped_storage().data_ptr()
        for b in _all_buffers(ddp)
        if b.param_data is not None
    }


def _all_buffers(ddp) -> list:
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", None) or [])


def move_optimizer_state(
    optimizers, host: dict, to_host: bool, shared: set, device, pin: bool
) -> None:
    """Move the tensors of torch optimizers (`optimizers`: their param groups' params and state)
    to host memory (`to_host`) or back to `device`. `host` keeps one host tensor per moved tensor
    across calls (pinned with `pin`: copies run asynchronously, and no host memory is allocated
    after the first offload). Tensors whose storage is in `shared` (views of the weight buffers)
    and Adam's "step" counters stay where they are."""

    def move(tensor, key):
        if tensor.untyped_storage().data_ptr() in shared:
            return tensor
        if to_host:
            if tensor.device.type == "cpu" and key in host and tensor is host[key]:
                return tensor
            copy = host.get(key)
            if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                copy = host[key] = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin
                )
            copy.copy_(tensor, non_blocking=pin)
            return copy
        return tensor.to(device, non_blocking=pin)

    for i, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                key = (i, g, j)
                state = optimizer.state.get(p, {})
                p.data = move(p.data, key)
                for name, value in state.items():
                    if isinstance(value, torch.Tensor) and name != "step":
                        state[name] = move(value, (*key, name))


class MemoryHandoff:
    """A trainer's training state between its turns on the GPU (see the module docstring); each
    backend says how a piece moves (`movers`), this keeps which pieces are away and each phase's
    peak."""

    def __init__(self, config, movers: dict):
        self.config = config
        # {piece: (to_host(), to_device())} in offload order; onload runs them in reverse. A piece
        # moves when the config's `offload_<piece>` key is true (a backend without the key never
        # moves it)
        self.movers = movers
        self.offloaded = ()  # what offload() moved to host memory
        self.peaks = {}  # phase -> peak bytes allocated (stats)

    def offload(self, params: bool = True) -> None:
        """Before a colocated engine takes the GPU: move the pieces the config names to host
        memory (with `params` false, not the weights) and return the cached blocks to the device,
        so the engine can use the memory. Every method that needs the state brings it back first
        (`onload`). A no-op without CUDA: everything already lives in host memory. Not
        collective."""
        if not torch.cuda.is_available():
            return
        moved = set(self.offloaded)
        torch.cuda.synchronize()
        for piece, (to_host, _) in self.movers.items():
            wanted = getattr(self.config, f"offload_{piece}", False) and (
                params or piece != "params"
            )
            if wanted and piece not in moved:
                to_host()
                moved.add(piece)
        torch.cuda.synchronize()
        if moved and not self.offloaded:  # the peak of the phase that ends here: this model's own
            self.peaks["trainer"] = max(
                self.peaks.get("trainer", 0), torch.cuda.max_memory_allocated()
            )
            torch.cuda.reset_peak_memory_stats()
        self.offloaded = tuple(sorted(moved))
        torch.cuda.empty_cache()

    def onload(self, pieces=("params", "grads", "optimizer")) -> None:
        """Bring back to the GPU what `offload` moved of `pieces` (a forward pass or a weight
        sync needs only the params). Not collective."""
        back = [piece for piece in self.offloaded if piece in pieces]
        if not back:
            return
        if len(back) == len(self.offloaded) or "params" in back:  # the offloaded phase ends here
            self.peaks["offloaded"] = max(
                self.peaks.get("offloaded", 0), torch.cuda.max_memory_allocated()
            )
            torch.cuda.reset_peak_memory_stats()
        for piece in reversed(list(self.movers)):
            if piece in back:
                self.movers[piece][1]()
        torch.cuda.synchronize()
        self.offloaded = tuple(piece for piece in self.offloaded if piece not in back)

    def stats(self) -> dict:
        """`memory/*` figures since the last call (then reset), in GiB. On GPU, this process's
        peak of memory allocated through torch: `memory/trainer_peak_gib` while this model held
        its state (forward passes, training, the sync), `memory/offloaded_peak_gib` while it was
        offloaded (a colocated engine generating; what vLLM allocates through torch), and
        `memory/device_used_gib` now (the whole device, every process). Without CUDA:
        `memory/host_peak_rss_gib`, the process's peak resident memory so far."""
        if not torch.cuda.is_available():
            import resource

            return {
                "memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                / 2**20
            }
        # (the phase still running)
        peaks, now = (
            self.peaks,
            "offloaded" if self.offloaded else "trainer",
        )
        peaks[now] = max(peaks.get(now, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        self.peaks = {}
        free, total = torch.cuda.mem_get_info()
        return {
            **{f"memory/{phase}_peak_gib": v / 2**30 for phase, v in peaks.items()},
            "memory/device_used_gib": (total - free) / 2**30,
        }


def megatron_movers(module) -> dict:
    """How a MegatronModule's pieces move: the gradient buffers are freed and come back zeroed
    (they hold nothing between steps); the distributed optimizer's fp32 masters and Adam moments
    go to pinned host memory (move_optimizer_state: its views of the weights stay in the weight
    buffers); the weights are views of megatron's buffers, moved whole. Read at each move:
    `module.ddp` is built by setup."""
    host = {}  # the optimizer's host copies, kept across offloads

    def optimizer(to_host: bool):
        inner = [chained.optimizer for chained in module.optimizer.chained_optimizers]
        shared = weight_storages(module.ddp)
        move_optimizer_state(
            inner, host, to_host, shared, torch.cuda.current_device(), pin=torch.cuda.is_available()
        )

    def params(to_host: bool):
        for buffer in _all_buffers(module.ddp):
            if to_host:
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            else:
                buffer.reload_from_cpu(move_params=True, move_grads=False)

    return {
        "grads": (
            lambda: module.ddp.offload_grad_buffers(synchronize=False, empty_cache=False),
            lambda: module.ddp.restore_grad_buffers(synchronize=False),
        ),
        "optimizer": (lambda: optimizer(True), lambda: optimizer(False)),
        "params": (lambda: params(True), lambda: params(False)),
    }
