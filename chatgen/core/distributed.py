"""torch.distributed rendezvous that stays on this machine unless told otherwise.

torch's `TCPStore` server listens on every network interface, whatever host name it is given, so a
plain `init_process_group(init_method="tcp://127.0.0.1:PORT")` opens PORT to the whole network.
chatgen binds the listening socket itself to the address the host names and hands it to the store
(`master_listen_fd`): a loopback host keeps the rendezvous on this machine, a node's address (a
multi-node Ray cluster, `chatgen serve --host`) on that interface only. Only a wildcard host
("0.0.0.0", "::") listens everywhere.

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
    """A `TCPStore`; as the server it listens on the address `host` names only (loopback for a
    loopback host). Port 0 (server on a named host only): a port the OS picks as the store binds
    it, so no other process can take it between a `free_port()` and the bind (that race failed
    one-rank trainers while a test suite ran)."""
    listen_fd = None
    if is_server and host not in ("0.0.0.0", "::", ""):
        family, _, _, _, address = socket.getaddrinfo(
            "127.0.0.1" if host == "localhost" else host, port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        port = sock.getsockname()[1]
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_server,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def init_process_group(
    backend: str, rank: int, world_size: int, host: str, port: int, timeout=DEFAULT_TIMEOUT
) -> None:
    """`dist.init_process_group` over a `tcp_store` (rank 0 serves it)."""
    store = tcp_store(host, port, world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def join_world() -> None:
    """Join torch.distributed unless joined: NCCL on GPU (this process's LOCAL_RANK device), gloo
    on CPU. Launched ranks (`torchrun`, chatgen.training.launcher, Ray actors) give RANK /
    WORLD_SIZE / MASTER_ADDR / MASTER_PORT; a lone process gets a private one-rank world on a
    port picked as it is bound. Every trainer backend starts here."""
    import os

    import torch

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    env = os.environ
    if "RANK" in env and "MASTER_PORT" in env:
        init_process_group(
            backend,
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env["MASTER_PORT"]),
        )
    else:
        init_process_group(backend, 0, 1, "127.0.0.1", 0)
