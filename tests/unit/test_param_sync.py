"""Sync logic that needs neither vLLM nor Megatron: bucket plans, the manifest check, stream checks,
the JSON channel protocol over a real 2-process gloo group, the shared-memory file's life, and the launcher.

    python -m pytest tests/unit/test_param_sync.py
"""

import pytest
import torch
from helpers import make_spec

from chatgen.core.distributed import free_port
from chatgen.core.tensors import numel
from chatgen.models import layout
from chatgen.param_sync import LocalWeights, SyncError, check_manifest, checks, weight_source, wire
from chatgen.training import hf_export, launcher


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_plan_sends_every_hf_tensor_once_within_bucket_bounds(tp, pp):
    spec = make_spec(heads=8, groups=2, layers=4, tied=True)
    padded = spec.padded_vocab_size(tp, 16)
    bucket_bytes = 20_000
    plan = hf_export.plan_buckets(spec, tp, pp, padded, itemsize=4, bucket_bytes=bucket_bytes)
    shapes = layout.hf_param_shapes(spec)
    assert checks.plan_manifest([b.hf for b in plan]) == {n: tuple(s) for n, s in shapes.items()}
    assert len(plan) > pp  # small buckets: several per stage
    for b in plan:
        gathered = sum(numel(s) * tp * 4 for s in b.shard_shapes)
        # only a single oversize param may exceed
        assert gathered <= bucket_bytes or len(b.params) == 1
        assert all(sp.local_name.startswith(("decoder", "embedding", "output")) for sp in b.params)
    stages = [b.stage for b in plan]
    assert stages == sorted(stages) and set(stages) == set(range(pp))


def test_plan_keeps_a_layers_experts_in_one_bucket():
    """The experts of one layer travel together (one all-gather over EP): small buckets never split them, so the
    plan is the same whatever the trainer's EP."""
    spec = make_spec("qwen3_moe", layers=2)
    plan = hf_export.plan_buckets(
        spec, 1, 1, spec.padded_vocab_size(1, 16), itemsize=4, bucket_bytes=1
    )
    assert checks.plan_manifest([b.hf for b in plan]) == dict(layout.hf_param_shapes(spec))
    expert_buckets = [b for b in plan if any(sp.expert is not None for sp in b.params)]
    assert len(expert_buckets) == 2  # one per layer, holding all 4 experts' gate_up and down
    for b in expert_buckets:
        assert sorted(sp.expert for sp in b.params) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(b.params) == 1 for b in plan if b not in expert_buckets)


def test_plan_shard_shapes_match_the_conversion():
    spec = make_spec(heads=4, groups=1)
    tp = 2
    padded = spec.padded_vocab_size(tp, 16)
    plan = hf_export.plan_buckets(spec, tp, 1, padded, itemsize=4, bucket_bytes=1 << 30)
    hf = {n: torch.zeros(s) for n, s in layout.hf_param_shapes(spec).items()}
    real = layout.hf_to_megatron(hf, spec, tp, 1, padded)[(0, 0)]
    (bucket,) = plan
    assert {sp.local_name: s for sp, s in zip(bucket.params, bucket.shard_shapes)} == {
        k: tuple(v.shape) for k, v in real.items()
    }


def test_manifest_check_names_each_parameter_and_both_shapes():
    expected = {"a.weight": (4, 2), "b.weight": (3,), "c.bias": (3,)}
    sent = {"a.weight": (2, 4), "b.weight": (3,), "extra.weight": (1,)}
    with pytest.raises(SyncError) as err:
        check_manifest(sent, expected)
    msg = str(err.value)
    assert "keeps its old weights" in msg and "3 mismatch(es)" in msg
    assert "a.weight: trainer sends shape (2, 4), the engine expects (4, 2)" in msg
    assert "c.bias: the engine expects shape (3,), the trainer sends nothing" in msg
    assert "extra.weight: trainer sends shape (1,), the engine has no such parameter" in msg
    check_manifest(expected, dict(expected))  # equal manifests pass


