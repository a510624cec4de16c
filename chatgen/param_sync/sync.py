"""Trainer -> generation engine weight sync: manifest check, bucketed streaming into the engine, validation.

Colocated (trainer and engine in the same process(es), sharing memory):

    report = sync_weights(trainer, policy)          # on every trainer rank, each with its engine rank

Across processes (trainer actor(s) -> an inference actor, over a private torch.distributed group: gloo on
CPU, NCCL on GPU):

    # inference process                          # every trainer rank
    rx = SyncReceiver()                           tx = SyncSender(rx_host, rx.port, rx.token)
    rx.receive_into(policy)                       sync_weights(trainer, tx)

The token is the channel's secret: only a sender that proves it over the group's own connection can send
weights, and the engine waits at each step for a bounded time (see "across processes" below).

The source is anything that yields HF-named weights (`weight_source`): a chatgen `MegatronModule` (its public
`hf_weights()` stream, gathered over TP and PP), a `torch.nn.Module` with Hugging Face parameter names (a
transformers model; DDP / FSDP / torch.compile wrappers unwrapped), or an iterable of (name, tensor). The
target is a generation module (the contract of chatgen.generation.base: `weight_manifest()`, `load_weights()`,
`needs_resync`; VLLMModule, the hf backend), or a `SyncSender` for an engine in another process. This package
imports no generation backend: it sits below them, so that any backend and VLLMGeneration can use it.

Before a single byte is written: the source's manifest ({HF name: shape}) is checked against the engine's
architecture (every expected parameter exactly once, nothing unexpected, same shapes), and every weight is
checked to be finite; either failure raises `SyncError` naming the parameters, and the engine keeps its old
weights. Then buckets stream into the engine (HF names, checkpoint format; vLLM fuses / shards / repacks them in
its reload path). vLLM's reload releases the old weights as it begins, so an error once it began raises a
`SyncError` saying the engine is partially updated and must be synced again (the module then refuses to generate
until a sync completes: `needs_resync`). `validate=True` (meant for the first syncs) recomputes every tensor by an
independent unbucketed path and compares bit for bit; across processes the receiver also checks an exact integer
fingerprint of every tensor it received.
"""
import dataclasses
import datetime
import hashlib
import hmac
import json
import secrets
import socket
import time

import torch
import torch.distributed as dist

from chatgen.core.distributed import free_port, tcp_store
from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel, unflatten_buckets


class SyncError(RuntimeError):
    """A weight sync failed; the message says whether the engine still holds its old weights."""


@dataclasses.dataclass
class SyncReport:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    validated: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def check_manifest(sent: dict, expected: dict, where: str = "engine") -> None:
    """Raise SyncError listing every parameter missing, unexpected, or shaped differently."""
    problems = []
    for name, shape in expected.items():
        if name not in sent:
            problems.append(f"{name}: the {where} expects shape {tuple(shape)}, the trainer sends nothing")
        elif tuple(sent[name]) != tuple(shape):
            problems.append(f"{name}: trainer sends shape {tuple(sent[name])}, the {where} expects {tuple(shape)}")
    for name, shape in sent.items():
        if name not in expected:
            problems.append(f"{name}: trainer sends shape {tuple(shape)}, the {where} has no such parameter")
    if problems:
        raise SyncError(f"weight sync refused, the {where} keeps its old weights; {len(problems)} mismatch(es) "
                        f"between the trainer and the {where}:\n  " + "\n  ".join(problems[:50]))


def plan_manifest(plan: list) -> dict:
    """{HF name: shape} of a bucket plan ([[(name, shape)] per bucket]); a name sent twice is a SyncError."""
    out = {}
    for bucket in plan:
        for name, shape in bucket:
            if name in out:
                raise SyncError(f"weight sync refused, the engine keeps its old weights: the source sends {name} twice")
            out[name] = tuple(shape)
    return out


# ---- weight sources ---------------------------------------------------------------------------------
# A source is an object with: `plan` ([[(hf name, shape)] per bucket], the same on every rank of the source),
# `dtype`, `buckets()` (yields [(hf name, tensor)] per bucket of the plan; collective over the source's ranks),
# `reference(i)` (bucket i by an independent path, for validation) and `nonfinite()` (HF names of parameters
# holding NaN/inf). `MegatronModule.hf_weights()` is one; `LocalWeights` wraps tensors held in this process.


