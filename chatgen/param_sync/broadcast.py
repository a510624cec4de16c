"""One trainer -> every engine rank of every replica: the weight sync of a generation group on its own devices.

Over the network (any nodes): one torch.distributed group of 1 + N members, the trainer's rank 0 and the N engine
ranks, and one broadcast per bucket (gloo on CPU, NCCL on GPU), so the trainer sends each byte once whatever N:

    # trainer: every rank constructs it (global rank 0 hosts the rendezvous and sends; the others take part in
    # gathering the weights); then every member joins, each from its own process
    tx = BroadcastSender(token, 1 + N, host="127.0.0.1")           # rank 0 listens: tx.host, tx.port
    tx.connect()                         |    rx = BroadcastReceiver(tx.host, tx.port, i, 1 + N, token)   # i = 1..N
    tx.send(trainer)                     |    rx.receive_into(policy)          # per sync, both sides at once

On one host: the trainer writes the weights once into shared memory and every engine reads them there:

    handles = ipc.write(trainer)         # IpcSender, every trainer rank; handles from rank 0
    load_ipc(policy, handles, token)     # every engine rank (update_weights_via_ipc), then ipc.close()

Both carry the checks of chatgen.param_sync.sync: the manifest against each engine's architecture and every
weight finite before a byte is written (each engine rank gives its verdict, and any refusal stops the sync for
all: every engine keeps its old weights), the bucket stream checked against the manifest, exact fingerprints on
a validating sync. Authentication: the driver gives every member a shared secret `token` (through Ray, whose own
channel is authenticated). Before each sync, over the group's own connections (the ones the weights take), every
member proves the token (fresh nonces from all, then an HMAC-SHA256 of them from each, checked by all:
chatgen.param_sync.sync's `_authenticate`); a member that cannot stops the sync at every member before the
header is read. The trainer also signs the header (HMAC-SHA256 of its JSON), which is all the shared-memory
path has: an engine refuses a header it cannot verify before anything is written. So a process that reaches
the rendezvous without the token cannot write weights. The rendezvous listens on loopback on one machine, on
the node's address in a cluster: keep the cluster's network private (docs/failure_and_security.md); the data
itself is not encrypted.
"""
import hashlib
import hmac
import json
import mmap
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from chatgen.core.distributed import free_port, tcp_store
from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel, slices, unflatten_buckets
from chatgen.param_sync.sync import (
    _DTYPES,
    SyncError,
    SyncReport,
    _authenticate,
    _bcast,
    _checked,
    _device,
    _load,
    _send_json,
    _share,
    check_header,
    sync_header,
    weight_source,
)
from chatgen.param_sync.sync import (
    _TRAINER_TIMEOUT as _TIMEOUT,
)


