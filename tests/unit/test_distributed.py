"""Rendezvous stays on this machine: chatgen's TCPStore server listens on loopback only (torch's own listens
on every interface whatever host it is given)."""

import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from chatgen.core.distributed import free_port, init_process_group
from chatgen.training.launcher import run_distributed


def _listening_addresses(pid: int) -> list:
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def _all_reduce_and_report():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_process_group(
        "gloo", rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    )
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    addresses = _listening_addresses(os.getpid())
    dist.barrier()
    dist.destroy_process_group()
    return t.item(), addresses


needs_ss = pytest.mark.skipif(
    subprocess.run(["which", "ss"], capture_output=True).returncode != 0,
    reason="needs `ss` (iproute2) to list listening sockets",
)


@pytest.fixture
def spawned_ranks(monkeypatch):
    """Ranks started as `chatgen check-sync` starts them, fresh interpreters (the suite forks the
    others from a server: tests/conftest.py)."""
    import multiprocessing

    from chatgen.training import launcher

    monkeypatch.setattr(launcher.DistributedJob, "context", multiprocessing.get_context("spawn"))


@needs_ss
def test_two_rank_gloo_group_listens_on_loopback_only(spawned_ranks):
    results = run_distributed(_all_reduce_and_report, 2)
    assert [total for total, _ in results] == [3.0, 3.0]  # the group works
    addresses = [a for _, listening in results for a in listening]
    assert addresses, "expected the rank-0 store and gloo to listen somewhere"
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@needs_ss
def test_plain_torch_store_would_listen_everywhere():
    # Guards the reason this module exists: if torch starts honouring the host, tcp_store can be simplified.
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    try:
        listening = [a for a in _listening_addresses(os.getpid()) if a.endswith(f":{port}")]
        assert listening and not listening[0].startswith("127.0.0.1:"), listening
    finally:
        del store


def _rank_1_dies():
    import time

    if os.environ["RANK"] == "1":
        os._exit(3)  # as if killed by the OS: no traceback, no result
    time.sleep(60)  # rank 0 would wait on rank 1 in a collective
    return "unreachable"


def test_a_rank_that_dies_is_reported_in_seconds_with_its_exit_code():
    import time

    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank 1 of 2 died in _rank_1_dies without a result \(exit code 3"
    ):
        run_distributed(_rank_1_dies, 2, timeout=120)
    assert time.monotonic() - start < 30