def test_stream_check_catches_reordering_and_value_changes():
    plan = [[("x", (2,)), ("y", (2,))]]
    good = [[("x", torch.ones(2)), ("y", torch.zeros(2))]]
    fps = {"x": checks.fingerprint(torch.ones(2)), "y": checks.fingerprint(torch.zeros(2))}
    assert list(checks.checked(iter(good), plan, fingerprints=fps)) == good
    with pytest.raises(SyncError, match="out of step"):
        list(checks.checked(iter([[("y", torch.zeros(2)), ("x", torch.ones(2))]]), plan))
    with pytest.raises(SyncError, match="validation: x arrived different"):
        list(
            checks.checked(
                iter([[("x", torch.tensor([1.0, 1.5])), ("y", torch.zeros(2))]]),
                plan,
                fingerprints=fps,
            )
        )
    # a permutation keeps the plain sum but not the position-weighted one
    assert checks.fingerprint(torch.tensor([1.0, 2.0])) != checks.fingerprint(
        torch.tensor([2.0, 1.0])
    )


def test_plan_manifest_refuses_a_name_sent_twice():
    with pytest.raises(SyncError, match="sends x twice"):
        checks.plan_manifest([[("x", (2,))], [("x", (2,))]])


def test_local_weights_bucket_by_size_name_nonfinite_tensors_and_unwrap_models():
    pairs = [("a", torch.ones(4)), ("b", torch.ones(4)), ("c", torch.ones(4))]
    weights = LocalWeights(pairs, bucket_bytes=32)  # two float32[4] per bucket
    assert weights.plan == [[("a", (4,)), ("b", (4,))], [("c", (4,))]]
    assert [[n for n, _ in b] for b in weights.buckets()] == [["a", "b"], ["c"]]
    assert weights.nonfinite() == []
    bad = LocalWeights(
        [
            ("a", torch.tensor([1.0, float("nan")])),
            ("b", torch.tensor([float("inf")])),
            ("c", torch.ones(1)),
        ]
    )
    assert bad.nonfinite() == ["a", "b"]
    with pytest.raises(SyncError, match="mixes dtypes"):
        LocalWeights([("a", torch.ones(1)), ("b", torch.ones(1, dtype=torch.bfloat16))])

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(2, 3, bias=False)

    wrapped = torch.nn.Module()
    wrapped.module = Tiny()  # what DistributedDataParallel looks like from outside
    assert weight_source(wrapped).plan == [[("lm_head.weight", (3, 2))]]
    assert weight_source({"x": torch.ones(2)}).plan == [[("x", (2,))]]
    with pytest.raises(TypeError, match=r"\(HF name, tensor\) pairs"):
        weight_source([("x", 1.0)])
    with pytest.raises(TypeError, match="cannot read weights from a int"):
        weight_source(3)


def _channel_peer(port, payload):
    s = wire.rendezvous_store("127.0.0.1", port, is_server=False)
    pg = wire.process_group(s, 0)
    wire.send_json(pg, payload, root=0, me=0)
    return wire.send_json(pg, None, root=1, me=0)


def test_json_channel_round_trip_over_a_private_gloo_group():
    port = free_port()
    store = wire.rendezvous_store("127.0.0.1", port, is_server=True)
    payload = {"buckets": [[["w", [2, 3]]]], "dtype": "torch.float32", "text": "é"}
    job = launcher.DistributedJob(_channel_peer, 1, args=(port, payload))
    pg = wire.process_group(store, 1)
    assert wire.send_json(pg, None, root=0, me=1) == payload
    wire.send_json(pg, {"error": None}, root=1, me=1)
    assert job.join() == [{"error": None}]


def _fails_on_rank_1(x):
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    return x * 2


def test_launcher_returns_results_and_reports_the_failing_rank():
    assert launcher.run_distributed(_fails_on_rank_1, 1, args=(21,)) == [42]
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed(.|\n)*boom on purpose"):
        launcher.run_distributed(_fails_on_rank_1, 2, args=(1,))


def test_check_sync_max_abs_diff_never_hides_nan():
    from chatgen.tools.check_sync import max_abs_diff

    assert max_abs_diff([-1.0, -2.0], [-1.5, -2.0]) == 0.5
    assert max_abs_diff([-1.0], [-1.25], worst=0.5) == 0.5
    nan = float("nan")
    assert max_abs_diff([-1.0, nan], [-1.0, -2.0]) != max_abs_diff([-1.0, nan], [-1.0, -2.0])  # NaN
    assert not max_abs_diff([nan], [0.0]) <= 1e-4  # fails the threshold check
    # a NaN from an earlier sample sticks
    assert not max_abs_diff([-1.0], [-1.0], worst=nan) <= 1e-4
    assert not max_abs_diff([-1.0, -2.0], [-1.0]) <= 1e-4  # misaligned scores fail too