def _signature(header: dict, token: str) -> str:
    body = json.dumps({k: v for k, v in header.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def signed(header: dict, token: str) -> dict:
    """`header` (a sync_header) with its signature under `token`."""
    return {**header, "signature": _signature(header, token)}


def verify(header: dict, token: str) -> None:
    """SyncError unless `header` was signed with `token`."""
    if not hmac.compare_digest(str(header.get("signature", "")), _signature(header, token)):
        raise SyncError("weight sync refused, the engine keeps its old weights: the header is not signed with this "
                        "run's token (a process other than the run's trainer reached the weight channel)")


def _group(store, rank: int, world_size: int):
    """The members' own torch.distributed group, independent of any default group (NCCL on GPU)."""
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, _TIMEOUT)


def _verdicts(pg, mine, me: int, world_size: int) -> list:
    """Every engine rank's verdict ({"error": None or why}) on every member, one small broadcast per engine rank."""
    return [_send_json(pg, mine if me == r else None, root=r, me=me) for r in range(1, world_size)]


def _refusal(verdicts: list) -> str | None:
    """One message for every engine rank that refused, or None when all took the weights."""
    bad = [(r, v["error"]) for r, v in enumerate(verdicts, 1) if v["error"]]
    if not bad:
        return None
    return (f"{len(bad)} of {len(verdicts)} engine rank(s) refused the weight sync; " +
            "; ".join(f"engine rank {r}: {why}" for r, why in bad[:4]))


class BroadcastSender:
    """Trainer end of a group of `world_size` members (this trainer's rank 0 + the engine ranks): construct on every
    trainer rank; global rank 0 hosts the rendezvous on `host` (port 0: a free one) from construction on and
    broadcasts, the other ranks take part in reading the weights (`weight_source` is collective)."""

    def __init__(self, token: str, world_size: int, host: str = "127.0.0.1", port: int = 0):
        self.token, self.world_size, self.host, self._pg = token, world_size, host, None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.port = self._store = None
        if self.rank == 0:
            if not port and host in ("0.0.0.0", "::", ""):  # a named host binds port 0 itself (tcp_store)
                port = free_port(host)
            self._store = tcp_store(host, port, world_size, is_server=True, timeout=_TIMEOUT)
            self.port = self._store.port

    def connect(self) -> None:
        """Join the group; blocks until every engine rank joined too (`BroadcastReceiver`)."""
        if self.rank == 0:
            self._pg = _group(self._store, 0, self.world_size)

    def send(self, source, bucket_bytes: int = DEFAULT_BUCKET_BYTES, validate: bool = False) -> SyncReport:
        """Broadcast `source`'s weights (see chatgen.param_sync.weight_source) to every engine rank; collective
        over the source's ranks. SyncError when any engine refused (every engine keeps its old weights) or
        failed to load (that engine says whether it is partially updated)."""
        start = time.perf_counter()
        me = self.rank
        weights = weight_source(source, bucket_bytes)
        header = sync_header(weights, validate)  # collective over the trainer's ranks
        refusal = None
        if me == 0:
            try:  # over the connections the weights take: every member proves the token, before each sync
                _authenticate(self._pg, self.token, 0, world_size=self.world_size)
            except SyncError as e:
                refusal = str(e)
            else:
                _send_json(self._pg, signed(header, self.token), root=0, me=0)
                refusal = _refusal(_verdicts(self._pg, None, 0, self.world_size))
        refusal = _share({"error": refusal})["error"]
        if refusal:
            raise SyncError(refusal)
        n = 0
        try:
            for items in _checked(weights.buckets(), weights.plan, weights, validate):
                if me == 0:  # status 0: a bucket follows
                    _bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=_device()), root=0)
                    _bcast(self._pg, torch.cat([t.reshape(-1) for _, t in items]).to(_device()), root=0)
                n += len(items)
        except Exception as e:
            if me == 0:  # status 1: abort, and why
                _bcast(self._pg, torch.ones(1, dtype=torch.int64, device=_device()), root=0)
                _send_json(self._pg, f"{type(e).__name__}: {e}", root=0, me=0)
            raise
        result = _refusal(_verdicts(self._pg, None, 0, self.world_size)) if me == 0 else None
        result = _share({"error": result})["error"]
        if result:
            raise SyncError(result)
        itemsize = torch.empty((), dtype=weights.dtype).element_size()
        return SyncReport(time.perf_counter() - start, sum(numel(s) for b in weights.plan for _, s in b) * itemsize,
                          n, len(weights.plan), validate)