class LocalWeights:
    """HF-named tensors held whole in this process (a transformers model, a list of pairs) as a weight source."""

    def __init__(self, named_tensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self._tensors = [(name, t.detach()) for name, t in named_tensors]
        if not self._tensors:
            raise SyncError("weight sync refused, the engine keeps its old weights: the source holds no tensors")
        dtypes = {t.dtype for _, t in self._tensors}
        if len(dtypes) > 1:
            raise SyncError(f"weight sync refused, the engine keeps its old weights: the source mixes dtypes "
                            f"{sorted(map(str, dtypes))}; cast the model to one dtype")
        self.dtype = dtypes.pop()
        self._buckets, size = [[]], 0
        for name, t in self._tensors:
            nbytes = t.numel() * t.element_size()
            if self._buckets[-1] and size + nbytes > bucket_bytes:
                self._buckets.append([])
                size = 0
            self._buckets[-1].append((name, t))
            size += nbytes
        self.plan = [[(name, tuple(t.shape)) for name, t in bucket] for bucket in self._buckets]

    def buckets(self):
        yield from self._buckets

    def reference(self, index: int) -> list[torch.Tensor]:
        return [t for _, t in self._buckets[index]]

    def nonfinite(self) -> list[str]:
        return nonfinite(self._tensors)


def nonfinite(named_tensors) -> list[str]:
    """Names of the (name, tensor) pairs holding NaN or inf. One fp32 sum per tensor, without a copy: NaN and
    inf survive a sum (inf + -inf is NaN); a sum that overflows from finite values is ruled out exactly."""
    return [name for name, t in named_tensors
            if not torch.isfinite(t.sum(dtype=torch.float32)) and not torch.isfinite(t).all()]


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _module_tensors(module: torch.nn.Module):
    """(HF name, full tensor) of a model's parameters, wrappers (DDP/FSDP `.module`, torch.compile) unwrapped."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):  # DDP, FSDP1
        module = module.module
    module = getattr(module, "_orig_mod", module)  # torch.compile
    for name, p in module.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p)  # FSDP2 DTensor -> whole tensor


def weight_source(source, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """The weight source (see above) of a MegatronModule, a torch.nn.Module, or an iterable of (name, tensor)."""
    if hasattr(source, "hf_weights"):  # chatgen.MegatronModule
        return source.hf_weights(bucket_bytes)
    if isinstance(source, torch.nn.Module):
        return LocalWeights(_module_tensors(source), bucket_bytes)
    if isinstance(source, dict):
        return LocalWeights(source.items(), bucket_bytes)
    try:
        pairs = list(source)
    except TypeError:
        raise TypeError(f"sync_weights: cannot read weights from a {type(source).__name__}; pass a MegatronModule, "
                        "a torch.nn.Module with HF parameter names, or an iterable of (name, tensor)") from None
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and torch.is_tensor(p[1])
               for p in pairs):
        raise TypeError("sync_weights: an iterable source must yield (HF name, tensor) pairs")
    return LocalWeights(pairs, bucket_bytes)


def _check_finite(weights) -> None:
    bad = weights.nonfinite()
    if bad:
        raise SyncError(f"weight sync refused, the engine keeps its old weights: {len(bad)} parameter(s) hold NaN or "
                        f"inf: {', '.join(bad[:10])}{', ...' if len(bad) > 10 else ''}; the training step that made "
                        "them diverged (lower the learning rate, check the loss)")


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(t: torch.Tensor) -> list:
    """Two integer sums over the tensor's bit patterns (plain and position-weighted, wrapping in int64):
    exact and independent of summation order or thread count, and a permutation changes the second."""
    bits = t.detach().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).long()
    w = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 9973 + 1
    return [int(bits.sum()), int((bits * w).sum())]


def _load(target, buckets, mode: str = "wait") -> int:
    """Feed bucket lists into a generation module (`load_weights`, chatgen.generation.base); returns tensors
    written. If the write fails once the module began replacing its weights, it refuses to generate until a sync
    completes (`needs_resync`), and the SyncError says the engine is partially updated."""
    written = [0]

    def counted(bucket):
        for item in bucket:
            written[0] += 1
            yield item

    try:
        target.load_weights((counted(bucket) for bucket in buckets), mode)
    except Exception as e:  # a SyncError from the checks inside the stream too: the engine state is what matters
        if target.needs_resync is None:
            if isinstance(e, SyncError):
                raise
            raise SyncError(f"weight sync failed, the engine keeps its old weights: {type(e).__name__}: {e}") from e
        raise SyncError(f"weight sync failed, the engine is PARTIALLY updated ({written[0]} tensors written) and must "
                        f"be synced again before it generates: {type(e).__name__}: {e}") from e
    return written[0]


def _checked(buckets_iter, plan, weights=None, validate=False, fingerprints=None, finite=False):
    """Pass buckets through, checking names/shapes against the plan and, when asked, every value (against
    `weights.reference(i)`, or the sender's `fingerprints`; `finite`: no NaN / inf, whatever the sender said)."""
    for index, (bucket, items) in enumerate(zip(plan, buckets_iter)):
        bad = nonfinite(items) if finite else []
        if bad:
            raise SyncError(f"the engine found NaN or inf in {len(bad)} parameter(s) the trainer sent "
                            f"({', '.join(bad[:10])}{', ...' if len(bad) > 10 else ''}; bucket {index + 1} of "
                            f"{len(plan)}), although its header said none; the training step that made them "
                            "diverged (lower the learning rate, check the loss)")
        reference = weights.reference(index) if validate and weights is not None else None
        for i, ((name, shape), (got_name, t)) in enumerate(zip(bucket, items)):
            if got_name != name or tuple(t.shape) != tuple(shape):
                raise SyncError(f"stream out of step with the manifest: expected {name} {tuple(shape)}, "
                                f"got {got_name} {tuple(t.shape)}")
            if reference is not None and not torch.equal(reference[i], t):
                diff = (reference[i].double() - t.double()).abs().max().item()
                raise SyncError(f"validation: {name} differs from the source's independent read "
                                f"(max |diff| {diff:.3g})")
            if fingerprints is not None and _fingerprint(t) != fingerprints[name]:
                raise SyncError(f"validation: {name} arrived different from what the trainer sent "
                                f"(fingerprint {_fingerprint(t)} != {fingerprints[name]})")
        yield items


def sync_weights(source, target, bucket_bytes: int = DEFAULT_BUCKET_BYTES, validate: bool = False,
                 mode: str = "wait") -> SyncReport:
    """Copy `source`'s weights (a MegatronModule, a torch.nn.Module with HF names, or (name, tensor) pairs; see
    `weight_source`) into `target`: a generation module in this process (a chatgen.generation.base
    GenerationModule such as VLLMModule; colocated: call on every trainer rank with that rank's engine), or a
    `SyncSender` (the engine lives in another process; its receiver picks the mode). Collective over the source's
    ranks. mode: what the module does with requests in flight (`GenerationModule.load_weights`: wait, keep,
    recompute, abort)."""
    if isinstance(target, SyncSender):
        return target.send(source, bucket_bytes, validate)
    start = time.perf_counter()
    weights = weight_source(source, bucket_bytes)
    check_manifest(plan_manifest(weights.plan), target.weight_manifest())
    _check_finite(weights)
    n = _load(target, _checked(weights.buckets(), weights.plan, weights, validate), mode)
    itemsize = torch.empty((), dtype=weights.dtype).element_size()
    return SyncReport(time.perf_counter() - start, sum(numel(s) for b in weights.plan for _, s in b) * itemsize,
                      n, len(weights.plan), validate)


# ---- across processes -------------------------------------------------------------------------------
# The channel: the engine serves a torch TCPStore (the rendezvous) and both ends form a private 2-member group
# (gloo on CPU, NCCL on GPU) that carries the weights. Anyone who reaches the store's port can read, write and
# delete its keys (list_keys included), and so take part in the group's rendezvous: nothing a stranger can do
# there may become a weight. So the receiver makes a token (`SyncReceiver.token`, handed to the trainer by
# whoever set the channel up: the authenticated HTTP begin call, a Ray call, a child's arguments) and
#   1. starts the group only once the rendezvous holds an HMAC of the token (_PROOF_KEY): a stranger cannot make
#      the engine connect anywhere;
#   2. before every sync, over the group's own connection (the one the tensors will come through), both ends
#      prove the token: a fresh nonce from each, then HMAC-SHA256(token, role | both nonces) from each, checked
#      in constant time. A peer that joined the group in the trainer's place fails here, before the manifest or
#      any tensor is read, and the engine closes the channel; a trainer talking to a stranger in the engine's
#      place sends nothing.
# Every wait of the engine has a deadline and can be stopped (`alive`): a trainer that dies or stalls mid-sync
# costs one failed sync, never a stuck engine.

DEFAULT_TIMEOUT_S = 600.0  # the engine's patience at each step of a sync (connect, manifest, each bucket, the end)
_TRAINER_TIMEOUT = datetime.timedelta(minutes=10)  # the trainer's group: the engine's deadlines bound its waits
_PROOF_KEY = "chatgen_weight_sync_proof"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def _mac(token: str, *parts: bytes) -> bytes:
    return hmac.new(token.encode(), b"chatgen weight sync|" + b"|".join(parts), hashlib.sha256).digest()


def _store(host: str, port: int, is_server: bool):
    return tcp_store(host, port, 2, is_server, timeout=_TRAINER_TIMEOUT)  # loopback host: loopback-only listener


def _process_group(store, rank: int, timeout: datetime.timedelta = _TRAINER_TIMEOUT):
    """A private 2-member group (0 = trainer rank 0, 1 = engine), independent of any default group: NCCL when the
    two ends are on different GPUs, else gloo (through host memory). Chosen by where the peers are, which each
    end writes into the rendezvous: NCCL cannot pair two ranks on one device (a trainer and `chatgen serve
    --control` sharing a GPU), and a CPU end has no NCCL."""
    store.set(f"chatgen_sync_device_{rank}", _where())
    if nccl_between(_where(), store.get(f"chatgen_sync_device_{1 - rank}").decode()):
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _where() -> str:
    """This process's device for the sync: "cpu", or "<host>:<GPU uuid>"."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"{socket.gethostname()}:{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def nccl_between(mine: str, theirs: str) -> bool:
    """Whether two ends (their `_where()`) can form an NCCL group: both on GPUs, and not the same one."""
    return mine != "cpu" and theirs != "cpu" and mine != theirs


def _device(pg=None):
    """Where the tensors of group `pg` live: the GPU for NCCL, the host for gloo."""
    if isinstance(pg, dist.ProcessGroupGloo) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class _Patience:
    """How long the engine waits for the trainer at one step of a sync (`what`), and whether it still should
    (`alive()`, polled): an operation on the group that outlasts either raises SyncError."""

    def __init__(self, seconds: float, alive, what: str):
        self.seconds, self.alive, self.what = seconds, alive, what
        self.end = time.monotonic() + seconds

    def remaining(self) -> datetime.timedelta:
        """For the operation's own timeout: a second past the deadline, so that `check` reports first."""
        return datetime.timedelta(seconds=max(self.end - time.monotonic(), 0) + 1)

    def check(self) -> None:
        if self.alive is not None and self.alive() is False:
            raise SyncError(f"the sync was stopped while the engine waited for {self.what}")
        if time.monotonic() > self.end:
            raise SyncError(f"the engine waited {self.seconds:g} s for {self.what}, in vain (the trainer died, "
                            "stalled, or never came)")

    def wait(self, work) -> None:
        pause = 5e-4
        while not work.is_completed():
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


def _bcast(pg, tensor: torch.Tensor, root: int, patience: _Patience | None = None) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    if patience is not None:
        opts.timeout = patience.remaining()  # gloo's own bound: an operation given up on ends soon after
    work = pg.broadcast([tensor], opts)
    if patience is not None:
        patience.wait(work)
    work.wait()
    return tensor


def _send_json(pg, obj, root: int, me: int, patience: _Patience | None = None):
    """Broadcast a JSON-able object from `root` (never pickle: the peer is another process)."""
    if me == root:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(_device(pg))
        _bcast(pg, torch.tensor([data.numel()], dtype=torch.int64, device=_device(pg)), root, patience)
        _bcast(pg, data, root, patience)
        return obj
    n = _bcast(pg, torch.zeros(1, dtype=torch.int64, device=_device(pg)), root, patience)
    data = _bcast(pg, torch.empty(int(n), dtype=torch.uint8, device=_device(pg)), root, patience)
    return json.loads(bytes(data.cpu().tolist()).decode())


def _exchange(pg, mine: bytes, root: int, me: int, patience: _Patience | None) -> bytes:
    """32 bytes from `root` to the other end (`mine` on the root, ignored elsewhere)."""
    tensor = torch.frombuffer(bytearray(mine if me == root else bytes(32)), dtype=torch.uint8).to(_device(pg))
    return bytes(_bcast(pg, tensor, root, patience).cpu().tolist())


def _authenticate(pg, token: str, me: int, patience: _Patience | None = None, world_size: int = 2) -> None:
    """Every member of the group proves it holds `token` (see above): member 0 the trainer, the others engines.
    SyncError at each member that finds a proof wrong (every member checks every proof, so all of them stop
    together). The trainer proves first; an engine answers with its own proof only to a trainer that proved,
    and with zeros otherwise, so that no member is left waiting."""
    nonces = [_exchange(pg, secrets.token_bytes(32), root, me, patience) for root in range(world_size)]
    proofs = [_mac(token, b"trainer" if r == 0 else b"engine %d" % r, *nonces) for r in range(world_size)]
    trainer_proved = hmac.compare_digest(_exchange(pg, proofs[0], 0, me, patience), proofs[0])
    failed = [r for r in range(1, world_size)
              if not hmac.compare_digest(_exchange(pg, proofs[r] if trainer_proved else bytes(32), r, me, patience),
                                         proofs[r])]
    if me != 0 and not trainer_proved:
        raise SyncError("the peer on the weight channel did not prove this update's token (it is not the trainer "
                        "the channel was opened for); the channel is closed")
    if me == 0 and failed:
        raise SyncError("weight sync refused: the engine at the other end of the weight channel did not accept "
                        "this update's token (a stale token, or a peer that is not the engine that opened the "
                        "channel); nothing was sent" + (f" (engine rank(s) {failed})" if world_size > 2 else ""))
    if failed:
        raise SyncError(f"weight sync refused, this engine keeps its old weights: engine rank(s) {failed} of the "
                        "weight channel did not prove the run's token (a process that is not one of the run's "
                        "engines joined it)")


class SyncSender:
    """Trainer end of a cross-process sync; construct on every trainer rank (only global rank 0 connects).
    host, port, token: the receiver's (`SyncReceiver.host`, `.port`, `.token`); `token` may be replaced before
    each send (an engine behind `chatgen serve --control` hands out one per update)."""

    def __init__(self, host: str, port: int, token: str):
        self.host, self.port, self.token, self._pg = host, port, token, None

    def send(self, source, bucket_bytes: int = DEFAULT_BUCKET_BYTES, validate: bool = False) -> SyncReport:
        start = time.perf_counter()
        me = dist.get_rank() if dist.is_initialized() else 0
        weights = weight_source(source, bucket_bytes)
        plan = weights.plan
        header = sync_header(weights, validate)  # collective over the trainer ranks
        verdict = failure = None
        if me == 0:
            try:
                if self._pg is None:
                    store = _store(self.host, self.port, is_server=False)
                    store.set(_PROOF_KEY, _mac(self.token, b"rendezvous").hex())
                    self._pg = _process_group(store, 0)
                _authenticate(self._pg, self.token, 0)
                _send_json(self._pg, header, root=0, me=0)
                verdict = _send_json(self._pg, None, root=1, me=0)  # receiver's manifest check
            except Exception as e:  # the other ranks learn it below, rank 0 raises it as it is
                self._pg, failure = None, e
                verdict = {"error": f"weight sync failed on trainer rank 0: {type(e).__name__}: {e}"}
        verdict = _share(verdict)
        if failure is not None:
            raise failure
        if verdict["error"]:
            raise SyncError(verdict["error"])
        n = 0
        try:
            for items in _checked(weights.buckets(), plan, weights, validate):
                if me == 0:  # status 0: a bucket follows
                    _bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=_device(self._pg)), root=0)
                    _bcast(self._pg, torch.cat([t.reshape(-1) for _, t in items]).to(_device(self._pg)), root=0)
                n += len(items)
        except Exception as e:
            if me == 0:  # status 1: abort, tell the engine why
                _bcast(self._pg, torch.ones(1, dtype=torch.int64, device=_device(self._pg)), root=0)
                _send_json(self._pg, f"{type(e).__name__}: {e}", root=0, me=0)
            raise
        result = _send_json(self._pg, None, root=1, me=0) if me == 0 else None
        result = _share(result)
        if result["error"]:
            raise SyncError(result["error"])
        itemsize = torch.empty((), dtype=weights.dtype).element_size()
        return SyncReport(time.perf_counter() - start, sum(numel(s) for b in plan for _, s in b) * itemsize, n,
                          len(plan), validate)


