"""Same-host weight sync through shared memory: the trainer copies every weight once into a file in /dev/shm
that the engine maps, and the engine's reload reads the weights from there. Crossing processes then costs one
memcpy, against a socket's several copies for the torch.distributed group of sync.py (gloo over loopback).

    # engine process (`chatgen serve --control`)       # trainer rank 0, same machine
    rx = ShmReceiver()
    path = rx.name(held)                <-- begin --   tx = ShmSender()
                                        -- path -->    tx.send(source, begin, finish)   # writes every bucket
    rx.receive_into(policy, header)     <-- finish --  (header: the manifest, as the group sends it)

The engine owns the directory (/dev/shm/chatgen-weights-<pid>-XXXX, mode 0700, removed when the receiver is
collected or its process exits) and hands out the file name; the trainer creates the file there (0600, its
full size reserved up front, so a full /dev/shm is an error, not a SIGBUS mid-copy). The engine only ever opens
a name it made, checks the header (`check_header`: dtype, names, shapes, finiteness) before reading a byte,
checks the file's size against it, then maps the file and unlinks it: from then on the memory lives only in
the two mappings, so nothing is left in /dev/shm whatever happens to either process. Before the load the
engine checks every value itself (a NaN or inf refuses the sync, whatever the trainer's header says), so a
refused file never reaches the engine. Both ends keep their
mapping for the next sync of the same size (no page faults, no allocation); any failure drops the engine's
mapping, and the next sync gets a new file. The cost: one copy of the weights in shared memory while a trainer
syncs this way.
"""
import contextlib
import mmap
import os
import secrets
import shutil
import tempfile
import time
import weakref

import torch

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel, slices, unflatten_buckets
from chatgen.param_sync.sync import (
    _DTYPES,
    SyncError,
    SyncReport,
    _checked,
    _load,
    _share,
    check_header,
    nonfinite,
    sync_header,
    weight_source,
)

SHM_ROOT = "/dev/shm"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page now: one kernel call instead of a fault per page


class SharedMemoryUnavailable(SyncError):
    """The trainer cannot create the engine's file: the engine is on another machine (or in another /dev/shm), run
    by another user, or /dev/shm is full. Raised before anything is written or any collective is called."""


def _plan_bytes(plan, dtype) -> int:
    return sum(numel(s) for b in plan for _, s in b) * torch.empty((), dtype=dtype).element_size()


class ShmSender:
    """Trainer end: copies the weights into the file the engine named, and keeps it mapped for the next sync.
    Construct on trainer rank 0; the other ranks of a multi-process trainer take part in the source's collectives
    through `SyncSender("", 0, "")` (this end calls the same collectives in the same order)."""

    def __init__(self):
        self.path, self._map = None, None

    def send(self, source, begin, finish, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             validate: bool = False) -> SyncReport:
        """Write `source` (see `weight_source`) into the engine.

        begin(held) -> the path to write: held is the path this sender still maps when the size is unchanged
        (the engine hands it back while it maps it too), else None. finish(body) -> None once the engine loaded
        the weights, or the message saying why it refused (a SyncError here, the engine keeps its old weights).
        body: {"header": sync_header} once every byte is written, {"error": why} when this end failed.
        """
        start = time.perf_counter()
        weights = weight_source(source, bucket_bytes)
        nbytes = _plan_bytes(weights.plan, weights.dtype)
        path = begin(self.path if self._map is not None and len(self._map) == nbytes else None)
        if path != self.path:
            self.path = self._map = None  # the old file's memory is freed once the engine dropped it too
            try:
                self._map = _create(path, nbytes)
            except OSError as e:
                finish({"error": f"the trainer could not create {path}"})
                raise SharedMemoryUnavailable(
                    f"weight sync over shared memory: cannot create the engine's file {path} ({e}); the engine keeps "
                    "its old weights. The server is on another machine or run by another user, or /dev/shm is full: "
                    "use weight_transport='group'") from e
            self.path = path
        header = sync_header(weights, validate)
        _share({"error": None})  # the other ranks' SyncSender waits here for the engine's verdict on the manifest
        flat = torch.frombuffer(self._map, dtype=weights.dtype)
        n, offset = 0, 0
        try:
            for items in _checked(weights.buckets(), weights.plan, weights, validate):
                for _, t in items:
                    flat[offset:offset + t.numel()].view(t.shape).copy_(t)
                    offset += t.numel()
                n += len(items)
        except Exception as e:
            finish({"error": f"{type(e).__name__}: {e}"})
            raise
        refusal = _share({"error": finish({"header": header})})["error"]
        if refusal:
            raise SyncError(refusal)
        return SyncReport(time.perf_counter() - start, nbytes, n, len(weights.plan), validate)

    def close(self) -> None:
        """Let go of the mapping (its memory is freed once the engine lets go too)."""
        self.path = self._map = None


