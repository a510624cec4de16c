"""The shared-memory transport (trainer and engine on one host): the trainer copies every weight
once into a file in /dev/shm that the engine maps, and the engine's reload reads the weights from
there. Crossing processes then costs one memcpy, against a socket's several copies for the group
transport (gloo over loopback).

Whose the file is, and how the two ends tell each other about it, is the handshake, passed in as
callables:

    # the engine owns the directory (`chatgen serve --control`: HTTP begin / finish)
    rx = ShmReceiver()                                # engine: /dev/shm/chatgen-weights-<pid>-XXXX, mode 0700
    tx = ShmSender(begin, finish)                     # trainer: begin(held) -> the path to write (rx.name);
    tx.send(source)                                   #   finish({"header"} or {"error"}) -> None or the refusal
    rx.receive_into(policy, mode, header=header)      # engine, inside finish

    # the trainer owns it (a run's update_weights_via_ipc: the handles travel through Ray)
    tx = ShmSender.owned(token)                       # every trainer rank: /dev/shm/chatgen-refit-<pid>-XXXX
    handles = tx.write(source)                        # rank 0: {"path", "header" signed with the token}
    load_shm(policy, handles, token)                  # every engine rank on this host; then tx.close()

The file is created 0600 in a 0700 directory with its full size reserved up front (a full /dev/shm
is an error, not a SIGBUS mid-copy). An engine opens only a name it made or one the trainer signed,
checks the header (chatgen.param_sync.checks: dtype, names, shapes, finiteness) before reading a
byte, checks the file's size, then maps it; an engine-owned file is unlinked once mapped, so from
then on the memory lives only in the two mappings. The engine checks every value itself (NaN / inf
refuse the sync, whatever the header says). A trainer-owned file is bound to its signed header by
its BLAKE3 digest: the trainer takes it tensor by tensor as it copies, each engine in the one pass
that also checks every value, before it loads (BLAKE3 reads ~5 GB/s on one core, SHA-256 with the
CPU's SHA instructions ~1.4). Both ends keep an engine-owned mapping for the next sync of the same
size, an owning sender its file; any failure drops the engine's mapping, and a trainer whose
`finish` fails removes the file it made. Directories are named with the owning process id:
`remove_stale_segments()` removes those of processes that no longer run (`chatgen serve --control`
calls it).
"""

import contextlib
import hmac
import mmap
import os
import re
import secrets
import shutil
import tempfile
import time
import weakref

import blake3
import torch
import torch.distributed as dist

from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, slices, unflatten_buckets
from chatgen.param_sync.checks import (
    DTYPES,
    SyncError,
    SyncReport,
    check_header,
    checked,
    load_into,
    nonfinite,
    plan_bytes,
    signed,
    sync_header,
    verify,
)
from chatgen.param_sync.source import weight_source
from chatgen.param_sync.wire import follow, share

SHM_ROOT = "/dev/shm"
# + "<pid>-": whose directory it is
ENGINE_PREFIX, TRAINER_PREFIX = (
    "chatgen-weights-",
    "chatgen-refit-",
)
# map every page now: one kernel call instead of a fault per page
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedMemoryUnavailable(SyncError):
    """The trainer cannot create the engine's file: the engine is on another machine (or in
    another /dev/shm), run by another user, or /dev/shm is full. Raised before anything is
    written or any collective is called."""


