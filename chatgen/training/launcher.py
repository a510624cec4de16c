"""Run one function in N fresh processes joined by torch.distributed env vars (a tiny `torchrun`).

    from chatgen.training.launcher import run_distributed
    results = run_distributed(my_fn, world_size=2, args=(x,))   # [result of rank 0, result of rank 1]

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, plus `env`,
then calls `fn(*args)`; `fn` must be importable (module level) and return something picklable. If a
rank raises, the others are stopped and a RuntimeError carries that rank's traceback. Used by the
multi-process tests and by `chatgen check-sync` for layouts that need several trainer ranks.
"""
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, env, fn, args, results):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, args: tuple = (), env: dict | None = None, timeout: float = 600.0):
    """Run `fn(*args)` on `world_size` spawned ranks; returns the list of per-rank results."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, env, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"run_distributed({fn.__name__}): no answer within {timeout:.0f}s "
                                   f"from ranks {sorted(set(range(world_size)) - set(out))}") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
