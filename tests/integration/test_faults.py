"""Fault injection against real engines: what a run listens on, what a bad sync or a bad model leaves behind.

    python -m pytest tests/integration/test_faults.py        # ~1.5 min on 2 idle CPU cores

Each test reproduces one finding of issue 13 and asserts the fixed behaviour; docs/failure_and_security.md
describes the behaviour for users. (The faults without an engine are in the unit tests, marked `faults`.)
"""

import os
from pathlib import Path

import psutil
import pytest
from helpers import is_loopback, listeners, selected_tests

pytestmark = [pytest.mark.integration, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def multiprocess_engine(request, tiny_llama_dir):
    """The subprocess of test_a_multiprocess_engine_leaves_no_socket_in_tmp, started when the module
    begins (when that test is selected): seconds of imports and a TP 2 engine's start in processes of
    its own, beside the in-process engine tests that come before that test. The tests that start Ray
    come after it: a Ray start has a deadline a busier machine can miss. (its private TMPDIR, the
    process, its stderr)"""
    import subprocess
    import sys
    import tempfile

    if "test_a_multiprocess_engine_leaves_no_socket_in_tmp" not in selected_tests(
        request, __file__
    ):
        yield None
        return
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))  # short: a Unix socket's path holds at most 107 bytes
    code = (
        "from chatgen.generation.vllm import adapter as a; "
        f"llm = a.build_llm({str(tiny_llama_dir)!r}, load_format='dummy', enforce_eager=True, "
        "skip_tokenizer_init=True, tensor_parallel_size=2, distributed_executor_backend='mp', "
        "kv_cache_memory_bytes=16 << 20); a.shutdown(llm)"
    )
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    env.pop("VLLM_RPC_BASE_PATH", None)
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a pipe nobody reads yet could fill
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=REPO,
            env=env,
        )
        yield tmp, proc, stderr
        proc.kill()
        proc.wait()


def nan_model(model_dir, out, name="model.norm.weight"):
    """A copy of HF directory `model_dir` whose tensor `name` holds a NaN (a diverged training run's export)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    weights[name][0] = float("nan")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_generate_on_a_nan_model_fails_and_writes_nothing(tiny_llama_dir, tmp_path, capsys):
    from chatgen.cli import main

    model = nan_model(tiny_llama_dir, tmp_path / "nan-model")
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"prompt_ids": [1, 5, 6]}\n{"prompt_ids": [1, 7]}\n')
    rc = main(
        [
            "generate",
            "--model",
            str(model),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "2",
            "kv_cache_memory_bytes=33554432",
            "enforce_eager=true",
        ]
    )
    assert rc == 1 and "NaN or inf log-probs" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def resized_vocab(model_dir, out, vocab_size: int):
    """A copy of HF directory `model_dir` whose model has `vocab_size` embedding / LM-head rows (its tokenizer
    unchanged): a model paired with another model's tokenizer."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    old, config["vocab_size"] = config["vocab_size"], vocab_size
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = weights[name]
        weights[name] = (
            t[:vocab_size].clone() if vocab_size <= old else torch.cat([t, t[: vocab_size - old]])
        )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_tokenizer_larger_than_the_model_is_refused_at_setup(tiny_llama_dir, tmp_path, capsys):
    """It used to abort the process (SIGABRT, `index out of bounds` in the embedding) at the first prompt."""
    from chatgen.cli import main

    # the tokenizer has 512 tokens
    model = resized_vocab(tiny_llama_dir, tmp_path / "small-vocab", 256)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "9 1 4"}\n')
    rc = main(
        [
            "generate",
            "--model",
            str(model),
            "--input",
            str(prompts),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--max-new-tokens",
            "2",
            "kv_cache_memory_bytes=33554432",
            "enforce_eager=true",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and f"has 512 tokens, the model {model}/config.json has vocab_size=256" in err
    # token ids: checked per input line
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 300]}\n')
    rc = main(
        [
            "generate",
            "--model",
            str(model),
            "--input",
            str(prompts),
            "--output",
            str(tmp_path / "out.jsonl"),
        ]
    )
    assert (
        rc == 2
        and "in.jsonl:2: \"prompt_ids\": token id(s) [300] outside the model's vocabulary [0, 256)"
        in capsys.readouterr().err
    )


# ---- one engine for the rest of the file (vLLM: one engine per process; an engine started and shut
# down while it lives would end its torch.distributed state, so the tests above with their own engines come first)


