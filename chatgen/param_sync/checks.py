"""The checks every weight sync makes, whatever carries the weights: the manifest (every parameter
once, the engine's shapes), the header a trainer sends ahead of the data, finiteness, exact
fingerprints of a validating sync, the stream against its plan, and the MAC / signature that
authenticate a trainer (the group transport runs the challenge over its own wire:
chatgen.param_sync.wire.authenticate). Also `load_into`, the one way weights enter a generation
module, which turns a failure into a SyncError saying what the engine holds afterwards.

Nothing here moves bytes between processes; every transport (local.py, group.py, shm.py) calls
these.
"""

import dataclasses
import hashlib
import hmac
import json
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from chatgen.core.tensors import numel

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


@runtime_checkable
class Sender(Protocol):
    """The trainer's end of a transport (LocalSender, GroupSender, ShmSender, AdapterSender)."""

    def send(self, source, validate: bool = False, bucket_bytes: int = ...) -> "SyncReport":
        """Deliver `source`'s weights (chatgen.param_sync.weight_source); collective over its
        ranks."""

    def close(self) -> None: ...


@runtime_checkable
class Receiver(Protocol):
    """The engine's end of a transport that crosses processes (GroupReceiver, ShmReceiver)."""

    def receive_into(
        self,
        target,
        mode: str = "wait",
        *,
        header: Optional[dict] = None,
        alive: Optional[Callable[[], bool]] = None,
    ) -> "SyncReport":
        """Load one sync into `target` (a generation module), in `mode` (its requests in flight).
        header: the trainer's sync header when the transport hands it over out of band (shm: the
        handshake; a group reads its own from the wire); alive: polled while waiting for a
        transport that waits (group), False ends the sync with a SyncError."""

    def close(self) -> None: ...


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
            problems.append(
                f"{name}: the {where} expects shape {tuple(shape)}, the trainer sends nothing"
            )
        elif tuple(sent[name]) != tuple(shape):
            problems.append(
                f"{name}: trainer sends shape {tuple(sent[name])}, the {where} expects {tuple(shape)}"
            )
    for name, shape in sent.items():
        if name not in expected:
            problems.append(
                f"{name}: trainer sends shape {tuple(shape)}, the {where} has no such parameter"
            )
    if problems:
        raise SyncError(
            f"weight sync refused, the {where} keeps its old weights; {len(problems)} mismatch(es) "
            f"between the trainer and the {where}:\n  " + "\n  ".join(problems[:50])
        )


def plan_manifest(plan: list) -> dict:
    """{HF name: shape} of a bucket plan ([[(name, shape)] per bucket]); a name sent twice is a
    SyncError."""
    out = {}
    for bucket in plan:
        for name, shape in bucket:
            if name in out:
                raise SyncError(
                    f"weight sync refused, the engine keeps its old weights: the source sends {name} twice"
                )
            out[name] = tuple(shape)
    return out


def plan_bytes(plan, dtype) -> int:
    """Bytes of a bucket plan's tensors in `dtype`."""
    return sum(numel(s) for b in plan for _, s in b) * torch.empty((), dtype=dtype).element_size()


def nonfinite(named_tensors) -> list[str]:
    """Names of the (name, tensor) pairs holding NaN or inf. One fp32 sum per tensor, without a
    copy: NaN and inf survive a sum (inf + -inf is NaN); a sum that overflows from finite values
    is ruled out exactly."""
    return [
        name
        for name, t in named_tensors
        if not torch.isfinite(t.sum(dtype=torch.float32)) and not torch.isfinite(t).all()
    ]


def check_finite(weights) -> None:
    bad = weights.nonfinite()
    if bad:
        raise SyncError(
            f"weight sync refused, the engine keeps its old weights: {len(bad)} parameter(s) hold NaN or "
            f"inf: {', '.join(bad[:10])}{', ...' if len(bad) > 10 else ''}; the training step that made "
            "them diverged (lower the learning rate, check the loss)"
        )


ADAPTER_REFUSED = "adapter-only sync refused, the engine keeps its weights and adapter"


def check_adapter_target(target) -> None:
    """A SyncError unless `target` takes adapters: a generation module with enable_lora."""
    if not callable(getattr(target, "load_lora_tensors", None)) or not getattr(
        getattr(target, "config", None), "enable_lora", False
    ):
        raise SyncError(
            f"{ADAPTER_REFUSED}: {type(target).__name__} has no LoRA adapter support enabled; set "
            "enable_lora: true in the engine's config (chatgen serve enable_lora=true), or sync the "
            "merged weights (sync_weights)"
        )