def sync_header(weights, validate: bool) -> dict:
    """What a trainer tells an engine in another process before the data (JSON): dtype, the bucket plan
    [[[name, shape]]], the parameters holding NaN / inf, and (validate) each tensor's fingerprint by the
    independent path. Collective over the source's ranks (`nonfinite`, `reference`)."""
    header = {"dtype": str(weights.dtype), "buckets": [[[n, list(s)] for n, s in b] for b in weights.plan],
              "validated": validate, "fingerprints": None, "nonfinite": weights.nonfinite()}
    if validate:
        header["fingerprints"] = {name: _fingerprint(t) for i, b in enumerate(weights.plan)
                                  for (name, _), t in zip(b, weights.reference(i))}
    return header


def check_header(header: dict, target) -> None:
    """The engine's checks of a `sync_header` before anything is written: known dtype, no name twice, the
    manifest against `target`'s architecture, no parameter the trainer reports NaN / inf. (The engine checks
    the values it receives itself too: `_checked(..., finite=True)`.) A SyncError names what is wrong."""
    if header["dtype"] not in _DTYPES:
        raise SyncError(f"weight sync refused, the engine keeps its old weights: dtype {header['dtype']} is not one "
                        f"of {sorted(_DTYPES)}")
    sent = {n: tuple(s) for b in header["buckets"] for n, s in b}
    if sum(len(b) for b in header["buckets"]) != len(sent):
        raise SyncError("weight sync refused, the engine keeps its old weights: the trainer's manifest "
                        "names a parameter twice")
    check_manifest(sent, target.weight_manifest())
    if header["nonfinite"]:
        raise SyncError(f"weight sync refused, the engine keeps its old weights: "
                        f"{len(header['nonfinite'])} parameter(s) hold NaN or inf: "
                        f"{', '.join(header['nonfinite'][:10])}; the training step that made them diverged "
                        "(lower the learning rate, check the loss)")