def test_shm_sender_refuses_a_file_it_cannot_create_before_writing(tmp_path):
    """A trainer that cannot create the engine's file (another machine, user or /dev/shm) says so, tells the
    engine, and raises before any collective, so VLLMGeneration's "auto" can still use the group."""
    from chatgen.param_sync import SharedMemoryUnavailable, ShmSender

    told = []
    with pytest.raises(SharedMemoryUnavailable, match="use weight_transport='group'"):
        ShmSender(lambda held: str(tmp_path / "elsewhere" / "weights-1"), told.append).send(
            [("w", torch.ones(4))]
        )
    assert told == [
        {"error": f"the trainer could not create {tmp_path / 'elsewhere' / 'weights-1'}"}
    ]


def test_shm_file_lives_until_the_engine_maps_it_and_the_directory_until_the_receiver_goes(
    tmp_path,
):
    """The file the trainer writes goes as soon as the engine maps it (or refuses it); the mapping is reused for a
    sync of the same size; the directory goes with the receiver. (The load itself, through ShmReceiver.receive_into,
    is tested against vLLM in tests/integration/test_vllm_generation_server.py.)"""
    import os

    from chatgen.param_sync import ShmReceiver, ShmSender

    rx = ShmReceiver(root=str(tmp_path))
    refuse = []
    assert oct(os.stat(rx.directory).st_mode & 0o777) == "0o700"
    seen = []

    def finish(body):  # the engine's side of finish, short of the load: map and read, or refuse
        if rx._map is None:  # the first sync on this file: the trainer made it private
            assert oct(os.stat(rx.path).st_mode & 0o777) == "0o600"
        if refuse:
            rx.drop()
            return refuse[0]
        numel = sum(
            torch.Size(shape).numel() for bucket in body["header"]["buckets"] for _, shape in bucket
        )
        seen.append(torch.frombuffer(rx._mapping(numel * 4), dtype=torch.float32).clone())

    tx = ShmSender(rx.name, finish)
    tx.send([("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2))])
    # unlinked once mapped
    assert seen[0].tolist() == [0, 1, 2, 3, 4, 5, 1, 1] and os.listdir(rx.directory) == []
    path = tx.path
    tx.send([("a", torch.zeros(2, 3)), ("b", torch.full((2,), 7.0))])
    assert tx.path == path and seen[1].tolist() == [0] * 6 + [7, 7]  # the same mapping, rewritten
    with pytest.raises(SyncError, match="refused: why"):
        refuse.append("refused: why")
        tx.send([("c", torch.ones(2))])  # a new file
    assert os.listdir(rx.directory) == [] and rx.path is None and tx.path != path
    directory = rx.directory
    del rx, tx  # (tx holds rx.name, its handshake)
    assert not os.path.exists(directory)


def test_shm_sender_removes_its_file_when_finish_fails(tmp_path):
    """A server killed between the trainer's write and its finish never maps the file: the trainer removes it,
    or the whole model would stay in /dev/shm (issue 28, item 6)."""
    import os

    from chatgen.param_sync import ShmReceiver, ShmSender

    rx = ShmReceiver(root=str(tmp_path))

    def finish(body):
        raise ConnectionError("the server went away")

    tx = ShmSender(rx.name, finish)
    with pytest.raises(ConnectionError):
        tx.send([("w", torch.ones(4))])
    assert os.listdir(rx.directory) == [] and tx.path is None  # the next sync asks for a new file
    rx.close()


def test_stale_segments_of_dead_processes_go_and_live_ones_stay(tmp_path):
    """`chatgen serve --control` removes at start what a killed server (or trainer) of this user left; never a
    directory of a process that still runs, nor one it did not name."""
    import os
    import subprocess
    import sys

    from chatgen.param_sync import remove_stale_segments

    # a pid that has ended
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    names = [
        f"chatgen-weights-{dead}-abc",
        f"chatgen-refit-{dead}-def",
        f"chatgen-weights-{os.getpid()}-ghi",
        f"other-{dead}-jkl",
    ]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_bytes(b"x" * 16)
    removed = remove_stale_segments(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / n) for n in names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_every_transport_speaks_the_one_protocol():
    """Every sender of chatgen.param_sync: send(source, validate, bucket_bytes) and close(); every receiver:
    receive_into(target, mode, ...) and close(). A new transport file is found here by its classes' names."""
    import importlib
    import inspect
    import pkgutil

    import chatgen.param_sync as ps

    senders, receivers = [], []
    for info in pkgutil.iter_modules(ps.__path__):
        module = importlib.import_module(f"chatgen.param_sync.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and name.endswith("Sender"):
                senders.append(cls)
            elif cls.__module__ == module.__name__ and name.endswith("Receiver"):
                receivers.append(cls)
    assert {c.__name__ for c in senders} >= {"LocalSender", "GroupSender", "ShmSender"}
    assert {c.__name__ for c in receivers} >= {"GroupReceiver", "ShmReceiver"}
    for cls in senders:
        assert list(inspect.signature(cls.send).parameters)[:4] == [
            "self",
            "source",
            "validate",
            "bucket_bytes",
        ]
        assert callable(cls.close), cls
    for cls in receivers:
        assert list(inspect.signature(cls.receive_into).parameters)[:3] == [
            "self",
            "target",
            "mode",
        ], cls
        assert callable(cls.close), cls


class Recorder:
    """The generation-module face load_shm writes into: its manifest, and the tensors it was given."""

    needs_resync = None

    def __init__(self):
        self.loaded = {}

    def weight_manifest(self):
        return {"a": (2, 3), "b": (2,)}

    def load_weights(self, buckets, mode="wait"):
        self.loaded.update({n: t.clone() for bucket in buckets for n, t in bucket})


def test_shm_handles_are_signed_over_the_files_path_size_and_content(tmp_path):
    """Issue 50, finding 11: the handles' signature bound the header only, so another file (another
    path, or the same path with other bytes) loaded under a good signature."""
    import shutil

    from chatgen.param_sync import ShmSender, load_shm

    token, weights = "the run's token", [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2))]
    tx = ShmSender.owned(token, root=str(tmp_path))
    handles = tx.write(weights)
    target = Recorder()
    load_shm(target, handles, token)
    assert target.loaded["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    other = tmp_path / "copy"
    shutil.copy(handles["path"], other)
    with pytest.raises(SyncError, match="the handles name .*copy of 32 bytes, the signed header"):
        load_shm(Recorder(), {**handles, "path": str(other)}, token)
    with open(handles["path"], "r+b") as f:  # the same path and size, other bytes
        f.write(torch.full((2,), 9.0).numpy().tobytes())
    refused = Recorder()
    with pytest.raises(SyncError, match="is not the file the trainer signed"):
        load_shm(refused, handles, token)
    assert refused.loaded == {}
    tx.close()


def test_shm_rewrites_its_file_in_place_and_an_earlier_writes_handles_are_refused(tmp_path):
    """An owning sender rewrites its file when the size is unchanged (new pages would cost the
    trainer as much as the copy); the digest it signs, taken tensor by tensor during the copy, is
    the whole file's BLAKE3, so the handles of an earlier write no longer load."""
    import blake3

    from chatgen.param_sync import ShmSender, load_shm

    token, weights = "the run's token", [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2))]
    tx = ShmSender.owned(token, root=str(tmp_path))
    first = tx.write(weights)
    second = tx.write([(n, t + 1) for n, t in weights])
    assert second["path"] == first["path"]
    with open(second["path"], "rb") as f:
        assert second["header"]["file"]["blake3"] == blake3.blake3(f.read()).hexdigest()
    refused = Recorder()
    with pytest.raises(SyncError, match="is not the file the trainer signed"):
        load_shm(refused, first, token)
    assert refused.loaded == {}
    target = Recorder()
    load_shm(target, second, token)
    assert target.loaded["a"].tolist() == [[1, 2, 3], [4, 5, 6]]
    tx.close()
    assert list(tmp_path.iterdir()) == []
