"""The wire of the collective transport: a rendezvous store and a private torch.distributed group
(gloo on CPU, NCCL on GPU), broadcasts with deadlines (`Patience`), JSON messages (never pickle: the
peer is another process), the token challenge every member passes before each sync (`authenticate`),
and the trainer ranks' shared verdict.

The group: whoever hosts it (the engine, or a run's trainer) serves a torch TCPStore (the
rendezvous) and the members form a private group (gloo on CPU, NCCL on GPU) that carries the
weights. Anyone who reaches the store's port can read, write and delete its keys (list_keys
included), and so take part in the group's rendezvous: nothing a stranger can do there may become a
weight. So the members share a token (handed over by whoever set the channel up: the authenticated
HTTP begin call, a Ray call, a child's arguments), and
  1. an engine that hosts the rendezvous starts the group only once it holds an HMAC of the token
     (PROOF_KEY): a stranger cannot make the engine connect anywhere;
  2. before every sync, over the group's own connections (the ones the tensors will come through),
     every member proves the token (`authenticate`): a fresh nonce from each, then
     HMAC-SHA256(token, role | the nonces) from each, checked by all in constant time. A peer that
     joined in the trainer's place fails here, before the manifest or any tensor is read; a trainer
     talking to a stranger in an engine's place sends nothing.
Every wait of a listening engine has a deadline and can be stopped (`Patience`): a trainer that dies
or stalls mid-sync costs one failed sync, never a stuck engine.
"""

import datetime
import hmac
import json
import secrets
import socket
import time

import torch
import torch.distributed as dist

from chatgen.core.distributed import tcp_store
from chatgen.param_sync.checks import SyncError, checked, mac, sync_header

DEFAULT_TIMEOUT_S = (
    600.0  # the engine's patience at each step of a sync (connect, manifest, each bucket, the end)
)
# the trainer's group: the engine's deadlines bound its waits
TRAINER_TIMEOUT = datetime.timedelta(minutes=10)
PROOF_KEY = "chatgen_weight_sync_proof"


def rendezvous_store(host: str, port: int, is_server: bool, world_size: int = 2):
    """The rendezvous of a group of `world_size` members (a loopback host: a loopback-only
    listener)."""
    return tcp_store(host, port, world_size, is_server, timeout=TRAINER_TIMEOUT)


