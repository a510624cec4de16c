"""`MegatronModule`'s memory handoff: `offload()` / `onload()` move the training state to host memory and back
around a colocated engine's turn on the GPU; `memory_stats()` reports the peaks of each phase.

`MemoryHandoff` is an object `chatgen.training.megatron_module.MegatronModule` holds (`self.memory`): it keeps
what is offloaded and each phase's peak itself, and reads the module's DDP buffers and optimizer when it moves
them; the module's `offload` / `onload` / `memory_stats` are its declared entry points.

The optimizer's state moves through `move_optimizer_state`, not megatron's `offload_to_cpu` / `restore_from_cpu`,
which (megatron-core 0.16) replace every parameter of the optimizer by a pageable host copy and back: the fp32
main weights of fp32 parameters (a bf16 model's norms, or a whole fp32 model) are views of the model's weight
buffer, and the copies stop sharing it (the optimizer then updates weights the model never sees); Adam's step
counters, host tensors, went to the GPU (a device sync per parameter per step); each tensor was copied through
pageable memory. Weight buffers here include the expert-parallel ones (a mixture-of-experts model's experts).
"""

import torch


def weight_storages(ddp) -> set:
    """Data pointers of the model's weight buffers (dense and expert-parallel): an optimizer tensor that lives in
    one of them is a view of the weights, moved with them (offload_params), never copied apart."""
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
    """Move the tensors of torch optimizers (`optimizers`: their param groups' params and state) to host memory
    (`to_host`) or back to `device`. `host` keeps one host tensor per moved tensor across calls (pinned with `pin`:
    copies run asynchronously, and no host memory is allocated after the first offload). Tensors whose storage is
    in `shared` (views of the weight buffers) and Adam's "step" counters stay where they are."""

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
    """A Megatron trainer's training state between its turns on the GPU (see the module docstring)."""

    def __init__(self, config, parts):
        self.config = config
        self.parts = (
            parts  # () -> (megatron DDP, its distributed optimizer), built by the module's setup
        )
        self.offloaded = ()  # what offload() moved to host memory
        self.peaks = {}  # phase -> peak bytes allocated (stats)
        self.optimizer_host = {}  # the host copies of the optimizer's tensors, kept across offloads

    def offload(self, params: bool = True) -> None:
        """Before a colocated engine takes the GPU: move the training state the config names to host memory
        (`offload_grads`: the gradient buffers are freed, they hold nothing between steps; `offload_optimizer`:
        fp32 main weights and Adam moments; `offload_params`, when `params`: the weights) and return the cached
        blocks to the device (torch.cuda.empty_cache), so the engine can use the memory. Every method that needs
        the state brings it back first (`onload`). A no-op without CUDA: everything already lives in host memory.
        Not collective."""
        if not torch.cuda.is_available():
            return
        (ddp, _), cfg, moved = self.parts(), self.config, set(self.offloaded)
        torch.cuda.synchronize()
        if cfg.offload_grads and "grads" not in moved:
            ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
            moved.add("grads")
        if cfg.offload_optimizer and "optimizer" not in moved:
            self.move_optimizer(to_host=True)
            moved.add("optimizer")
        if params and cfg.offload_params and "params" not in moved:
            # the weights are views of these buffers (pinned copies)
            for buffer in _all_buffers(ddp):
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            moved.add("params")
        torch.cuda.synchronize()
        if moved and not self.offloaded:  # the peak of the phase that ends here: this model's own
            self.peaks["trainer"] = max(
                self.peaks.get("trainer", 0), torch.cuda.max_memory_allocated()
            )
            torch.cuda.reset_peak_memory_stats()
        self.offloaded = tuple(sorted(moved))
        torch.cuda.empty_cache()

    def onload(self, pieces=("params", "grads", "optimizer")) -> None:
        """Bring back to the GPU what `offload` moved of `pieces` (gradient buffers come back zeroed): a forward
        pass or a weight sync needs only the params. Not collective."""
        back = [piece for piece in self.offloaded if piece in pieces]
        if not back:
            return
        ddp, _ = self.parts()
        if len(back) == len(self.offloaded) or "params" in back:  # the offloaded phase ends here
            self.peaks["offloaded"] = max(
                self.peaks.get("offloaded", 0), torch.cuda.max_memory_allocated()
            )
            torch.cuda.reset_peak_memory_stats()
        if "params" in back:
            for buffer in _all_buffers(ddp):
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        if "optimizer" in back:
            self.move_optimizer(to_host=False)
        if "grads" in back:
            ddp.restore_grad_buffers(synchronize=False)
        torch.cuda.synchronize()
        self.offloaded = tuple(piece for piece in self.offloaded if piece not in back)

    def _move_optimizer(self, to_host: bool) -> None:
        """The distributed optimizer's fp32 masters and Adam moments to pinned host memory or back (see
        move_optimizer_state); its views of the weights stay in the weight buffers."""
        inner = [chained.optimizer for chained in self.optimizer.chained_optimizers]
        host = self.__dict__.setdefault("_optimizer_host", {})
        move_optimizer_state(
            inner,
            host,
            to_host,
            weight_storages(self.ddp),
            torch.cuda.current_device(),
            pin=torch.cuda.is_available(),
        )

    def stats(self) -> dict:
        """`memory/*` figures since the last call (then reset), in GiB. On GPU, this process's peak of memory
        allocated through torch: `memory/trainer_peak_gib` while this model held its state (forward passes,
        training, the sync), `memory/offloaded_peak_gib` while it was offloaded (a colocated engine generating;
        what vLLM allocates through torch), and `memory/device_used_gib` now (the whole device, every process).
        Without CUDA: `memory/host_peak_rss_gib`, the process's peak resident memory so far."""
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