@pytest.fixture(scope="module")
def module(tiny_llama_dir):
    from chatgen.generation.vllm.module import VLLMModule

    m = VLLMModule(
        dict(
            load=str(tiny_llama_dir),
            kv_cache_memory_bytes=32 << 20,
            enforce_eager=True,
            seq_length=64,
            new_token_limit=True,
            max_new_tokens=4,
            temperature=0.0,
            seed=0,
        )
    ).start()
    yield m
    m.shutdown()


def batch(rows, pad):
    import torch

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


def test_a_failed_sync_keeps_old_weights_or_refuses_to_generate(
    module, tiny_llama_dir, monkeypatch
):
    """A NaN weight is refused before anything is written (the engine still generates as before). A sync that
    fails once vLLM's reload has begun (which releases the old weights) says the engine must be synced again,
    and generating is refused with that message until a sync completes (it used to fail deep in vLLM with
    'Meta tensors', or worse, claim the old weights were kept)."""
    from safetensors.torch import load_file

    from chatgen.param_sync import SyncError, source, sync_weights

    prompts = batch([[1, 5, 6, 7], [1, 9]], module.pad_token_id)
    before = module.generate(prompts, greedy=True)["output_ids"]
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    poisoned = {**weights, "model.norm.weight": weights["model.norm.weight"].clone()}
    poisoned["model.norm.weight"][3] = float("nan")
    with pytest.raises(
        SyncError,
        match=r"keeps its old weights: 1 parameter\(s\) hold NaN or inf: model.norm.weight",
    ):
        sync_weights(poisoned, module)
    assert module.needs_resync is None and module.generate(prompts, greedy=True)[
        "output_ids"
    ].equal(before)

    # validation sees the first bucket differ from its independent read
    real = source.LocalWeights.reference
    monkeypatch.setattr(
        source.LocalWeights, "reference", lambda self, i: [t + 1 for t in real(self, i)]
    )
    with pytest.raises(
        SyncError, match=r"PARTIALLY updated .* synced again .*validation: .* differs"
    ):
        sync_weights(weights, module, validate=True)
    assert "needs a re-sync" in module.needs_resync
    with pytest.raises(
        RuntimeError, match="a weight update failed .* needs a re-sync: it refuses to generate"
    ):
        module.generate(prompts, greedy=True)
    monkeypatch.undo()
    sync_weights(weights, module, validate=True)  # a complete sync repairs it
    assert module.needs_resync is None and module.generate(prompts, greedy=True)[
        "output_ids"
    ].equal(before)


def test_bad_api_inputs_are_refused_and_the_engine_keeps_serving(module):
    """Out-of-vocabulary ids used to end in a 116-line traceback from the embedding; a bool id tensor came back
    as bool outputs; a string of stop strings was split into characters."""
    import torch

    pad = module.pad_token_id
    with pytest.raises(
        ValueError, match=r"row 1: token id\(s\) \[600\] outside the model's vocabulary \[0, 512\)"
    ):
        module.generate(batch([[1, 5], [1, 600]], pad), greedy=True)
    good = batch([[1, 5, 6, 7], [1, 9]], pad)
    with pytest.raises(ValueError, match="input_ids is a torch.bool tensor"):
        module.generate({**good, "input_ids": good["input_ids"].bool()})
    with pytest.raises(ValueError, match=r"stop_strings\[0\] = 'ab'"):
        module.generate({**good, "stop_strings": ["ab", None]})
    out = module.generate(good, greedy=True)  # nothing was left queued by the refused calls
    assert out["output_ids"].dtype == torch.long and out["generation_lengths"].tolist() == [4, 4]


def test_a_multiprocess_engine_leaves_no_socket_in_tmp(multiprocess_engine):
    """Each `check-sync --infer-tp 2` used to leave 8 Unix sockets of vLLM's IPC in /tmp: a TP 2 engine (vLLM's
    multiprocess executor, as check-sync starts it) built and shut down through vllm_adapter leaves none."""
    import shutil
    import stat

    tmp, proc, stderr = multiprocess_engine
    proc.wait(timeout=300)
    stderr.seek(0)
    left = [
        str(p)
        for p in tmp.rglob("*")
        if stat.S_ISSOCK(p.lstat().st_mode) or p.name.startswith("chatgen-vllm")
    ]
    shutil.rmtree(tmp)
    assert proc.returncode == 0, stderr.read()[-3000:]
    assert not left, left


