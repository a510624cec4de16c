"""torch.distributed rendezvous that stays on this machine unless told otherwise.

torch's `TCPStore` server listens on every network interface, whatever host name it is given, so a plain
`init_process_group(init_method="tcp://127.0.0.1:PORT")` opens PORT to the whole network. chatgen binds the
listening socket itself when the host is a loopback address and hands it to the store
(`master_listen_fd`): the rendezvous is then reachable from this machine only. A non-loopback host (a
multi-node Ray cluster, set explicitly in the config) is used as given.

    store = tcp_store("127.0.0.1", port, world_size=2, is_server=True)
    init_process_group("gloo", rank, world_size, "127.0.0.1", port)
"""
import datetime
import socket

import torch.distributed as dist

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world_size: int, is_server: bool, timeout=DEFAULT_TIMEOUT):
    """A `TCPStore`; as the server on a loopback host it listens on loopback only."""
    listen_fd = None
    if is_server and host in LOOPBACK_HOSTS:
        family = socket.AF_INET6 if host == "::1" else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::1" if host == "::1" else "127.0.0.1", port))
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(host, port, world_size, is_server, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listen_fd)


def init_process_group(backend: str, rank: int, world_size: int, host: str, port: int,
                       timeout=DEFAULT_TIMEOUT) -> None:
    """`dist.init_process_group` over a `tcp_store` (rank 0 serves it)."""
    store = tcp_store(host, port, world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
