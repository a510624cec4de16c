"""`MegatronModule`'s memory handoff: `offload()` / `onload()` move the training state to host memory and back
around a colocated engine's turn on the GPU; `memory_stats()` reports the peaks of each phase.

`MemoryHandoff` is a mixin of `chatgen.training.megatron_module.MegatronModule` (its DDP buffers and optimizer).
"""
import torch


class MemoryHandoff:
    """offload / onload / memory_stats; `self._offloaded` and `self._memory_peaks` are set by the class."""

    def offload(self, params: bool = True) -> None:
        """Before a colocated engine takes the GPU: move the training state the config names to host memory
        (`offload_grads`: the gradient buffers are freed, they hold nothing between steps; `offload_optimizer`:
        fp32 main weights and Adam moments; `offload_params`, when `params`: the weights) and return the cached
        blocks to the device (torch.cuda.empty_cache), so the engine can use the memory. Every method that needs
        the state brings it back first (`onload`). A no-op without CUDA: everything already lives in host memory.
        Not collective."""
        if not torch.cuda.is_available():
            return
        cfg, moved = self.config, set(self._offloaded)
        torch.cuda.synchronize()
        if cfg.offload_grads and "grads" not in moved:
            self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
            moved.add("grads")
        if cfg.offload_optimizer and "optimizer" not in moved:
            self.optimizer.offload_to_cpu()
            moved.add("optimizer")
        if params and cfg.offload_params and "params" not in moved:
            for buffer in self.ddp.buffers:  # the weights are views of these buffers
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            moved.add("params")
        torch.cuda.synchronize()
        if moved and not self._offloaded:  # the peak of the phase that ends here: this model's own
            self._memory_peaks["trainer"] = max(self._memory_peaks.get("trainer", 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        self._offloaded = tuple(sorted(moved))
        torch.cuda.empty_cache()

    def onload(self, pieces=("params", "grads", "optimizer")) -> None:
        """Bring back to the GPU what `offload` moved of `pieces` (gradient buffers come back zeroed): a forward
        pass or a weight sync needs only the params. Not collective."""
        back = [piece for piece in self._offloaded if piece in pieces]
        if not back:
            return
        if len(back) == len(self._offloaded) or "params" in back:  # the offloaded phase ends here
            self._memory_peaks["offloaded"] = max(self._memory_peaks.get("offloaded", 0),
                                                  torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        if "params" in back:
            for buffer in self.ddp.buffers:
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        if "optimizer" in back:
            self.optimizer.restore_from_cpu()
        if "grads" in back:
            self.ddp.restore_grad_buffers(synchronize=False)
        torch.cuda.synchronize()
        self._offloaded = tuple(piece for piece in self._offloaded if piece not in back)

    def memory_stats(self) -> dict:
        """`memory/*` figures since the last call (then reset), in GiB. On GPU, this process's peak of memory
        allocated through torch: `memory/trainer_peak_gib` while this model held its state (forward passes,
        training, the sync), `memory/offloaded_peak_gib` while it was offloaded (a colocated engine generating;
        what vLLM allocates through torch), and `memory/device_used_gib` now (the whole device, every process).
        Without CUDA: `memory/host_peak_rss_gib`, the process's peak resident memory so far."""
        if not torch.cuda.is_available():
            import resource

            return {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        peaks, now = self._memory_peaks, "offloaded" if self._offloaded else "trainer"  # (the phase still running)
        peaks[now] = max(peaks.get(now, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        self._memory_peaks = {}
        free, total = torch.cuda.mem_get_info()
        return {**{f"memory/{phase}_peak_gib": v / 2**30 for phase, v in peaks.items()},
                "memory/device_used_gib": (total - free) / 2**30}
