"""Megatron -> vLLM weight sync: manifest check, bucketed streaming into vLLM's reload path, validation.

Colocated (trainer and engine in the same process(es), sharing memory):

    report = sync_weights(trainer, llm)             # on every trainer rank, each with its engine rank

Across processes (trainer actor(s) -> an inference actor, over a private torch.distributed group: gloo on
CPU, NCCL on GPU):

    # inference process                          # every trainer rank
    rx = SyncReceiver()                           tx = SyncSender(rx_host, rx.port)
    rx.receive_into(llm)                          sync_weights(trainer, tx)

Either way: the trainer's manifest ({HF name: shape}, from the plan in gather.py) is first checked
against the engine's architecture (every expected parameter exactly once, nothing unexpected, same
shapes); a mismatch raises `SyncError` naming each parameter and both shapes before a single byte is
written, so the engine keeps its old weights. Then buckets stream into `vllm_adapter.load_weights`
(HF names, checkpoint format; vLLM fuses / shards / repacks). An error after the first write raises a
`SyncError` saying the engine is now partially updated. `validate=True` (meant for the first syncs)
recomputes every tensor by an independent unbucketed gather and compares bit for bit; across processes
the receiver also checks an exact integer fingerprint of every tensor it received.
"""
import dataclasses
import datetime
import json
import time

import torch
import torch.distributed as dist

from chatgen.distributed import free_port, tcp_store
from chatgen.param_sync import gather, layout


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


def engine_manifest(llm) -> dict:
    """{HF name: shape} the engine's architecture needs, from the HF config it was started with."""
    hf_config = llm.llm_engine.model_config.hf_config.to_dict()
    spec = layout.spec_from_hf_config(hf_config)
    return layout.family(spec).hf_param_shapes(spec)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(t: torch.Tensor) -> list:
    """Two integer sums over the tensor's bit patterns (plain and position-weighted, wrapping in int64):
    exact and independent of summation order or thread count, and a permutation changes the second."""
    bits = t.detach().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).long()
    w = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 9973 + 1
    return [int(bits.sum()), int((bits * w).sum())]


def _load(llm, buckets) -> int:
    """Feed bucket lists into the engine; returns tensors written. One reload call for an in-process
    engine (lazy generator), one per bucket otherwise (each bucket holds whole vLLM layers)."""
    from chatgen.generation import vllm_adapter

    written = [0]

    def stream(bucket_iter):
        for bucket in bucket_iter:
            for item in bucket:
                written[0] += 1
                yield item

    try:
        if vllm_adapter.in_process_workers(llm):
            vllm_adapter.load_weights(llm, stream(buckets))
        else:
            for bucket in buckets:
                vllm_adapter.load_weights(llm, list(stream([bucket])))
    except Exception as e:  # a SyncError from the checks inside the stream too: the engine state is what matters
        if isinstance(e, SyncError) and written[0] == 0:
            raise
        state = "keeps its old weights" if written[0] == 0 else (
            f"is PARTIALLY updated ({written[0]} tensors written); sync again before generating")
        raise SyncError(f"weight sync failed, the engine {state}: {type(e).__name__}: {e}") from e
    return written[0]


def _checked(buckets_iter, plan, trainer=None, validate=False, fingerprints=None):
    """Pass buckets through, checking names/shapes against the plan and, when asked, every value."""
    for bucket, items in zip(plan, buckets_iter):
        reference = gather.reference_hf_tensors(trainer, bucket) if validate and trainer is not None else None
        for i, ((name, shape), (got_name, t)) in enumerate(zip(bucket.hf, items)):
            if got_name != name or tuple(t.shape) != tuple(shape):
                raise SyncError(f"stream out of step with the manifest: expected {name} {tuple(shape)}, "
                                f"got {got_name} {tuple(t.shape)}")
            if reference is not None and not torch.equal(reference[i], t):
                diff = (reference[i].double() - t.double()).abs().max().item()
                raise SyncError(f"validation: {name} differs from the trainer's unbucketed gather "
                                f"(max |diff| {diff:.3g})")
            if fingerprints is not None and _fingerprint(t) != fingerprints[name]:
                raise SyncError(f"validation: {name} arrived different from what the trainer sent "
                                f"(fingerprint {_fingerprint(t)} != {fingerprints[name]})")
        yield items


