"""The cross-process weight channel (chatgen.param_sync.group: GroupReceiver / GroupSender over a real TCPStore and
gloo group) against strangers and stalled trainers, with an engine stand-in that holds plain tensors.

    python -m pytest tests/unit/test_weight_channel.py

A process that reaches the rendezvous port but lacks the token writes nothing, whether it speaks the old
unauthenticated protocol, forges the rendezvous proof, or joins the group in the trainer's place (issue 24,
finding 1); every wait of the engine ends at its deadline or when stopped, and the channel then closes
(finding 2); the engine finds NaN in what it receives whatever the trainer's header says (finding 4).
"""

import threading
import time

import pytest
import torch

from chatgen.param_sync import GroupReceiver, GroupSender, SyncError, checks, sync_weights, wire
from chatgen.training import launcher

pytestmark = pytest.mark.faults

WEIGHTS = {"lm_head.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}


class Engine:
    """The weight half of the generation contract (chatgen.generation.base) over plain tensors, written in
    place the way vLLM's reload writes: a failure once the load began leaves it needing a re-sync."""

    def __init__(self):
        self.weights = {name: t.clone() for name, t in WEIGHTS.items()}
        self.weight_version, self.needs_resync = 0, None

    def weight_manifest(self) -> dict:
        return {name: tuple(t.shape) for name, t in self.weights.items()}

    def load_weights(self, buckets, mode="wait") -> int:
        try:
            for bucket in buckets:
                for name, t in bucket:
                    self.weights[name].copy_(t)
        except BaseException as e:
            self.needs_resync = f"a weight update failed: {e}"
            raise
        self.needs_resync = None
        self.weight_version += 1
        return self.weight_version


def receive_in_background(rx, engine, **kwargs):
    """Run rx.receive_into(engine) on a thread (as chatgen serve does); returns (thread, {"report"|"error": ...})."""
    out = {}

    def run():
        try:
            out["report"] = rx.receive_into(engine, **kwargs)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def zeros():
    return {name: torch.zeros_like(t) for name, t in WEIGHTS.items()}


def _old_protocol_stranger(port):
    """What the weight channel accepted before it was authenticated: set the ready key, join as rank 0, send a
    header and the weights (here: zeros, what zeroed the LM head of a live server)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=20))
    store.set("chatgen_sync_sender_ready", "1")
    # times out: the engine never joins
    pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=20))
    header = {
        "dtype": "torch.float32",
        "buckets": [[[n, list(t.shape)] for n, t in WEIGHTS.items()]],
        "nonfinite": [],
        "validated": False,
        "fingerprints": None,
    }
    wire.send_json(pg, header, root=0, me=0)
    wire.send_json(pg, None, root=1, me=0)
    wire.bcast(pg, torch.zeros(1, dtype=torch.int64), root=0)
    wire.bcast(pg, torch.zeros(sum(t.numel() for t in WEIGHTS.values())), root=0)
    return "wrote"


def test_a_stranger_speaking_the_unauthenticated_protocol_writes_nothing():
    """It used to be: whoever connects first is the trainer (weight_version 6 -> 7, an LM head of zeros)."""
    engine, rx = Engine(), GroupReceiver.listen(timeout=4)
    thread, out = receive_in_background(rx, engine)
    stranger = launcher.DistributedJob(_old_protocol_stranger, 1, args=(rx.port,))
    thread.join(30)
    assert not thread.is_alive() and "waited 4 s for a trainer to connect" in str(out["error"])
    assert "keeps its old weights" in str(out["error"]) and rx.closed
    assert engine.weight_version == 0 and torch.equal(
        engine.weights["lm_head.weight"], WEIGHTS["lm_head.weight"]
    )
    with pytest.raises(RuntimeError):  # its group never formed: the engine never joined it
        stranger.join()
    stranger.stop()


def _stranger_in_the_group(port, proof):
    """A stranger that copied the rendezvous proof (anyone connected to the store can read every key) and joined
    the group as rank 0, but does not hold the token: it proves a guess."""
    store = wire.rendezvous_store("127.0.0.1", port, is_server=False)
    store.set(wire.PROOF_KEY, proof)
    pg = wire.process_group(store, 0)
    try:
        wire.authenticate(pg, "a guess", 0)
    except SyncError as e:
        return str(e)
    wire.send_json(pg, {"dtype": "torch.float32", "buckets": [], "nonfinite": []}, root=0, me=0)
    return "authenticated"


def test_a_stranger_in_the_trainers_place_is_refused_before_the_manifest():
    engine, rx = Engine(), GroupReceiver.listen(timeout=20)
    thread, out = receive_in_background(rx, engine)
    proof = checks.mac(rx.token, b"rendezvous").hex()  # as a legitimate trainer would have set it
    stranger = launcher.DistributedJob(_stranger_in_the_group, 1, args=(rx.port, proof))
    # the engine did not prove itself to it
    assert "did not accept this update's token" in stranger.join()[0]
    thread.join(20)
    assert "did not prove this update's token" in str(
        out["error"]
    ) and "keeps its old weights" in str(out["error"])
    assert rx.closed and engine.weight_version == 0 and engine.needs_resync is None
    with pytest.raises(SyncError, match="channel was closed"):
        rx.receive_into(engine)


def test_a_forged_rendezvous_proof_starts_no_group_and_the_trainer_still_can():
    """A wrong proof in the rendezvous does not make the engine join anything; the trainer's own proof (it
    overwrites the key) does, and its weights land."""
    engine, rx = Engine(), GroupReceiver.listen(timeout=20)
    thread, out = receive_in_background(rx, engine)
    store = wire.rendezvous_store("127.0.0.1", rx.port, is_server=False)
    store.set(wire.PROOF_KEY, "00" * 32)
    time.sleep(0.5)
    assert thread.is_alive() and rx._pg is None
    new = {name: t + 1 for name, t in WEIGHTS.items()}
    assert sync_weights(new, GroupSender.to("127.0.0.1", rx.port, rx.token)).tensors == 2
    thread.join(20)
    assert out["report"].tensors == 2 and engine.weight_version == 1
    assert torch.equal(engine.weights["model.norm.weight"], new["model.norm.weight"])


def test_each_update_proves_its_own_token_over_the_open_group():
    """A group stays open between one client's updates; each update's token (a new one per begin, as the server
    hands them out) is proven again over it, so an old token sends nothing."""
    engine, rx = Engine(), GroupReceiver.listen(timeout=20)
    tx = GroupSender.to("127.0.0.1", rx.port, rx.token)
    thread, _ = receive_in_background(rx, engine)
    sync_weights(zeros(), tx)
    thread.join(20)
    tx.token = rx.new_token()
    thread, _ = receive_in_background(rx, engine)
    sync_weights(WEIGHTS, tx)
    thread.join(20)
    assert engine.weight_version == 2 and torch.equal(
        engine.weights["lm_head.weight"], WEIGHTS["lm_head.weight"]
    )
    rx.new_token()  # the server's next begin; this sender still holds the last one
    thread, out = receive_in_background(rx, engine)
    with pytest.raises(SyncError, match="did not accept this update's token.*nothing was sent"):
        sync_weights(zeros(), tx)
    thread.join(20)
    assert "did not prove this update's token" in str(out["error"]) and engine.weight_version == 2


class Stalls:
    """A weight source (chatgen.param_sync.weight_source's protocol) whose second bucket takes `seconds`: a
    trainer stalled (or dead without closing its sockets) mid-sync."""

    def __init__(self, seconds):
        self.seconds, self.dtype = seconds, torch.float32
        self.plan = [[(name, tuple(t.shape))] for name, t in WEIGHTS.items()]

    def hf_weights(self, bucket_bytes):
        return self

    def nonfinite(self):
        return []

    def buckets(self):
        for i, (name, t) in enumerate(WEIGHTS.items()):
            if i:
                time.sleep(self.seconds)
            yield [(name, t * 3)]


def test_a_trainer_stalling_mid_sync_costs_one_sync_not_the_engine():
    engine, rx = Engine(), GroupReceiver.listen(timeout=2)
    thread, out = receive_in_background(rx, engine)
    tx = GroupSender.to("127.0.0.1", rx.port, rx.token)
    start = time.monotonic()
    with pytest.raises(Exception):  # the engine left: the trainer's next operation fails
        sync_weights(Stalls(4), tx)
    thread.join(20)
    assert time.monotonic() - start < 15
    assert "waited 2 s for bucket 2 of 2" in str(out["error"]) and "PARTIALLY updated" in str(
        out["error"]
    )
    # honest: the engine says it needs a re-sync
    assert engine.needs_resync is not None and rx.closed
    rx = GroupReceiver.listen(timeout=20)  # a new channel: the next sync repairs the engine
    thread, out = receive_in_background(rx, engine)
    sync_weights(WEIGHTS, GroupSender.to("127.0.0.1", rx.port, rx.token))
    thread.join(20)
    assert engine.needs_resync is None and engine.weight_version == 1


def test_a_stopped_wait_ends_at_once_and_a_deadline_ends_the_connect():
    engine, stop = Engine(), threading.Event()
    rx = GroupReceiver.listen(timeout=60)
    thread, out = receive_in_background(rx, engine, alive=lambda: not stop.is_set())
    time.sleep(0.3)
    start = time.monotonic()
    stop.set()
    thread.join(10)
    assert (
        time.monotonic() - start < 2
        and "stopped while the engine waited" in str(out["error"])
        and rx.closed
    )


class LiesAboutNaN:
    """A weight source whose header claims every weight finite although one holds NaN."""

    def __init__(self):
        self.dtype = torch.float32
        self.tensors = {name: t.clone() for name, t in WEIGHTS.items()}
        self.tensors["model.norm.weight"][1] = float("nan")
        self.plan = [[(name, tuple(t.shape)) for name, t in self.tensors.items()]]

    def hf_weights(self, bucket_bytes):
        return self

    def nonfinite(self):
        return []

    def buckets(self):
        yield list(self.tensors.items())


def test_the_engine_finds_nan_itself_whatever_the_header_says():
    engine, rx = Engine(), GroupReceiver.listen(timeout=20)
    tx = GroupSender.to("127.0.0.1", rx.port, rx.token)
    thread, out = receive_in_background(rx, engine)
    with pytest.raises(
        SyncError,
        match=r"found NaN or inf in 1 parameter\(s\) the trainer sent \(model.norm.weight",
    ):
        sync_weights(LiesAboutNaN(), tx)
    thread.join(20)
    assert "although its header said none" in str(out["error"])
    # the NaN never reached the engine
    assert all(torch.isfinite(t).all() for t in engine.weights.values())
    assert not rx.closed  # both ends stayed in step: the channel serves the next sync
    thread, _ = receive_in_background(rx, engine)
    sync_weights(WEIGHTS, tx)
    thread.join(20)
    assert engine.needs_resync is None and engine.weight_version == 1