def _create(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve the pages: ENOSPC now rather than SIGBUS while copying
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class ShmReceiver:
    """Engine end: owns a private directory in /dev/shm, names the one file a trainer writes there, checks the
    trainer's header, maps the file and loads from it."""

    def __init__(self, root: str = SHM_ROOT):
        self.directory = tempfile.mkdtemp(prefix=f"chatgen-weights-{os.getpid()}-", dir=root)  # mode 0700
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, True)  # also at interpreter exit
        self.path, self._map = None, None

    def name(self, held: str | None) -> str:
        """The path the trainer writes next: `held` (the file it wrote last) while this end still maps it, else a
        new name (the previous file is dropped)."""
        if held is not None and held == self.path and self._map is not None:
            return held
        self.drop()
        self.path = os.path.join(self.directory, f"weights-{secrets.token_hex(8)}")
        return self.path

    def receive_into(self, target, header: dict, mode: str = "wait") -> SyncReport:
        """Check the trainer's `header` (a `sync_header`) against `target` (a generation module), then load
        the weights from the file named last. Any failure drops the file (SyncError; before the load, the engine
        keeps its old weights)."""
        start = time.perf_counter()
        try:
            check_header(header, target)
            dtype = _DTYPES[header["dtype"]]
            plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
            flat = torch.frombuffer(self._mapping(_plan_bytes(plan, dtype)), dtype=dtype)

            def buckets():
                return unflatten_buckets(plan, slices(flat))

            bad = nonfinite(item for bucket in buckets() for item in bucket)  # never the trainer's word for it
            if bad:
                raise SyncError(f"weight sync refused, the engine keeps its old weights: the engine found NaN or inf "
                                f"in {len(bad)} parameter(s) of the file ({', '.join(bad[:10])}"
                                f"{', ...' if len(bad) > 10 else ''}) although the trainer's header said none; the "
                                "training step that made them diverged (lower the learning rate, check the loss)")
            n = _load(target, _checked(buckets(), plan, fingerprints=header["fingerprints"]), mode)
        except BaseException:
            self.drop()
            raise
        return SyncReport(time.perf_counter() - start, len(self._map), n, len(plan), bool(header["validated"]))

    def _mapping(self, nbytes: int) -> mmap.mmap:
        if self._map is None:
            if self.path is None:
                raise SyncError("weight sync refused, the engine keeps its old weights: no shared-memory file was "
                                "named for this sync (begin one first)")
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise SyncError(f"weight sync refused, the engine keeps its old weights: the trainer wrote no "
                                f"{self.path} (is it on another machine? use weight_transport='group')") from None
            try:
                size = os.fstat(fd).st_size
                if size != nbytes:
                    raise SyncError(f"weight sync refused, the engine keeps its old weights: {self.path} holds "
                                    f"{size} bytes, the trainer's manifest {nbytes}")
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
                os.unlink(self.path)  # the two mappings keep the memory; nothing stays in /dev/shm
        elif len(self._map) != nbytes:
            raise SyncError(f"weight sync refused, the engine keeps its old weights: the trainer reused its "
                            f"{len(self._map)}-byte file for {nbytes} bytes of weights")
        return self._map

    def drop(self) -> None:
        """Forget the current file: remove it if it is still there, release this end's mapping."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.path = self._map = None

    def close(self) -> None:
        """Drop the file and remove the directory."""
        self.drop()
        self._remove()
