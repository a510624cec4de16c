"""Building and ending an in-process vLLM engine: `build_llm` (vLLM's `LLM` with the adapter's
patches and checks installed), `shutdown`, and what an engine's life needs around them (its IPC
directory, the startup collections).
"""

import atexit
import contextlib
import gc
import os
import shutil
import tempfile

from vllm import LLM

from chatgen.core import quiet
from chatgen.generation.vllm.adapter import fast_step, patches, sampled_logprobs, small_linears
from chatgen.generation.vllm.adapter.split_step import check_internals, engine_core
from chatgen.generation.vllm.lean_imports import without_unused_imports

# On CPU every linear layer of the engine over small_linears.SMALL_LINEAR_MAX_BYTES (smaller fp32
# ones run at a few row counts: small_linears.bucketed_small_linears) is a oneDNN matmul with one
# primitive per row count M (tokens in the step), and a decode step's M is the number of running
# sequences: a run meets hundreds of distinct M. Each layer keeps its 32 latest primitives; oneDNN's process-wide cache
# (1024 by default) keeps the rest, ~200 KB apiece, so it grew ~5 MiB per generate on the tiny task
# (peak RSS 1.39 -> 1.17 GiB over 60 episodes with this cap). The primitives compute the same bits
# either way; a capped cache only rebuilds evicted ones (~3 ms an episode). Read once, at vLLM's
# first primitive: set before the first engine of the process (a user's value wins).
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 64


def build_llm(model: str, **engine_kwargs) -> LLM:
    """Start an in-process vLLM engine (`vllm.LLM(model, **engine_kwargs)`) and check the internals
    we use.

    Sleep mode is enabled where the platform has it (CUDA), so `sleep()` really frees memory there;
    on CPU with external_launcher, TP groups get per-job shared memory (see
    `patches.per_job_cpu_shm`). vLLM's IPC sockets (multiprocess executor, TP > 1) go to a directory
    of this engine (VLLM_RPC_BASE_PATH, unless set), which `shutdown` removes: vLLM leaves them in
    /tmp.
    """
    from vllm.platforms import current_platform

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in ("0", "false", "False"):
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for the step-driven VLLMModule; "
            "unset it or set it to 0 before importing chatgen.generation"
        )
    engine_kwargs.setdefault("enable_sleep_mode", current_platform.is_sleep_mode_available())
    if current_platform.is_cpu():
        os.environ.setdefault(
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
        )
        small_linears.bucketed_small_linears()
        patches.rebind_kernels_past_odd_namespaces()
    if (
        current_platform.is_cpu()
        and engine_kwargs.get("distributed_executor_backend") == "external_launcher"
    ):
        patches.per_job_cpu_shm()
    if not quiet.verbose():
        engine_kwargs.setdefault("use_tqdm_on_load", False)  # a progress bar per checkpoint shard
        if current_platform.is_cpu():
            patches.quiet_numa_notice()
    if engine_kwargs.get("enforce_eager"):
        patches.eager_token_ranks()
    rpc_dir = None
    workers = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get(
        "pipeline_parallel_size", 1
    )
    if workers > 1 and engine_kwargs.get("distributed_executor_backend") != "external_launcher":
        if current_platform.is_cpu():  # vLLM's CPU workers need their cores named, one set per rank
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND",
                "|".join(str(i % (os.cpu_count() or 1)) for i in range(workers)),
            )
        # vLLM's multiprocess executor: worker processes, IPC
        if "VLLM_RPC_BASE_PATH" not in os.environ:
            rpc_dir = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="chatgen-vllm-")
            atexit.register(_remove_rpc_dir, rpc_dir)  # also when the engine is never shut down
    try:
        with host_memory_only_gc(current_platform.is_cpu()), without_unused_imports():
            llm = LLM(model, **engine_kwargs)
    except BaseException:
        _remove_rpc_dir(rpc_dir)
        raise
    llm.chatgen_rpc_dir = rpc_dir
    check_internals(llm)
    patches.decode_slots_fast_path(engine_core(llm).scheduler.kv_cache_manager)
    fast_step.plain_output_fast_path(engine_core(llm).scheduler)
    fast_step.plain_decode_schedule_fast_path(engine_core(llm).scheduler)  # after the slots'
    sampled_logprobs.record_sampled_logprobs(llm, in_process_workers(llm))  # where it applies
    llm.collective_rpc(patches.install_reload_log_filter)
    llm.collective_rpc(patches.prepack_cpu_experts_on_reload)
    return llm


def shutdown(llm: LLM) -> None:
    """Stop the engine's workers and free its memory now rather than at garbage collection."""
    from vllm.platforms import current_platform

    with host_memory_only_gc(current_platform.is_cpu()):
        llm.llm_engine.engine_core.shutdown()
    _remove_rpc_dir(getattr(llm, "chatgen_rpc_dir", None))


@contextlib.contextmanager
def host_memory_only_gc(active: bool):
    """Within: gc.collect() of the oldest generation (what vLLM calls while it loads, warms up
    and shuts down, to hand freed device memory back before measuring it) does nothing. On CPU
    there is no device memory to hand back, and each such collection walks the ~70k objects
    vLLM's imports leave: 0.25-0.5 s apiece, five per engine life (1-2 s of a tiny run's
    startup). What they would free, Python's own collections free later. While collection is
    paused (`chatgen.module.startup_gc`, around every module's start) the young generations hold
    every object made since the pause, so collecting them is that same walk: nothing is collected
    then."""
    if not active:
        yield
        return
    collect = gc.collect

    def young_only(generation: int = 2) -> int:
        return collect(generation) if generation < 2 and gc.isenabled() else 0

    gc.collect = young_only
    try:
        yield
    finally:
        gc.collect = collect


def _remove_rpc_dir(rpc_dir) -> None:
    if rpc_dir and os.path.isdir(rpc_dir):
        shutil.rmtree(rpc_dir, ignore_errors=True)
        if os.environ.get("VLLM_RPC_BASE_PATH") == rpc_dir:
            del os.environ["VLLM_RPC_BASE_PATH"]


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def in_process_workers(llm: LLM) -> bool:
    """True when the engine's workers run in this process (uniproc, external_launcher): tensors
    handed to `load_weights` are then used directly, never pickled."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    # also covers external_launcher
    return isinstance(engine_core(llm).model_executor, UniProcExecutor)