def check_adapter_manifest(config: dict, sent: dict, engine_manifest: dict) -> None:
    """An adapter's {PEFT name: shape} against the engine: every adapted weight exists in the
    engine with (out, in) matching its pair's B (out, r) and A (r, in), each pair complete, every
    rank the config's `r`; a SyncError listing every mismatch."""
    from chatgen.models.lora_format import split_name

    rank, pairs, problems = config.get("r"), {}, []
    for name, shape in sent.items():
        try:
            hf_weight, matrix = split_name(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        pairs.setdefault(hf_weight, {})[matrix] = tuple(shape)
    for hf_weight, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            problems.append(
                f"{hf_weight}: the adapter sends {sorted(pair)} only, not lora_A and lora_B"
            )
            continue
        (r_a, n_in), (n_out, r_b) = pair["lora_A"], pair["lora_B"]
        if r_a != rank or r_b != rank:
            problems.append(
                f"{hf_weight}: rank {r_a} / {r_b} (lora_A / lora_B), the adapter's config says r={rank}"
            )
        want = engine_manifest.get(hf_weight)
        if want is None:
            problems.append(f"{hf_weight}: the adapter adapts it, the engine has no such weight")
        elif tuple(want) != (n_out, n_in):
            problems.append(
                f"{hf_weight}: the adapter is for shape {(n_out, n_in)}, the engine's is {tuple(want)}"
            )
    if problems:
        raise SyncError(
            f"{ADAPTER_REFUSED}; {len(problems)} mismatch(es) between the adapter and the engine:\n  "
            + "\n  ".join(problems[:50])
        )


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> list:
    """Two integer sums over the tensor's bit patterns (plain and position-weighted, wrapping in
    int64): exact and independent of summation order or thread count, and a permutation changes
    the second."""
    bits = t.detach().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).long()
    w = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 9973 + 1
    return [int(bits.sum()), int((bits * w).sum())]


def load_into(target, buckets, mode: str = "wait", adapter: dict | None = None) -> int:
    """Feed bucket lists into a generation module (`load_weights`, chatgen.generation.base);
    returns tensors written. If the write fails once the module began replacing its weights, it
    refuses to generate until a sync completes (`needs_resync`), and the SyncError says the
    engine is partially updated. adapter: the buckets are a LoRA adapter alone with this
    adapter_config: every tensor is received first, then the engine swaps its adapter at once
    (`load_lora_tensors`; a refusal leaves the previous one)."""
    if adapter is not None:
        # copies: the engine keeps them (a mapped file or a received buffer is reused)
        tensors = {name: t.clone() for bucket in buckets for name, t in bucket}
        try:
            target.load_lora_tensors(adapter, tensors)
        except Exception as e:  # built before the swap: the previous adapter stays
            raise SyncError(
                f"{ADAPTER_REFUSED}: the engine refused it: {type(e).__name__}: {e}"
            ) from e
        return len(tensors)
    written = [0]

    def counted(bucket):
        for item in bucket:
            written[0] += 1
            yield item

    try:
        target.load_weights((counted(bucket) for bucket in buckets), mode)
    except (
        Exception
    ) as e:  # a SyncError from the checks inside the stream too: the engine state is what matters
        if target.needs_resync is None:
            if isinstance(e, SyncError):
                raise
            raise SyncError(
                f"weight sync failed, the engine keeps its old weights: {type(e).__name__}: {e}"
            ) from e
        raise SyncError(
            f"weight sync failed, the engine is PARTIALLY updated ({written[0]} tensors written) and must "
            f"be synced again before it generates: {type(e).__name__}: {e}"
        ) from e
    return written[0]