def test_an_engine_dying_mid_sync_is_named_as_the_engines():
    """Issue 28, finding 10: an engine killed mid-sync was reported as a `policy_trainer.sync` death
    (the trainer's send fails first). The engines' side of the sync is read: a dead actor is
    named."""
    import ray

    from chatgen.rlhf.weight_links import engine_death

    @ray.remote
    class Engine:
        def receive(self, die: bool):
            if die:
                os._exit(1)
            raise ConnectionError("the trainer went away")

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        alive, dying = Engine.remote(), Engine.remote()
        failure = engine_death("policy", [alive.receive.remote(False), dying.receive.remote(True)])
        assert "policy: an engine actor died during the weight sync (rank 1)" in str(failure)
        assert engine_death("policy", [alive.receive.remote(False)]) is None  # an error, no death
    finally:
        ray.shutdown()
    assert engine_death("policy", [lambda: None]) is None  # in process: nothing to ask


# A driver as `chatgen train` is one with `runtime.launcher: ray`: chatgen.cli's SIGTERM handler, a Ray started
# by init_ray, a group of two ranks that joined their torch.distributed (gloo) world, a Runtime shut down on the
# way out.
DRIVER = """if True:
    import signal, sys, time
    from chatgen.cli import Terminated, _terminate
    from chatgen.rlhf.placement import GroupPlan
    from chatgen.rlhf.runtime import ActorGroup, Runtime, init_ray, worker_env
    signal.signal(signal.SIGTERM, _terminate)
    runtime = Runtime([], {}, init_ray(None, 2))
    try:
        runtime.groups.append(ActorGroup(GroupPlan(["a"], 2, 0, 0.5, {}), worker_env()))
        runtime.groups[0].setup([[], []])
        print("READY", runtime.local_ray.dir, flush=True)
        time.sleep(600)
    except Terminated:
        sys.exit(143)
    finally:
        runtime.shutdown()
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_ray_driver_listens_on_loopback_only_and_leaves_nothing_when_killed(sig, tmp_path):
    """Ray used to listen on every interface (GCS, raylet, workers, the agents); kill -9 of the driver left Ray's
    agents alive ~90 s (one listening) and /tmp/ray behind; SIGTERM gave rc 134 and a Ray stack dump. Now every
    listening socket of the driver's process tree is loopback, nothing is left within seconds of either signal,
    and SIGTERM is a clean exit 143."""
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "driver.err"
    with open(log, "w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO
        )
    ready = driver.stdout.readline()
    assert ready.startswith("READY"), log.read_text()[-3000:]
    session = Path(ready.split()[1])
    root = psutil.Process(driver.pid)
    ray_processes = root.children(recursive=True)
    assert any(p.name() == "ray::DashboardAgent" for p in ray_processes)
    found = listeners(root)
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names and any(
        n.startswith("ray::ModelWorker") for n in names
    ), found
    assert not [entry for entry in found if not is_loopback(entry[1])], (
        f"listening beyond loopback: {found}"
    )
    assert session.is_dir() and any(session.iterdir())  # Ray's session files: here, not in /tmp/ray
    # the run's actors at the driver's priority (Ray's default is niceness 15), no idle workers
    workers = [p for p in ray_processes if p.name().startswith("ray::ModelWorker")]
    assert workers and {p.nice() for p in workers} == {os.nice(0)}, [p.nice() for p in workers]
    assert not [p for p in ray_processes if p.name() == "ray::IDLE"]
    start = time.monotonic()
    driver.send_signal(getattr(signal, sig))
    rc = driver.wait(timeout=60)
    stderr = log.read_text()
    _, alive = psutil.wait_procs(ray_processes, timeout=20)
    assert not alive, f"left after {sig}: {[(p.name(), p.pid) for p in alive]}"
    # ~5 s on an idle machine (Ray's agents alone took ~60 s to go)
    assert time.monotonic() - start < 45
    for _ in range(20):  # the reaper removes the session directory after the last kill
        if not session.exists():
            break
        time.sleep(0.5)
    assert not session.exists()
    if sig == "SIGTERM":
        assert rc == 143 and "SIGTERM received" not in stderr and "Traceback" not in stderr, stderr[
            -2000:
        ]
    else:
        assert rc == -9
