"""The collective transport: trainer rank 0 -> N engine ranks (N >= 1, any nodes) over one private
torch.distributed group of 1 + N members (gloo on CPU, NCCL on GPU), one broadcast per bucket, so
the trainer sends each byte once whatever N.

    # the trainer hosts the rendezvous (a run's generation group: every engine rank of every replica joins)
    tx = GroupSender(token, 1 + N, host="127.0.0.1")    # every trainer rank; rank 0 listens: tx.host, tx.port
    tx.connect()                     |    rx = GroupReceiver(tx.host, tx.port, i, 1 + N, token)    # i = 1..N
    tx.send(trainer)                 |    rx.receive_into(policy)               # per sync, both sides at once

    # the engine hosts it (`chatgen serve --control`, `chatgen check-sync`): one engine rank
    rx = GroupReceiver.listen()                       # rx.port, rx.token (hand them to the trainer)
    rx.receive_into(policy)          |    GroupSender.to(rx_host, rx.port, rx.token).send(trainer)

`begin` / `finish` (callables, rank 0 only) are the handshake of a server that opens the group per
update: begin(held port or None) -> {"host", "port", "token"} before the data, finish(ok) after it.

Every sync: each member proves the token over the group's own connections (chatgen.param_sync.wire
.authenticate); the trainer sends its signed header (chatgen.param_sync.checks.sync_header); every
engine rank checks it against its architecture and gives its verdict, and any refusal stops the sync
for all before a byte is written (every engine keeps its old weights); then the buckets, each engine
checking names, shapes, values (NaN / inf) and, on a validating sync, exact fingerprints; then every
engine rank's verdict again. An engine rank that listens (`listen`) waits a bounded time at each
step (`timeout`, and `alive` polled): a trainer that dies or stalls costs one failed sync, never a
stuck engine. A sync that fails without both ends knowing where the other stands closes the receiver
(`closed`): open a new one.
"""

import hmac
import secrets
import time

import torch
import torch.distributed as dist

from chatgen.core.distributed import free_port
from chatgen.core.tensors import DEFAULT_BUCKET_BYTES, numel, unflatten_buckets
from chatgen.param_sync.checks import (
    DTYPES,
    SyncError,
    SyncReport,
    check_header,
    checked,
    load_into,
    mac,
    plan_bytes,
    signed,
    sync_header,
    verify,
)
from chatgen.param_sync.source import weight_source
from chatgen.param_sync.wire import (
    DEFAULT_TIMEOUT_S,
    PROOF_KEY,
    Patience,
    authenticate,
    bcast,
    device,
    follow,
    process_group,
    refusal,
    rendezvous_store,
    send_json,
    share,
    verdicts,
)