def checked(buckets_iter, plan, weights=None, validate=False, fingerprints=None, finite=False):
    """Pass buckets through, checking names/shapes against the plan and, when asked, every value
    (against `weights.reference(i)`, or the sender's `fingerprints`; `finite`: no NaN / inf,
    whatever the sender said)."""
    for index, (bucket, items) in enumerate(zip(plan, buckets_iter)):
        bad = nonfinite(items) if finite else []
        if bad:
            raise SyncError(
                f"the engine found NaN or inf in {len(bad)} parameter(s) the trainer sent "
                f"({', '.join(bad[:10])}{', ...' if len(bad) > 10 else ''}; bucket {index + 1} of "
                f"{len(plan)}), although its header said none; the training step that made them "
                "diverged (lower the learning rate, check the loss)"
            )
        reference = weights.reference(index) if validate and weights is not None else None
        for i, ((name, shape), (got_name, t)) in enumerate(zip(bucket, items)):
            if got_name != name or tuple(t.shape) != tuple(shape):
                raise SyncError(
                    f"stream out of step with the manifest: expected {name} {tuple(shape)}, "
                    f"got {got_name} {tuple(t.shape)}"
                )
            if reference is not None and not torch.equal(reference[i], t):
                diff = (reference[i].double() - t.double()).abs().max().item()
                raise SyncError(
                    f"validation: {name} differs from the source's independent read "
                    f"(max |diff| {diff:.3g})"
                )
            if fingerprints is not None and fingerprint(t) != fingerprints[name]:
                raise SyncError(
                    f"validation: {name} arrived different from what the trainer sent "
                    f"(fingerprint {fingerprint(t)} != {fingerprints[name]})"
                )
        yield items


def adapter_config(weights) -> dict | None:
    """The adapter_config.json (a dict) of a source that is a LoRA adapter alone (its `config`:
    chatgen.training.lora_sync.AdapterWeights, source.AdapterTensors), else None."""
    config = getattr(weights, "config", None)
    return config if isinstance(config, dict) else None


def sync_header(weights, validate: bool) -> dict:
    """What a trainer tells an engine in another process before the data (JSON): dtype, the
    bucket plan [[[name, shape]]], the parameters holding NaN / inf, for an adapter alone its
    config (`adapter`), and (validate) each tensor's fingerprint by the independent path. Collective over the source's ranks (`nonfinite`,
    `reference`)."""
    header = {
        "dtype": str(weights.dtype),
        "buckets": [[[n, list(s)] for n, s in b] for b in weights.plan],
        "validated": validate,
        "fingerprints": None,
        "nonfinite": weights.nonfinite(),
        # an adapter alone (adapter_config.json as a dict): the engine swaps its LoRA adapter
        "adapter": adapter_config(weights),
    }
    if validate:
        header["fingerprints"] = {
            name: fingerprint(t)
            for i, b in enumerate(weights.plan)
            for (name, _), t in zip(b, weights.reference(i))
        }
    return header


def check_header(header: dict, target) -> None:
    """The engine's checks of a `sync_header` before anything is written: known dtype, no name
    twice, the manifest against `target`'s architecture, no parameter the trainer reports NaN /
    inf. (The engine checks the values it receives itself too: `checked(..., finite=True)`.) A
    SyncError names what is wrong."""
    if header["dtype"] not in DTYPES:
        raise SyncError(
            f"weight sync refused, the engine keeps its old weights: dtype {header['dtype']} is not one "
            f"of {sorted(DTYPES)}"
        )
    sent = {n: tuple(s) for b in header["buckets"] for n, s in b}
    if sum(len(b) for b in header["buckets"]) != len(sent):
        raise SyncError(
            "weight sync refused, the engine keeps its old weights: the trainer's manifest "
            "names a parameter twice"
        )
    if header.get("adapter") is None:
        check_manifest(sent, target.weight_manifest())
    else:
        check_adapter_target(target)
        check_adapter_manifest(header["adapter"], sent, target.weight_manifest())
    if header["nonfinite"]:
        raise SyncError(
            f"weight sync refused, the engine keeps its old weights: "
            f"{len(header['nonfinite'])} parameter(s) hold NaN or inf: "
            f"{', '.join(header['nonfinite'][:10])}; the training step that made them diverged "
            "(lower the learning rate, check the loss)"
        )


def mac(token: str, *parts: bytes) -> bytes:
    return hmac.new(
        token.encode(), b"chatgen weight sync|" + b"|".join(parts), hashlib.sha256
    ).digest()


def _signature(header: dict, token: str) -> str:
    body = json.dumps(
        {k: v for k, v in header.items() if k != "signature"}, sort_keys=True
    ).encode()
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def signed(header: dict, token: str) -> dict:
    """`header` (a sync_header) with its signature under `token`."""
    return {**header, "signature": _signature(header, token)}


def verify(header: dict, token: str) -> None:
    """SyncError unless `header` was signed with `token`."""
    if not hmac.compare_digest(str(header.get("signature", "")), _signature(header, token)):
        raise SyncError(
            "weight sync refused, the engine keeps its old weights: the header is not signed with this "
            "run's token (a process other than the run's trainer reached the weight channel)"
        )
