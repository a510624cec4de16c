"""Run one function in N fresh processes joined by torch.distributed env vars (a tiny `torchrun`).

    from chatgen.training.launcher import run_distributed
    results = run_distributed(my_fn, world_size=2, args=(x,))   # [result of rank 0, result of rank 1]
    job = DistributedJob(my_fn, 2, args=(q,)); ...parent work...; results = job.join()

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, plus
`env`, then calls `fn(*args)`; `fn` must be importable (module level) and return something
picklable. If a rank raises, the others are stopped and a RuntimeError carries that rank's
traceback; a rank that dies without one (killed by the OS) is reported within about a second, with
its exit code. Used by the multi-process tests and by `chatgen check-sync` for layouts that need
several trainer ranks.
"""

import os
import queue
import time
import traceback

import torch.multiprocessing as mp

from chatgen.core import quiet
from chatgen.core.distributed import free_port

# A spawned rank imports this module first, while it unpickles its process object (`_child` comes
# before `fn`, whose module imports megatron-core: ~9 harmless notices per rank, which the parent's
# CLI filters in itself); multiprocessing marks that phase with `_inheriting` (parent_process() is
# set only afterwards).
if getattr(mp.current_process(), "_inheriting", False) or mp.parent_process() is not None:
    quiet.apply()


def _child(rank, world_size, port, env, fn, args, results):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


class DistributedJob:
    """`fn(*args)` running on `world_size` spawned ranks; `join()` returns the per-rank results.

    Start it, do the parent's side of the work (e.g. host an inference engine the ranks talk to),
    join. Pass `ctx_queue()` queues in `args` to exchange data with the ranks while they run.
    """

    context = mp.get_context("spawn")

    def __init__(self, fn, world_size: int, args: tuple = (), env: dict | None = None):
        self.fn, self.world_size = fn, world_size
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self._results = self.context.Queue()
        self._done = {}
        port = free_port()
        self._procs = [
            self.context.Process(
                target=_child, args=(r, world_size, port, env, fn, args, self._results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def poll(self) -> bool:
        """True while the ranks run; raises the traceback of a rank that failed (without
        waiting)."""
        while True:
            try:
                rank, ok, value = self._results.get_nowait()
            except queue.Empty:
                break
            if not ok:
                self.stop()
                raise RuntimeError(
                    f"rank {rank} of {self.world_size} failed in {self.fn.__name__}:\n{value}"
                )
            self._done[rank] = value
        self._raise_if_a_rank_died()
        return len(self._done) < self.world_size and any(p.is_alive() for p in self._procs)

    def _raise_if_a_rank_died(self) -> None:
        """A rank that exited without a result (killed by the OS, os._exit): stop the others and
        say which."""
        dead = [r for r, p in enumerate(self._procs) if r not in self._done and not p.is_alive()]
        # a rank's result is in the queue before its process ends
        if dead and self._results.empty():
            self.stop()
            code = self._procs[dead[0]].exitcode
            why = (
                f"killed by signal {-code}"
                if code is not None and code < 0
                else f"exit code {code}"
            )
            raise RuntimeError(
                f"rank {dead[0]} of {self.world_size} died in {self.fn.__name__} without a result "
                f"({why}; -9 is often the OOM killer); see its output above"
            )

    def join(self, timeout: float = 600.0) -> list:
        out = self._done
        deadline = time.monotonic() + timeout
        try:
            while len(out) < self.world_size:
                try:  # short waits, so a dead rank is noticed within a second, not after `timeout`
                    rank, ok, value = self._results.get(timeout=1.0)
                except queue.Empty:
                    self._raise_if_a_rank_died()
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{self.fn.__name__}: no answer within {timeout:.0f}s from ranks "
                            f"{sorted(set(range(self.world_size)) - set(out))}"
                        ) from None
                    continue
                if not ok:
                    raise RuntimeError(
                        f"rank {rank} of {self.world_size} failed in {self.fn.__name__}:\n{value}"
                    )
                out[rank] = value
        finally:
            # let finished ranks clean up (vLLM shm)
            self.stop(grace=60 if len(out) == self.world_size else 0.1)
        return [out[r] for r in range(self.world_size)]

    def stop(self, grace: float = 0.1) -> None:
        """Stop the ranks that are still running (this job's own processes only)."""
        for p in self._procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()


def ctx_queue():
    """A queue that can be passed to the ranks of a DistributedJob."""
    return DistributedJob.context.Queue()


def run_distributed(
    fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 600.0
) -> list:
    """Run `fn(*args)` on `world_size` spawned ranks; returns the list of per-rank results."""
    return DistributedJob(fn, world_size, args, env).join(timeout)