def sync_weights(trainer, target, bucket_bytes: int = gather.DEFAULT_BUCKET_BYTES, validate: bool = False) -> SyncReport:
    """Copy `trainer`'s weights (a MegatronModule) into `target`: a vLLM `LLM` or anything with an `.llm`
    (colocated: call on every trainer rank with that rank's engine), or a `SyncSender` (the engine lives in
    another process). Collective over the trainer's ranks."""
    if isinstance(target, SyncSender):
        return target.send(trainer, bucket_bytes, validate)
    llm = getattr(target, "llm", target)
    start = time.perf_counter()
    plan = gather.trainer_plan(trainer, bucket_bytes)
    check_manifest(gather.manifest(plan), engine_manifest(llm))
    stream = _checked(gather.iter_hf_buckets(trainer, bucket_bytes, plan), plan, trainer, validate)
    n = _load(llm, stream)
    itemsize = torch.empty((), dtype=trainer.dtype).element_size()
    return SyncReport(time.perf_counter() - start, sum(b.hf_numel for b in plan) * itemsize, n, len(plan), validate)


# ---- across processes -------------------------------------------------------------------------------

_TIMEOUT = datetime.timedelta(minutes=10)
_READY_KEY = "chatgen_sync_sender_ready"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def _store(host: str, port: int, is_server: bool):
    return tcp_store(host, port, 2, is_server, timeout=_TIMEOUT)  # loopback host -> loopback-only listener


def _process_group(store, rank: int):
    """A private 2-member group (0 = trainer rank 0, 1 = engine), independent of any default group."""
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, _TIMEOUT)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _bcast(pg, tensor: torch.Tensor, root: int) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()
    return tensor


def _send_json(pg, obj, root: int, me: int):
    """Broadcast a JSON-able object from `root` (never pickle: the peer is another process)."""
    if me == root:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(_device())
        _bcast(pg, torch.tensor([data.numel()], dtype=torch.int64, device=_device()), root)
        _bcast(pg, data, root)
        return obj
    n = _bcast(pg, torch.zeros(1, dtype=torch.int64, device=_device()), root)
    data = _bcast(pg, torch.empty(int(n), dtype=torch.uint8, device=_device()), root)
    return json.loads(bytes(data.cpu().tolist()).decode())


class SyncSender:
    """Trainer end of a cross-process sync; construct on every trainer rank (only global rank 0 connects)."""

    def __init__(self, host: str, port: int):
        self.host, self.port, self._pg = host, port, None

    def send(self, trainer, bucket_bytes: int = gather.DEFAULT_BUCKET_BYTES, validate: bool = False) -> SyncReport:
        start = time.perf_counter()
        me = dist.get_rank()
        if me == 0 and self._pg is None:
            store = _store(self.host, self.port, is_server=False)
            store.set(_READY_KEY, "1")
            self._pg = _process_group(store, 0)
        plan = gather.trainer_plan(trainer, bucket_bytes)
        header = {"dtype": str(trainer.dtype), "buckets": [[[n, list(s)] for n, s in b.hf] for b in plan],
                  "validate": validate, "fingerprints": None}
        if validate:  # reference fingerprints by the independent path, sent ahead of the data
            fps = {}
            for b in plan:
                for (name, _), t in zip(b.hf, gather.reference_hf_tensors(trainer, b)):
                    fps[name] = _fingerprint(t)
            header["fingerprints"] = fps
        verdict = None
        if me == 0:
            _send_json(self._pg, header, root=0, me=0)
            verdict = _send_json(self._pg, None, root=1, me=0)  # receiver's manifest check
        verdict = _share(verdict)
        if verdict["error"]:
            raise SyncError(verdict["error"])
        n = 0
        try:
            for items in _checked(gather.iter_hf_buckets(trainer, bucket_bytes, plan), plan, trainer, validate):
                if me == 0:  # status 0: a bucket follows
                    _bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=_device()), root=0)
                    _bcast(self._pg, torch.cat([t.reshape(-1) for _, t in items]).to(_device()), root=0)
                n += len(items)
        except Exception as e:
            if me == 0:  # status 1: abort, tell the engine why
                _bcast(self._pg, torch.ones(1, dtype=torch.int64, device=_device()), root=0)
                _send_json(self._pg, f"{type(e).__name__}: {e}", root=0, me=0)
            raise
        result = _send_json(self._pg, None, root=1, me=0) if me == 0 else None
        result = _share(result)
        if result["error"]:
            raise SyncError(result["error"])
        itemsize = torch.empty((), dtype=trainer.dtype).element_size()
        return SyncReport(time.perf_counter() - start, sum(b.hf_numel for b in plan) * itemsize, n, len(plan),
                          validate)


