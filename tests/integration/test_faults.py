"""Fault injection against real engines: what a run listens on, what a bad sync or a bad model leaves behind.

    python -m pytest tests/integration/test_faults.py        # ~1 min on 2 CPU cores

Each test reproduces one finding of issue 13 and asserts the fixed behaviour; docs/failure_and_security.md
describes the behaviour for users. (The faults without an engine are in the unit tests, marked `faults`.)
"""
import ipaddress
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]


def listeners(root: psutil.Process) -> list:
    """(process name, address, port) of every listening TCP socket of `root` and its descendants."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return address.is_loopback or getattr(address, "ipv4_mapped", None) is not None and address.ipv4_mapped.is_loopback


def test_a_ray_run_listens_on_loopback_only_and_leaves_nothing():
    """Ray as `chatgen train` starts it (runtime.launcher: ray, no ray_address), with a 2-rank actor group that
    joins its torch.distributed rendezvous: every listening socket of the process tree is on 127.0.0.1, and
    after shutdown no Ray process and no session directory is left."""
    import ray

    from chatgen.rlhf.runtime import ActorGroup, Runtime, init_ray, worker_env

    if ray.is_initialized():
        pytest.skip("Ray already runs in this process (started by another test module)")
    ray_dir = init_ray(None, 2)
    me = psutil.Process()
    try:
        group = ActorGroup(["a"], 2, 0, 0.5, worker_env())
        group.setup([])  # both ranks join a gloo world on the rendezvous of rank 0
        found = listeners(me)
        ray_processes = [p for p in me.children(recursive=True)]
        names = {name for name, _, _ in found}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::ModelWorker") for n in names), found
        exposed = [entry for entry in found if not is_loopback(entry[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        assert Path(ray_dir).is_dir() and any(Path(ray_dir).iterdir())
    finally:
        Runtime([group] if "group" in locals() else [], {}, ray_dir).shutdown()
    assert not Path(ray_dir).exists()  # no /tmp/ray session directory left behind
    gone, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, f"Ray processes left after shutdown: {[p.name() for p in alive]}"