def _share(obj):
    """Rank 0's object on every trainer rank (the verdicts decide whether all ranks raise)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:  # a trainer without torch.distributed
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


class SyncReceiver:
    """Engine end of a cross-process sync. Hosts the rendezvous on host:port (port 0 = a free one), so
    create it before the trainer ranks start and hand them `.port` and `.token` (the secret a sender must prove;
    hand it over a channel that is itself private or authenticated). timeout: the engine's patience, in seconds,
    at each step of a sync (see `receive_into`). A sync that fails without both ends knowing where the other
    stands (a deadline passed, the sync was stopped, the peer failed to prove the token or vanished) closes the
    receiver (`closed`): open a new one."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = DEFAULT_TIMEOUT_S):
        if port == 0 and host in ("0.0.0.0", "::", ""):  # a named host binds port 0 itself (tcp_store): no race
            port = free_port()
        self.host, self.timeout, self._pg = host, timeout, None
        self.token = secrets.token_hex(32)
        self._store = _store(host, port, is_server=True)
        self.port = self._store.port

    def new_token(self) -> str:
        """Replace the token: the next sync must prove this one (a one-time token per update); returns it."""
        self.token = secrets.token_hex(32)
        return self.token

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Leave the group and stop serving the rendezvous (a group operation still pending ends at its own
        deadline)."""
        self._pg = self._store = None

    def receive_into(self, target, alive=None, mode: str = "wait") -> SyncReport:
        """Receive one sync from the trainer and load it into `target` (a generation module); blocks until it
        arrives, is refused, or a deadline passes: the trainer gets `timeout` seconds to connect (the first
        time) and prove the token, then as long again for the manifest, for each bucket and for the end.

        alive: optional callable polled while waiting; returning False (e.g. the trainer processes died, or
        the server's operator stopped the update) ends the sync with a SyncError.
        mode: what the target does with requests in flight (`GenerationModule.load_weights`).
        The values are checked here, whatever the trainer's header says: a NaN or inf stops the sync.
        """
        if self.closed:
            raise SyncError("weight sync refused, the engine keeps its old weights: this weight channel was closed "
                            "after a failed or stopped sync; open a new one")

        def patience(what: str) -> _Patience:
            return _Patience(self.timeout, alive, what)

        def before_load(action):  # an exchange before anything is written: a failure leaves the two ends out of
            try:                  # step for good (the channel closes), and the engine on its old weights
                return action()
            except Exception as e:
                self.close()
                why = str(e) if isinstance(e, SyncError) else f"{type(e).__name__}: {e}"
                raise SyncError(f"weight sync failed, the engine keeps its old weights: {why}") from e
            except BaseException:
                self.close()
                raise

        start = time.perf_counter()
        if self._pg is None:
            before_load(lambda: self._connect(patience("a trainer to connect with the token's proof")))
        before_load(lambda: _authenticate(self._pg, self.token, 1, patience("the trainer's proof of the token")))
        header = before_load(lambda: _send_json(self._pg, None, root=0, me=1, patience=patience("the manifest")))
        try:
            check_header(header, target)
        except SyncError as e:  # refused, both ends in step: the channel stays open for the next sync
            refusal = str(e)
            before_load(lambda: _send_json(self._pg, {"error": refusal}, 1, 1, patience("the trainer")))
            raise
        before_load(lambda: _send_json(self._pg, {"error": None}, 1, 1, patience("the trainer")))
        dtype = _DTYPES[header["dtype"]]
        received = {"buckets": 0, "bytes": 0, "aborted": False, "lost": False}

        def next_flat(shapes):
            what = f"bucket {received['buckets'] + 1} of {len(header['buckets'])}"
            try:
                status = _bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=_device(self._pg)), 0,
                                patience(what))
                if int(status):
                    why = _send_json(self._pg, None, root=0, me=1, patience=patience("the trainer's reason"))
                    received["aborted"] = True  # both ends know: nothing more on the wire
                    raise SyncError(f"the trainer aborted the sync: {why}")
                flat = torch.empty(sum(numel(s) for s in shapes), dtype=dtype, device=_device(self._pg))
                _bcast(self._pg, flat, 0, patience(what))
            except BaseException:
                received["lost"] = not received["aborted"]
                raise
            received["buckets"] += 1
            received["bytes"] += flat.numel() * flat.element_size()
            return flat

        plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
        try:
            received_buckets = unflatten_buckets(plan, next_flat)
            n = _load(target, _checked(received_buckets, plan, fingerprints=header["fingerprints"], finite=True), mode)
        except BaseException as e:
            if received["lost"] or not isinstance(e, SyncError):
                self.close()
            elif not received["aborted"]:  # refused here (a value, the engine's load): drain, and say why
                try:
                    for bucket in header["buckets"][received["buckets"]:]:
                        next_flat([tuple(s) for _, s in bucket])
                    _send_json(self._pg, {"error": str(e)}, root=1, me=1, patience=patience("the trainer"))
                except Exception:  # the trainer is gone too: the refusal above is what matters
                    self.close()
            raise
        try:
            _send_json(self._pg, {"error": None}, root=1, me=1, patience=patience("the trainer"))
        except Exception:  # the weights are in (the report says so); only the trainer does not hear it
            self.close()
        return SyncReport(time.perf_counter() - start, received["bytes"], n, len(plan), bool(header["validated"]))

    def _connect(self, patience: _Patience) -> None:
        """Wait until the rendezvous holds the token's proof, then form the group (both within `patience`)."""
        proof = _mac(self.token, b"rendezvous").hex().encode()
        while not (self._store.check([_PROOF_KEY]) and hmac.compare_digest(self._store.get(_PROOF_KEY), proof)):
            patience.check()
            time.sleep(0.05)
        self._pg = _process_group(self._store, 1, patience.remaining())