def _share(obj):
    """Rank 0's object on every trainer rank (the verdicts decide whether all ranks raise)."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


class SyncReceiver:
    """Engine end of a cross-process sync. Hosts the rendezvous on host:port (port 0 = a free one), so
    create it before the trainer ranks start and hand them `.port`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        if port == 0:

            port = free_port()
        self.host, self.port, self._pg = host, port, None
        self._store = _store(host, port, is_server=True)

    def receive_into(self, llm, alive=None) -> SyncReport:
        """Receive one sync from the trainer and load it into `llm` (or `x.llm`); blocks until it arrives.

        alive: optional callable polled while waiting for the trainer to connect; it should raise (or
        return False) when the trainer processes died, so a failed trainer does not leave us waiting.
        """
        llm = getattr(llm, "llm", llm)
        if self._pg is None:
            while not self._store.check([_READY_KEY]):
                if alive is not None and alive() is False:
                    raise SyncError("the trainer stopped before connecting; the engine keeps its old weights")
                time.sleep(0.2)
            self._pg = _process_group(self._store, 1)
        start = time.perf_counter()
        header = _send_json(self._pg, None, root=0, me=1)
        sent = {n: tuple(s) for b in header["buckets"] for n, s in b}
        try:
            if sum(len(b) for b in header["buckets"]) != len(sent):
                raise SyncError("weight sync refused, the engine keeps its old weights: the trainer's manifest "
                                "names a parameter twice")
            check_manifest(sent, engine_manifest(llm))
        except SyncError as e:
            _send_json(self._pg, {"error": str(e)}, root=1, me=1)
            raise
        _send_json(self._pg, {"error": None}, root=1, me=1)
        dtype = _DTYPES[header["dtype"]]
        received = {"buckets": 0, "bytes": 0, "aborted": False}

        def next_flat(shapes):
            status = _bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=_device()), root=0)
            if int(status):
                received["aborted"] = True
                raise SyncError(f"the trainer aborted the sync: {_send_json(self._pg, None, root=0, me=1)}")
            flat = torch.empty(sum(gather._numel(s) for s in shapes), dtype=dtype, device=_device())
            _bcast(self._pg, flat, root=0)
            received["buckets"] += 1
            received["bytes"] += flat.numel() * flat.element_size()
            return flat

        def buckets():
            for bucket in header["buckets"]:
                shapes = [tuple(s) for _, s in bucket]
                yield [(n, t) for (n, _), t in zip(bucket, gather.unflatten(next_flat(shapes), shapes))]

        plan = [gather.Bucket(-1, [], [], [(n, tuple(s)) for n, s in b]) for b in header["buckets"]]
        try:
            n = _load(llm, _checked(buckets(), plan, fingerprints=header["fingerprints"]))
        except SyncError as e:
            if received["aborted"]:  # the trainer raised too; nothing more on the wire
                raise
            for bucket in header["buckets"][received["buckets"]:]:  # drain: keep both ends in step
                next_flat([tuple(s) for _, s in bucket])
            _send_json(self._pg, {"error": str(e)}, root=1, me=1)
            raise
        _send_json(self._pg, {"error": None}, root=1, me=1)
        return SyncReport(time.perf_counter() - start, received["bytes"], n, len(plan), bool(header["validate"]))