def process_group(
    store, rank: int, world_size: int = 2, timeout: datetime.timedelta = TRAINER_TIMEOUT
):
    """The members' own group (0 = trainer rank 0, the others engine ranks), independent of any
    default group: NCCL when every member is on a GPU of its own, else gloo (through host
    memory). Chosen by where the members are, which each writes into the rendezvous: NCCL cannot
    pair two ranks on one device (a trainer and `chatgen serve --control` sharing a GPU), and a
    CPU member has no NCCL."""
    keys = [f"chatgen_sync_device_{r}" for r in range(world_size)]
    store.set(keys[rank], where())
    # the caller's deadline (a listening engine's patience), not the store's
    store.wait(keys, timeout)
    places = [store.get(key).decode() for key in keys]
    if nccl_among(places):
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def where() -> str:
    """This process's device for a sync: "cpu", or "<host>:<GPU uuid>"."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"{socket.gethostname()}:{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


def nccl_among(places: list) -> bool:
    """Whether members at `places` (each one's `where()`) can form an NCCL group: all on GPUs, no
    two on one."""
    return all(p != "cpu" for p in places) and len(set(places)) == len(places)


def device(pg=None):
    """Where the tensors of group `pg` live: the GPU for NCCL, the host for gloo."""
    if isinstance(pg, dist.ProcessGroupGloo) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class Patience:
    """How long the engine waits for the trainer at one step of a sync (`what`), and whether it
    still should (`alive()`, polled): an operation on the group that outlasts either raises
    SyncError."""

    def __init__(self, seconds: float, alive, what: str):
        self.seconds, self.alive, self.what = seconds, alive, what
        self.end = time.monotonic() + seconds

    def remaining(self) -> datetime.timedelta:
        """For the operation's own timeout: a second past the deadline, so that `check` reports
        first."""
        return datetime.timedelta(seconds=max(self.end - time.monotonic(), 0) + 1)

    def check(self) -> None:
        if self.alive is not None and self.alive() is False:
            raise SyncError(f"the sync was stopped while the engine waited for {self.what}")
        if time.monotonic() > self.end:
            raise SyncError(
                f"the engine waited {self.seconds:g} s for {self.what}, in vain (the trainer died, "
                "stalled, or never came)"
            )

    def wait(self, work) -> None:
        pause = 5e-4
        while not work.is_completed():
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


def bcast(pg, tensor: torch.Tensor, root: int, patience: Patience | None = None) -> torch.Tensor:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    if patience is not None:
        # gloo's own bound: an operation given up on ends soon after
        opts.timeout = patience.remaining()
    work = pg.broadcast([tensor], opts)
    if patience is not None:
        patience.wait(work)
    work.wait()
    return tensor


def send_json(pg, obj, root: int, me: int, patience: Patience | None = None):
    """Broadcast a JSON-able object from `root` (never pickle: the peer is another process)."""
    if me == root:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(
            device(pg)
        )
        bcast(
            pg, torch.tensor([data.numel()], dtype=torch.int64, device=device(pg)), root, patience
        )
        bcast(pg, data, root, patience)
        return obj
    n = bcast(pg, torch.zeros(1, dtype=torch.int64, device=device(pg)), root, patience)
    data = bcast(pg, torch.empty(int(n), dtype=torch.uint8, device=device(pg)), root, patience)
    return json.loads(bytes(data.cpu().tolist()).decode())


def exchange(pg, mine: bytes, root: int, me: int, patience: Patience | None) -> bytes:
    """32 bytes from `root` to the other end (`mine` on the root, ignored elsewhere)."""
    tensor = torch.frombuffer(bytearray(mine if me == root else bytes(32)), dtype=torch.uint8).to(
        device(pg)
    )
    return bytes(bcast(pg, tensor, root, patience).cpu().tolist())


def authenticate(
    pg, token: str, me: int, patience: Patience | None = None, world_size: int = 2
) -> None:
    """Every member of the group proves it holds `token` (see above): member 0 the trainer, the
    others engines. SyncError at each member that finds a proof wrong (every member checks every
    proof, so all of them stop together). The trainer proves first; an engine answers with its
    own proof only to a trainer that proved, and with zeros otherwise, so that no member is left
    waiting."""
    nonces = [
        exchange(pg, secrets.token_bytes(32), root, me, patience) for root in range(world_size)
    ]
    proofs = [
        mac(token, b"trainer" if r == 0 else b"engine %d" % r, *nonces) for r in range(world_size)
    ]
    trainer_proved = hmac.compare_digest(exchange(pg, proofs[0], 0, me, patience), proofs[0])
    failed = [
        r
        for r in range(1, world_size)
        if not hmac.compare_digest(
            exchange(pg, proofs[r] if trainer_proved else bytes(32), r, me, patience), proofs[r]
        )
    ]
    if me != 0 and not trainer_proved:
        raise SyncError(
            "the peer on the weight channel did not prove this update's token (it is not the trainer "
            "the channel was opened for); the channel is closed"
        )
    if me == 0 and failed:
        raise SyncError(
            "weight sync refused: the engine at the other end of the weight channel did not accept "
            "this update's token (a stale token, or a peer that is not the engine that opened the "
            "channel); nothing was sent" + (f" (engine rank(s) {failed})" if world_size > 2 else "")
        )
    if failed:
        raise SyncError(
            f"weight sync refused, this engine keeps its old weights: engine rank(s) {failed} of the "
            "weight channel did not prove the run's token (a process that is not one of the run's "
            "engines joined it)"
        )


def share(obj):
    """Rank 0's object on every trainer rank (the verdicts decide whether all ranks raise)."""
    # a trainer without torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def verdicts(pg, mine, me: int, world_size: int, patience: Patience | None = None) -> list:
    """Every engine rank's verdict ({"error": None or why}) on every member, one small broadcast
    per engine rank."""
    return [
        send_json(pg, mine if me == r else None, root=r, me=me, patience=patience)
        for r in range(1, world_size)
    ]


def refusal(verdicts: list) -> str | None:
    """One message for every engine rank that refused (a single engine's own words), or None when all took the
    weights."""
    bad = [(r, v["error"]) for r, v in enumerate(verdicts, 1) if v["error"]]
    if not bad:
        return None
    if len(verdicts) == 1:
        return bad[0][1]
    return f"{len(bad)} of {len(verdicts)} engine rank(s) refused the weight sync; " + "; ".join(
        f"engine rank {r}: {why}" for r, why in bad[:4]
    )


def follow(weights, validate: bool) -> int:
    """A trainer rank other than 0 during any transport's send: the source's collectives in rank
    0's order (the header, every bucket) and rank 0's verdicts, shared after the header and at
    the end (`share`), so that every rank returns or raises together. Returns the tensors read."""
    # collective over the trainer ranks (nonfinite, the fingerprints)
    sync_header(weights, validate)
    verdict = share(None)
    if verdict["error"]:
        raise SyncError(verdict["error"])
    n = 0
    for items in checked(weights.buckets(), weights.plan, weights, validate):
        n += len(items)
    result = share(None)
    if result["error"]:
        raise SyncError(result["error"])
    return n