class GroupSender:
    """Trainer end; construct on every trainer rank (global rank 0 talks to the engines, the other
    ranks take part in reading the weights: `weight_source` is collective).

    GroupSender(token, world_size, host, port=0): rank 0 hosts the rendezvous on `host` (port 0: a
    free one) from construction on, and `connect()` forms the group with the engine ranks that join
    it. GroupSender.to(host, port, token): the engine hosts it; rank 0 joins at its first send.
    `token` may be replaced before each send (a server hands out one per update: `begin`).
    """

    def __init__(
        self,
        token: str,
        world_size: int = 2,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        listen: bool = True,
        begin=None,
        finish=None,
    ):
        self.token, self.world_size, self.host, self.port, self.listen = (
            token,
            world_size,
            host,
            port,
            listen,
        )
        self.begin, self.finish, self._pg, self._store = begin, finish, None, None
        if listen and _rank() == 0:
            # a named host binds port 0 itself (tcp_store)
            if not port and host in (
                "0.0.0.0",
                "::",
                "",
            ):
                port = free_port(host)
            self._store = rendezvous_store(host, port, is_server=True, world_size=world_size)
            self.port = self._store.port

    @classmethod
    def to(cls, host: str, port: int, token: str, *, begin=None, finish=None) -> "GroupSender":
        """A sender to one engine that hosts the rendezvous (`GroupReceiver.listen`)."""
        return cls(token, 2, host, port, listen=False, begin=begin, finish=finish)

    def connect(self) -> None:
        """Form the group; blocks until every engine rank joined too (`GroupReceiver`). Listening
        senders only."""
        if _rank() == 0:
            self._pg = process_group(self._store, 0, self.world_size)

    def send(
        self, source, validate: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> SyncReport:
        """Send `source`'s weights (see chatgen.param_sync.weight_source) to every engine rank;
        collective over the source's ranks. SyncError when any engine refused (every engine keeps
        its old weights) or failed to load (that engine says whether it is partially updated)."""
        start = time.perf_counter()
        # a source that cannot be read fails before any handshake
        weights = weight_source(source, bucket_bytes)
        if _rank() != 0:  # read at each send: a sender may be made before torch.distributed starts
            n = follow(weights, validate)
        else:
            if self.begin is not None:
                self._begin()
            try:
                n = self._send(weights, validate)
            except BaseException:
                if self.finish is not None:
                    self.finish(False)  # the server saw the failure too
                raise
            if self.finish is not None:
                self.finish(True)
        return SyncReport(
            time.perf_counter() - start,
            plan_bytes(weights.plan, weights.dtype),
            n,
            len(weights.plan),
            validate,
        )

    def _begin(self) -> None:
        endpoint = self.begin(self.port if self._pg is not None else None)
        if (self.host, self.port) != (endpoint["host"], endpoint["port"]):
            self.host, self.port, self._pg = endpoint["host"], endpoint["port"], None  # a new group
        # this update's one-time token: the stream proves it to the server
        self.token = endpoint["token"]

    def _send(self, weights, validate: bool) -> int:
        """Rank 0's part: header, verdicts, buckets, verdicts; every step's outcome shared with
        the other ranks."""
        header = sync_header(weights, validate)  # collective over the trainer ranks
        verdict = failure = None
        try:
            if self._pg is None:
                self._join()
            authenticate(self._pg, self.token, 0, world_size=self.world_size)
            send_json(self._pg, signed(header, self.token), root=0, me=0)
            verdict = {"error": refusal(verdicts(self._pg, None, 0, self.world_size))}
        except Exception as e:  # the other ranks learn it below, rank 0 raises it as it is
            failure = e
            if not self.listen:
                self._pg = None
            verdict = {"error": f"weight sync failed on trainer rank 0: {type(e).__name__}: {e}"}
        verdict = share(verdict)
        if failure is not None:
            raise failure
        if verdict["error"]:
            raise SyncError(verdict["error"])
        n = 0
        try:
            for items in checked(weights.buckets(), weights.plan, weights, validate):
                # status 0: a bucket
                bcast(self._pg, torch.zeros(1, dtype=torch.int64, device=device(self._pg)), root=0)
                bcast(
                    self._pg,
                    torch.cat([t.reshape(-1) for _, t in items]).to(device(self._pg)),
                    root=0,
                )
                n += len(items)
        except Exception as e:  # status 1: abort, and why
            bcast(self._pg, torch.ones(1, dtype=torch.int64, device=device(self._pg)), root=0)
            send_json(self._pg, f"{type(e).__name__}: {e}", root=0, me=0)
            raise
        result = share({"error": refusal(verdicts(self._pg, None, 0, self.world_size))})
        if result["error"]:
            raise SyncError(result["error"])
        return n

    def _join(self) -> None:
        if self.listen:
            raise SyncError(
                "weight sync refused: the group is not formed; call connect() once every engine rank "
                "joined"
            )
        store = rendezvous_store(self.host, self.port, is_server=False)
        store.set(PROOF_KEY, mac(self.token, b"rendezvous").hex())
        self._pg = process_group(store, 0)

    def close(self) -> None:
        """Leave the group and stop hosting the rendezvous."""
        self._pg = self._store = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class GroupReceiver:
    """Engine end: member `rank` (1..world_size-1) of the group a trainer hosts at host:port;
    joins at construction (blocks until every member joined). `GroupReceiver.listen()` hosts the
    rendezvous instead. timeout: the engine's patience, in seconds, at each step of a sync (None:
    wait as long as the trainer)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        token: str,
        timeout: float | None = None,
    ):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.token, self.timeout, self._store, self._open = token, timeout, None, True
        self.checks_values = (
            False  # a run's own trainer, which checked finiteness before sending (its header)
        )
        self._pg = process_group(
            rendezvous_store(host, port, is_server=False, world_size=world_size), rank, world_size
        )

    @classmethod
    def listen(
        cls, host: str = "127.0.0.1", port: int = 0, timeout: float = DEFAULT_TIMEOUT_S
    ) -> "GroupReceiver":
        """One engine rank hosting the rendezvous on host:port (port 0 = a free one): create it
        before the trainer starts and hand it `.port` and `.token` (the secret a sender must
        prove; hand it over a channel that is itself private or authenticated). The group forms
        at the first sync, once the rendezvous holds the token's proof."""
        self = cls.__new__(cls)
        # a named host binds port 0 itself (tcp_store): no race
        if port == 0 and host in (
            "0.0.0.0",
            "::",
            "",
        ):
            port = free_port()
        self.host, self.rank, self.world_size, self.timeout, self._pg, self._open = (
            host,
            1,
            2,
            timeout,
            None,
            True,
        )
        self.token = secrets.token_hex(32)
        self.checks_values = (
            True  # a server trusts no trainer's word for finiteness: every value is checked here
        )
        self._store = rendezvous_store(host, port, is_server=True)
        self.port = self._store.port
        return self

    def new_token(self) -> str:
        """Replace the token: the next sync must prove this one (a one-time token per update);
        returns it."""
        self.token = secrets.token_hex(32)
        return self.token

    @property
    def closed(self) -> bool:
        return not self._open

    def close(self) -> None:
        """Leave the group and stop serving the rendezvous (a group operation still pending ends at its own
        deadline)."""
        self._pg = self._store = None
        self._open = False

    def receive_into(
        self, target, mode: str = "wait", *, header: dict | None = None, alive=None
    ) -> SyncReport:
        """Receive one sync and load it into `target` (a generation module:
        chatgen.generation.base); blocks until it arrives, is refused, or a deadline passes (with
        `timeout`: the trainer gets that long to connect, the first time, and prove the token, then
        as long again for the manifest, each bucket and the end). mode: what the target does with
        requests in flight (`GenerationModule.load_weights`). header: unused (the trainer's comes
        over the group's own wire); the Receiver protocol's. alive: optional callable polled while
        waiting; returning False (the trainer died, the server's operator stopped the update) ends
        the sync with a SyncError. A listening engine checks every value for NaN / inf itself,
        whatever the trainer's header says (a run's engine ranks rely on their trainer's check: one
        sum less per tensor and engine rank).
        """
        if self.closed:
            raise SyncError(
                "weight sync refused, the engine keeps its old weights: this weight channel was closed "
                "after a failed or stopped sync; open a new one"
            )
        me, world = self.rank, self.world_size

        def patience(what: str) -> Patience | None:
            return Patience(self.timeout, alive, what) if self.timeout is not None else None

        # an exchange before anything is written: a failure leaves the two ends out of
        def before_load(
            action,
        ):
            try:  # step for good (the channel closes), and the engine on its old weights
                return action()
            except Exception as e:
                self.close()
                why = str(e) if isinstance(e, SyncError) else f"{type(e).__name__}: {e}"
                raise SyncError(
                    f"weight sync failed, the engine keeps its old weights: {why}"
                ) from e
            except BaseException:
                self.close()
                raise

        start = time.perf_counter()
        if self._pg is None:
            before_load(
                lambda: self._connect(patience("a trainer to connect with the token's proof"))
            )
        before_load(
            lambda: authenticate(
                self._pg, self.token, me, patience("the trainer's proof of the token"), world
            )
        )
        header = before_load(
            lambda: send_json(self._pg, None, root=0, me=me, patience=patience("the manifest"))
        )
        try:
            verify(header, self.token)
            check_header(header, target)
            mine = None
        except (
            SyncError
        ) as e:  # refused, every member in step: the channel stays open for the next sync
            mine = str(e)
        others = before_load(
            lambda: refusal(verdicts(self._pg, {"error": mine}, me, world, patience("the trainer")))
        )
        if mine or others:
            raise SyncError(
                mine or f"weight sync refused, this engine keeps its old weights: {others}"
            )
        dtype = DTYPES[header["dtype"]]
        received = {"buckets": 0, "bytes": 0, "aborted": False, "lost": False}

        def next_flat(shapes):
            what = f"bucket {received['buckets'] + 1} of {len(header['buckets'])}"
            try:
                status = bcast(
                    self._pg,
                    torch.zeros(1, dtype=torch.int64, device=device(self._pg)),
                    0,
                    patience(what),
                )
                if int(status):
                    why = send_json(
                        self._pg, None, root=0, me=me, patience=patience("the trainer's reason")
                    )
                    received["aborted"] = True  # every member knows: nothing more on the wire
                    raise SyncError(f"the trainer aborted the sync: {why}")
                flat = torch.empty(
                    sum(numel(s) for s in shapes), dtype=dtype, device=device(self._pg)
                )
                bcast(self._pg, flat, 0, patience(what))
            except BaseException:
                received["lost"] = not received["aborted"]
                raise
            received["buckets"] += 1
            received["bytes"] += flat.numel() * flat.element_size()
            return flat

        plan = [[(n, tuple(s)) for n, s in b] for b in header["buckets"]]
        try:
            received_buckets = unflatten_buckets(plan, next_flat)
            n = load_into(
                target,
                checked(
                    received_buckets,
                    plan,
                    fingerprints=header["fingerprints"],
                    finite=self.checks_values,
                ),
                mode,
                header.get("adapter"),
            )
        except BaseException as e:
            if received["lost"] or not isinstance(e, SyncError):
                self.close()
            # refused here (a value, the engine's load): drain, and say why
            elif not received["aborted"]:
                try:
                    for bucket in header["buckets"][received["buckets"] :]:
                        next_flat([tuple(s) for _, s in bucket])
                    verdicts(self._pg, {"error": str(e)}, me, world, patience("the trainer"))
                except Exception:  # the trainer is gone too: the refusal above is what matters
                    self.close()
            raise
        try:
            verdicts(self._pg, {"error": None}, me, world, patience("the trainer"))
        except (
            Exception
        ):  # the weights are in (the report says so); only the trainer does not hear it
            self.close()
        return SyncReport(
            time.perf_counter() - start, received["bytes"], n, len(plan), bool(header["validated"])
        )

    def _connect(self, patience: Patience) -> None:
        """Wait until the rendezvous holds the token's proof, then form the group (both within
        `patience`)."""
        proof = mac(self.token, b"rendezvous").hex().encode()
        while not (
            self._store.check([PROOF_KEY])
            and hmac.compare_digest(self._store.get(PROOF_KEY), proof)
        ):
            patience.check()
            time.sleep(0.05)
        self._pg = process_group(self._store, 1, timeout=patience.remaining())