class ShmSender:
    """Trainer end: copies the weights into the file `begin` names and keeps it mapped for the next
    sync of the same size. Construct on every trainer rank: rank 0 writes and talks to the engine
    (`begin`, `finish`), the other ranks take part in the source's collectives.

    begin(held) -> the path to write: held is the path this sender still maps when the size is
    unchanged (the engine hands it back while it maps it too), else None. finish(body) -> None once
    the engine loaded the weights, or the message saying why it refused (a SyncError here, the
    engine keeps its old weights). body: {"header": sync_header} once every byte is written,
    {"error": why} when this end failed.
    """

    def __init__(self, begin=None, finish=None):
        self.begin, self.finish = begin, finish
        self.path, self._map, self.token = None, None, None

    @classmethod
    def owned(cls, token: str, root: str = SHM_ROOT) -> "ShmSender":
        """A sender that owns its file, in a private directory of its own under `root`: a send of
        the same size rewrites it in place, another size writes a new one (the one before
        removed); it keeps `handles` ({"path", "header" signed with `token` over the file's path,
        size and BLAKE3 digest}) for the engines. Every engine loads a write before the next one
        begins (`load_shared_weights` waits for them); an earlier write's handles are refused."""
        self = cls()
        self.token, self.root, self.directory, self.handles = token, root, None, None
        self.begin, self.finish = self._own_path, self._keep_handles
        return self

    def send(
        self, source, validate: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> SyncReport:
        """Write `source` (see `weight_source`) into the engine; collective over the source's
        ranks."""
        start = time.perf_counter()
        weights = weight_source(source, bucket_bytes)
        nbytes = plan_bytes(weights.plan, weights.dtype)
        if _rank() != 0:  # read at each send: a sender may be made before torch.distributed starts
            n = follow(weights, validate)
            return SyncReport(time.perf_counter() - start, nbytes, n, len(weights.plan), validate)
        path = self.begin(self.path if self._map is not None and len(self._map) == nbytes else None)
        if path != self.path:
            self.path = self._map = (
                None  # the old file's memory is freed once the engine dropped it too
            )
            try:
                self._map = _create(path, nbytes)
            except OSError as e:
                self._finish({"error": f"the trainer could not create {path}"})
                raise SharedMemoryUnavailable(
                    f"weight sync over shared memory: cannot create the engine's file {path} ({e}); the engine keeps "
                    "its old weights. The server is on another machine or run by another user, or /dev/shm is full: "
                    "use weight_transport='group'"
                ) from e
            self.path = path
        header = sync_header(weights, validate)
        # the other ranks wait here for rank 0's verdict (a refusal comes only at the end)
        share({"error": None})
        flat = torch.frombuffer(self._map, dtype=weights.dtype)
        # an owning sender signs the file's digest: taken tensor by tensor right after its copy,
        # while its bytes are still in cache, rather than in a second pass over the file
        self.digest = blake3.blake3() if self.token is not None else None
        n, offset = 0, 0
        try:
            for items in checked(weights.buckets(), weights.plan, weights, validate):
                for _, t in items:
                    written = flat[offset : offset + t.numel()]
                    written.view(t.shape).copy_(t)
                    if self.digest is not None:
                        self.digest.update(_bytes(written))
                    offset += t.numel()
                n += len(items)
        except Exception as e:
            self._finish({"error": f"{type(e).__name__}: {e}"})
            raise
        refusal = share({"error": self._finish({"header": header})})["error"]
        if refusal:
            raise SyncError(refusal)
        return SyncReport(time.perf_counter() - start, nbytes, n, len(weights.plan), validate)

    def write(
        self, source, validate: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> dict | None:
        """An owning sender's send: the handles every engine rank loads (`load_shm`) on rank 0,
        None on the other ranks. Collective over the source's ranks."""
        self.send(source, validate, bucket_bytes)
        return self.handles if _rank() == 0 else None

    def _finish(self, body: dict):
        """`finish`, and the file this sender made removed when it fails (the engine never heard
        of the data: a server killed between the write and its finish would leave the whole model
        in /dev/shm)."""
        try:
            return self.finish(body)
        except BaseException:
            if self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self.path = self._map = None
            raise

    def _own_path(self, held) -> str:
        if held is not None:
            # the same size: rewrite the file the engines loaded last (they loaded it before this
            # write began; new pages would cost the trainer as much as the copy)
            return held
        self.close()
        # mode 0700
        self.directory = tempfile.mkdtemp(prefix=f"{TRAINER_PREFIX}{os.getpid()}-", dir=self.root)
        return os.path.join(self.directory, "weights")

    def _keep_handles(self, body: dict) -> None:
        if "header" in body:
            # the signature binds the file too: its path, size and content (the engine loads no
            # other)
            written = {"path": self.path, "size": len(self._map), "blake3": self.digest.hexdigest()}
            header = signed({**body["header"], "file": written}, self.token)
            self.handles = {"path": self.path, "header": header}

    def close(self) -> None:
        """Let go of the mapping (its memory is freed once the engine lets go too); an owning
        sender also removes its file (once every engine loaded it)."""
        self.path = self._map = None
        if getattr(self, "directory", None) is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _create(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        # reserve the pages: ENOSPC now rather than SIGBUS while copying
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


class ShmReceiver:
    """Engine end: owns a private directory in /dev/shm, names the one file a trainer writes
    there, checks the trainer's header, maps the file and loads from it."""

    def __init__(self, root: str = SHM_ROOT):
        # mode 0700
        self.directory = tempfile.mkdtemp(prefix=f"{ENGINE_PREFIX}{os.getpid()}-", dir=root)
        # also at interpreter exit
        self._remove = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.path, self._map = None, None

    def name(self, held: str | None) -> str:
        """The path the trainer writes next: `held` (the file it wrote last) while this end still
        maps it, else a new name (the previous file is dropped)."""
        if held is not None and held == self.path and self._map is not None:
            return held
        self.drop()
        self.path = os.path.join(self.directory, f"weights-{secrets.token_hex(8)}")
        return self.path

    def receive_into(
        self, target, mode: str = "wait", *, header: dict | None = None, alive=None
    ) -> SyncReport:
        """Check the trainer's `header` (a `sync_header`, handed over by the handshake) against
        `target` (a generation module), then load the weights from the file named last. Any
        failure drops the file (SyncError; before the load, the engine keeps its old weights).
        alive: unused (the file is written before this is called: nothing to wait for); the
        Receiver protocol's."""
        if header is None:
            raise SyncError(
                "ShmReceiver.receive_into needs the trainer's sync header (header=...), handed over "
                "by the handshake that names the file; the engine keeps its old weights"
            )
        start = time.perf_counter()
        try:
            check_header(header, target)
            dtype = DTYPES[header["dtype"]]
            plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
            flat = torch.frombuffer(self._mapping(plan_bytes(plan, dtype)), dtype=dtype)
            n = _load_flat(target, flat, plan, header, mode, "of the file")
        except BaseException:
            self.drop()
            raise
        return SyncReport(
            time.perf_counter() - start, len(self._map), n, len(plan), bool(header["validated"])
        )

    def _mapping(self, nbytes: int) -> mmap.mmap:
        if self._map is None:
            if self.path is None:
                raise SyncError(
                    "weight sync refused, the engine keeps its old weights: no shared-memory file was "
                    "named for this sync (begin one first)"
                )
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise SyncError(
                    f"weight sync refused, the engine keeps its old weights: the trainer wrote no "
                    f"{self.path} (is it on another machine? use weight_transport='group')"
                ) from None
            try:
                size = os.fstat(fd).st_size
                if size != nbytes:
                    raise SyncError(
                        f"weight sync refused, the engine keeps its old weights: {self.path} holds "
                        f"{size} bytes, the trainer's manifest {nbytes}"
                    )
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
                os.unlink(self.path)  # the two mappings keep the memory; nothing stays in /dev/shm
        elif len(self._map) != nbytes:
            raise SyncError(
                f"weight sync refused, the engine keeps its old weights: the trainer reused its "
                f"{len(self._map)}-byte file for {nbytes} bytes of weights"
            )
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


def load_shm(target, handles: dict, token: str, mode: str = "wait") -> SyncReport:
    """Engine end of an owning `ShmSender`: verify the trainer's signed header, check it against
    `target` (a generation module), then map the file and load from it. A SyncError before the
    load leaves the old weights."""
    start = time.perf_counter()
    header = handles["header"]
    verify(header, token)
    check_header(header, target)
    dtype = DTYPES[header["dtype"]]
    plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
    nbytes = plan_bytes(plan, dtype)
    written = header.get("file") or {}
    refused = "weight sync refused, the engine keeps its old weights"
    path = written.get("path")
    if path != handles.get("path") or written.get("size") != nbytes:
        raise SyncError(
            f"{refused}: the handles name {handles.get('path')} of {nbytes} bytes, the signed header "
            f"{path} of {written.get('size')} bytes"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SyncError(
            f"{refused}: {path} does not exist here (is the engine on another host? use the "
            "collective: update_weights_from_collective)"
        ) from None
    try:
        if os.fstat(fd).st_size != nbytes:
            raise SyncError(
                f"{refused}: {path} holds {os.fstat(fd).st_size} bytes, the trainer's manifest {nbytes}"
            )
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)

    def signed_content(digest):
        if not hmac.compare_digest(digest.hexdigest(), str(written.get("blake3"))):
            raise SyncError(
                f"{refused}: {path} is not the file the trainer signed (its content changed)"
            )

    flat = torch.frombuffer(mapping, dtype=dtype)
    n = _load_flat(target, flat, plan, header, mode, "of the trainer's file", signed_content)
    return SyncReport(time.perf_counter() - start, nbytes, n, len(plan), bool(header["validated"]))


def _bytes(t: torch.Tensor):
    """The bytes of contiguous `t`, without a copy (the BLAKE3 digest reads them in place)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _load_flat(
    target, flat: torch.Tensor, plan: list, header: dict, mode: str, where: str, signed=None
) -> int:
    """Load the weights of a mapped file into `target`: every value checked finite first (never
    the trainer's word for it), then the stream checked against the plan and, validating, the
    fingerprints. signed(digest): refuses unless the file's BLAKE3 `digest` is the one the trainer
    signed; taken in the finiteness check's pass (each tensor's bytes read while in cache), checked
    before its verdict."""
    digest = blake3.blake3() if signed is not None else None

    def buckets():
        return unflatten_buckets(plan, slices(flat))

    def read(items):  # the file's tensors in its order: their digest is the file's
        for name, t in items:
            if digest is not None:
                digest.update(_bytes(t))
            yield name, t

    bad = nonfinite(read(item for bucket in buckets() for item in bucket))
    if signed is not None:
        signed(digest)
    if bad:
        raise SyncError(
            f"weight sync refused, the engine keeps its old weights: the engine found NaN or inf "
            f"in {len(bad)} parameter(s) {where} ({', '.join(bad[:10])}"
            f"{', ...' if len(bad) > 10 else ''}) although the trainer's header said none; the "
            "training step that made them diverged (lower the learning rate, check the loss)"
        )
    return load_into(
        target,
        checked(buckets(), plan, fingerprints=header["fingerprints"]),
        mode,
        header.get("adapter"),
    )


def remove_stale_segments(root: str = SHM_ROOT) -> list:
    """Remove the weight directories under `root` that this user's chatgen processes left when
    they were killed (named `chatgen-weights-<pid>-` or `chatgen-refit-<pid>-`, owned by this
    user, of a pid that no longer runs); never another user's, nor a running process's. Returns
    the paths removed."""
    removed = []
    pattern = re.compile(rf"^(?:{re.escape(ENGINE_PREFIX)}|{re.escape(TRAINER_PREFIX)})(\d+)-")
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            found = pattern.match(entry.name)
            if found is None or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _running(
                int(found.group(1))
            ):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True