class BroadcastReceiver:
    """Engine end: member `rank` (1..world_size-1) of the group hosted at host:port; joins at construction
    (blocks until every member joined)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, token: str):
        self.rank, self.world_size, self.token = rank, world_size, token
        self._pg = _group(tcp_store(host, port, world_size, is_server=False, timeout=_TIMEOUT), rank, world_size)

    def receive_into(self, target, mode: str = "wait") -> SyncReport:
        """Receive one sync and load it into `target` (a generation module: chatgen.generation.base); blocks
        until the trainer sends. mode: what the target does with requests in flight (`load_weights`)."""
        start, pg, me = time.perf_counter(), self._pg, self.rank
        _authenticate(pg, self.token, me, world_size=self.world_size)  # SyncError: the old weights stay
        header = _send_json(pg, None, root=0, me=me)
        try:
            verify(header, self.token)
            check_header(header, target)
            mine = None
        except SyncError as e:
            mine = str(e)
        refusal = _refusal(_verdicts(pg, {"error": mine}, me, self.world_size))
        if refusal:
            raise SyncError(mine or f"weight sync refused, this engine keeps its old weights: {refusal}")
        dtype = _DTYPES[header["dtype"]]
        received = {"buckets": 0, "bytes": 0, "aborted": False}

        def next_flat(shapes):
            if int(_bcast(pg, torch.zeros(1, dtype=torch.int64, device=_device()), root=0)):
                received["aborted"] = True
                raise SyncError(f"the trainer aborted the sync: {_send_json(pg, None, root=0, me=me)}")
            flat = _bcast(pg, torch.empty(sum(numel(s) for s in shapes), dtype=dtype, device=_device()), root=0)
            received["buckets"] += 1
            received["bytes"] += flat.numel() * flat.element_size()
            return flat

        plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
        error = None
        try:
            received_buckets = unflatten_buckets(plan, next_flat)
            n = _load(target, _checked(received_buckets, plan, fingerprints=header["fingerprints"]), mode)
        except SyncError as e:
            if received["aborted"]:  # the trainer raised too, and sends nothing more
                raise
            error = e
            for bucket in header["buckets"][received["buckets"]:]:  # drain: keep every member in step
                next_flat([tuple(s) for _, s in bucket])
        _verdicts(pg, {"error": None if error is None else str(error)}, me, self.world_size)
        if error is not None:
            raise error
        return SyncReport(time.perf_counter() - start, received["bytes"], n, len(plan), bool(header["validated"]))


class IpcSender:
    """Trainer end of a same-host sync through shared memory: the weights written once into a file of a private
    directory in /dev/shm (0700, the file 0600), which every engine rank on this host maps. Construct on every
    trainer rank; global rank 0 writes."""

    def __init__(self, token: str, root: str = "/dev/shm"):
        self.token, self.root, self.directory = token, root, None
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def write(self, source, bucket_bytes: int = DEFAULT_BUCKET_BYTES, validate: bool = False) -> dict | None:
        """Write `source`'s weights; returns the handles every engine rank loads (`load_ipc`) on rank 0, None on
        the other ranks. Collective over the source's ranks."""
        weights = weight_source(source, bucket_bytes)
        header = sync_header(weights, validate)
        if self.rank != 0:
            for _ in _checked(weights.buckets(), weights.plan, weights, validate):  # the collective reads
                pass
            return None
        self.close()
        self.directory = tempfile.mkdtemp(prefix="chatgen-refit-", dir=self.root)  # mode 0700
        path = os.path.join(self.directory, "weights")
        nbytes = sum(numel(s) for b in weights.plan for _, s in b) * torch.empty((), dtype=weights.dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now rather than SIGBUS while copying
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        flat, offset = torch.frombuffer(mapping, dtype=weights.dtype), 0
        for items in _checked(weights.buckets(), weights.plan, weights, validate):
            for _, t in items:
                flat[offset:offset + t.numel()].view(t.shape).copy_(t)
                offset += t.numel()
        del flat
        mapping.close()
        return {"path": path, "header": signed(header, self.token)}

    def close(self) -> None:
        """Remove the last file written (once every engine loaded it; `write` also removes the one before)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def load_ipc(target, handles: dict, token: str, mode: str = "wait") -> SyncReport:
    """Engine end of `IpcSender`: verify the trainer's signed header, check it against `target` (a generation
    module), then map the file and load from it. A SyncError before the load leaves the old weights."""
    start = time.perf_counter()
    header = handles["header"]
    verify(header, token)
    check_header(header, target)
    dtype = _DTYPES[header["dtype"]]
    plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
    nbytes = sum(numel(s) for b in plan for _, s in b) * torch.empty((), dtype=dtype).element_size()
    try:
        fd = os.open(handles["path"], os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SyncError(f"weight sync refused, the engine keeps its old weights: {handles['path']} does not exist "
                        "here (is the engine on another host? use the collective: update_weights_from_collective)"
                        ) from None
    try:
        if os.fstat(fd).st_size != nbytes:
            raise SyncError(f"weight sync refused, the engine keeps its old weights: {handles['path']} holds "
                            f"{os.fstat(fd).st_size} bytes, the trainer's manifest {nbytes}")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapping, dtype=dtype)
    n = _load(target, _checked(unflatten_buckets(plan, slices(flat)), plan, fingerprints=header["fingerprints"]),
              mode)
    return SyncReport(time.perf_counter() - start, nbytes, n, len(plan), bool(header["validated"]))
