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

Each rank is a fresh interpreter (multiprocessing's spawn). A caller that starts many jobs (the test
suite) can call `fork_ranks_from(modules)` once: later ranks are forked from one server process
that imported those modules when it started (multiprocessing's forkserver), still one fresh process
per rank and job, seeing the caller's current environment and stdout/stderr as a spawned one does.
"""

import atexit
import os
import queue
import sys
import time
import traceback
from multiprocessing import reduction

import torch.multiprocessing as mp

from chatgen.core import quiet
from chatgen.core.distributed import free_port

# A spawned rank imports this module first, while it unpickles its process object (`_child` comes
# before `fn`, whose module imports megatron-core: ~9 harmless notices per rank, which the parent's
# CLI filters in itself); multiprocessing marks that phase with `_inheriting` (parent_process() is
# set only afterwards).
if getattr(mp.current_process(), "_inheriting", False) or mp.parent_process() is not None:
    quiet.apply()


class _CallersView:
    """What a spawned rank inherits from its caller and a forked one would take from the server
    instead: the caller's environment now and its stdout/stderr (passed as descriptors)."""

    def __init__(self):
        self.environ = dict(os.environ)

    def __reduce__(self):  # (pickled while the rank starts: DupFd hands the descriptors over)
        return _adopt, (self.environ, reduction.DupFd(1), reduction.DupFd(2))


def _adopt(environ, stdout, stderr):
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout.detach(), 1)
    os.dup2(stderr.detach(), 2)
    os.environ.clear()
    os.environ.update(environ)
    return True


def _forked_child(adopted, rank, world_size, port, env, fn, args, results):
    """A rank forked from the server: the caller's view (`_adopt`, unpickled first) is in place."""
    quiet.apply()  # (its environment defaults: the caller's environment replaced the server's)
    if "torch" in sys.modules:  # the server's torch read OMP_NUM_THREADS unset; a job's env has it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _child(rank, world_size, port, env, fn, args, results)
    # a forked process ends in os._exit, a spawned one by the interpreter's exit: its atexit
    # handlers (what the job registered, e.g. vLLM's) run here
    atexit._run_exitfuncs()


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
        forked = self.context.get_start_method() == "forkserver"
        if forked:
            start_server()
        self._procs = [
            self.context.Process(
                target=_forked_child if forked else _child,
                args=((_CallersView(),) if forked else ())
                + (r, world_size, port, env, fn, args, self._results),
                daemon=True,
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


_server_environ = {}  # the environment the server starts in, until it has started


def fork_ranks_from(modules: list, pythonpath: tuple = ()) -> None:
    """Start the ranks of later jobs by forking a server that imports `modules` once (seconds of
    torch / megatron-core imports less per rank). The server starts with the first such job, in
    this process's environment of now with `pythonpath` first on PYTHONPATH (where `modules` are)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(modules))
    DistributedJob.context = context
    path = [*map(str, pythonpath), os.environ.get("PYTHONPATH", "")]
    _server_environ.update(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))


def start_server() -> None:
    """Start the server of fork_ranks_from now (it imports its modules in the background), in the
    environment fork_ranks_from recorded (a test may have changed this process's since; each rank
    takes the caller's of its own start: _CallersView); the first job does otherwise."""
    from multiprocessing import forkserver

    if not _server_environ:
        return
    saved, streams = dict(os.environ), (os.dup(1), os.dup(2))
    os.environ.clear()
    os.environ.update(_server_environ)
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the server's imports say is nobody's news (its ranks write the
    os.dup2(devnull, 2)  # caller's output)
    try:
        forkserver.ensure_running()
    finally:
        for fd, stream in zip((1, 2), streams):
            os.dup2(stream, fd)
            os.close(stream)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(saved)
    _server_environ.clear()


def ctx_queue():
    """A queue that can be passed to the ranks of a DistributedJob."""
    return DistributedJob.context.Queue()


def run_distributed(
    fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 600.0
) -> list:
    """Run `fn(*args)` on `world_size` spawned ranks; returns the list of per-rank results."""
    return DistributedJob(fn, world_size, args, env).join(timeout)
