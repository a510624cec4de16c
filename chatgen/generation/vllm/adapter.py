"""The one place in chatgen that touches vLLM internals (written against vLLM 0.32).

`VLLMModule` drives vLLM one engine step at a time so that the framework, not vLLM, owns the loop. The public
`LLMEngine.step()` fuses "schedule" and "run the model"; this module splits them:

    schedule(llm)            -> ScheduledBatch     scheduler.schedule()
    execute(llm, batch)      -> [RequestOutput]    executor.execute_model + sample_tokens,
                                                   scheduler.update_from_output, output_processor

which is exactly `EngineCore.step()` + `InprocClient.get_output()` + `LLMEngine.step()` for an in-process,
single-batch-queue engine. Everything else here uses vLLM's public API (`LLM`, `SamplingParams`,
`LLMEngine.add_request`, `collective_rpc`).

`record_routed_experts(llm)` makes `execute` record, for a mixture-of-experts model, the experts each token was routed
to (vLLM's router capture hook) and hand them out on each finished sample as `CompletionOutput.routed_experts`.

`check_internals(llm)` asserts every private attribute this relies on; `build_llm` calls it, and
tests/integration/test_generation_engine.py checks it and compares a split-step run with `LLM.generate`
token for token, so a vLLM upgrade that moves any of it fails loudly there instead of generating garbage.

Weight sync (chatgen.param_sync) writes into the engine with `load_weights(llm, named_tensors)`.
"""
import atexit
import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable

# The engine core must live in this process: the framework steps it and syncs weights into it in place.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from chatgen.generation.vllm.ray_free import without_ray  # noqa: E402

with without_ray():
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import RequestOutputKind

from chatgen.core import quiet  # noqa: E402

TESTED_VLLM = "0.32"

# On CPU every linear layer of the engine is a oneDNN matmul with one primitive per row count M (tokens in the
# step), and a decode step's M is the number of running sequences: a run meets hundreds of distinct M. Each layer
# keeps its 32 latest primitives; oneDNN's process-wide cache (1024 by default) keeps the rest, ~200 KB apiece,
# so it grew ~5 MiB per generate on the tiny task (peak RSS 1.39 -> 1.17 GiB over 60 episodes with this cap).
# The primitives compute the same bits either way; a capped cache only rebuilds evicted ones (~3 ms an episode).
# Read once, at vLLM's first primitive: set before the first engine of the process (a user's value wins).
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 64

__all__ = [
    "LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "ScheduledBatch", "TESTED_VLLM",
    "build_llm", "check_internals", "add_request", "has_unfinished_requests", "schedule", "execute",
    "abort", "shutdown", "on_cpu", "kv_cache_usage", "sleep", "wake_up", "is_sleeping",
    "load_weights", "in_process_workers", "hf_config", "RequestOutputKind", "abort_with_outputs",
    "output_token_counts", "reset_prefix_cache", "vocab_size", "expert_weights", "record_routed_experts",
]


@dataclasses.dataclass
class ScheduledBatch:
    """What the scheduler picked for one engine step; `forward_step` receives it.

    num_tokens: {request id: tokens to run this step}: a prefill chunk (> 1) or one decode token each.
    scheduler_output: vLLM's `SchedulerOutput`, opaque to user code: hand the batch to `execute_step`.
    """

    num_tokens: dict
    scheduler_output: object

    @property
    def request_ids(self) -> list:
        return list(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())


def _engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def check_internals(llm: LLM) -> None:
    """Raise a RuntimeError naming each vLLM internal that the split step needs and that is missing."""
    problems = []
    engine = llm.llm_engine
    client = getattr(engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is None:
        problems.append(
            "LLM.llm_engine.engine_core.engine_core (in-process EngineCore) is missing: the engine runs in a "
            "separate process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm is imported"
        )
    else:
        for owner, attrs in (
            (core, ("scheduler", "model_executor", "step", "step_fn", "post_step", "_process_aborts_queue",
                    "batch_queue", "async_scheduling")),
            (getattr(core, "scheduler", None), ("schedule", "update_from_output", "get_grammar_bitmask",
                                                "has_requests", "kv_cache_manager")),
            (getattr(core, "model_executor", None), ("execute_model", "sample_tokens")),
            (engine, ("output_processor", "add_request", "has_unfinished_requests", "abort_request",
                      "reset_prefix_cache")),
            (getattr(engine, "output_processor", None), ("request_states", "external_req_ids")),
        ):
            for attr in attrs:
                if not hasattr(owner, attr):
                    problems.append(f"{type(owner).__name__}.{attr} is missing")
        if not problems:
            if core.batch_queue is not None or core.step_fn != core.step:
                problems.append("EngineCore uses a batch queue (pipeline parallel?): the split step supports "
                                "only EngineCore.step; use pipeline_parallel_size=1")
            if core.async_scheduling:
                problems.append("async scheduling is on: the split step needs synchronous scheduling")
    from vllm.v1.engine.output_processor import RequestState

    if not hasattr(RequestState, "make_request_output"):
        problems.append("vllm.v1.engine.output_processor.RequestState.make_request_output is missing")
    if problems:
        raise RuntimeError(
            f"chatgen's vLLM adapter (tested with vLLM {TESTED_VLLM}) does not fit vLLM {vllm.__version__}:\n  "
            + "\n  ".join(problems)
            + "\nUpdate chatgen/generation/vllm/adapter.py (schedule/execute mirror EngineCore.step)."
        )


def build_llm(model: str, **engine_kwargs) -> LLM:
    """Start an in-process vLLM engine (`vllm.LLM(model, **engine_kwargs)`) and check the internals we use.

    Sleep mode is enabled where the platform has it (CUDA), so `sleep()` really frees memory there; on CPU
    with external_launcher, TP groups get per-job shared memory (see `_per_job_cpu_shm`). vLLM's IPC sockets
    (multiprocess executor, TP > 1) go to a directory of this engine (VLLM_RPC_BASE_PATH, unless set), which
    `shutdown` removes: vLLM leaves them in /tmp.
    """
    from vllm.platforms import current_platform

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in ("0", "false", "False"):
        raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for the step-driven VLLMModule; "
                           "unset it or set it to 0 before importing chatgen.generation")
    engine_kwargs.setdefault("enable_sleep_mode", current_platform.is_sleep_mode_available())
    if current_platform.is_cpu():
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
    if current_platform.is_cpu() and engine_kwargs.get("distributed_executor_backend") == "external_launcher":
        _per_job_cpu_shm()
    if not quiet.verbose():
        engine_kwargs.setdefault("use_tqdm_on_load", False)  # a progress bar per checkpoint shard
        if current_platform.is_cpu():
            _quiet_numa_notice()
    if engine_kwargs.get("enforce_eager"):
        _eager_token_ranks()
    rpc_dir = None
    workers = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
    if workers > 1 and engine_kwargs.get("distributed_executor_backend") != "external_launcher":
        if current_platform.is_cpu():  # vLLM's CPU workers need their cores named, one set per rank
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                        for i in range(workers)))
        if "VLLM_RPC_BASE_PATH" not in os.environ:  # vLLM's multiprocess executor: worker processes, IPC
            rpc_dir = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="chatgen-vllm-")
            atexit.register(_remove_rpc_dir, rpc_dir)  # also when the engine is never shut down
    try:
        with _host_memory_only_gc(current_platform.is_cpu()), without_ray():
            llm = LLM(model, **engine_kwargs)
    except BaseException:
        _remove_rpc_dir(rpc_dir)
        raise
    llm.chatgen_rpc_dir = rpc_dir
    check_internals(llm)
    llm.collective_rpc(_install_reload_log_filter)
    llm.collective_rpc(_prepack_cpu_experts_on_reload)
    return llm


def _per_job_cpu_shm() -> None:
    """Per-job names for the CPU shared memory of a TP group, unlinked once every rank has opened them.

    vLLM 0.32 on CPU names that memory after the init method, the constant "env://" under external_launcher:
    two such jobs on one machine, or the leftovers of a killed one, collide with "create shm in SHMManager
    failed. errno: 17". So MASTER_PORT (one per job, the same on all its ranks) is appended to the name. And
    vLLM never unlinks the segments when ranks end with os._exit (multiprocessing, Ray): each rank unlinks
    its own right after vLLM's join barrier, when the name is no longer needed (the mapping stays).
    """
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    if getattr(_CPUSHMDistributed, "chatgen_per_job", False):
        return
    make_name, init_shm = _CPUSHMDistributed.make_group_name, _CPUSHMDistributed._init_cpu_shm

    def make_group_name(communicator):
        return f"{make_name(communicator)}-{os.environ['MASTER_PORT']}"

    def init_cpu_shm(self):
        handle = init_shm(self)  # ends with a barrier after every rank joined every segment
        segment = Path("/dev/shm") / f"{os.path.basename(self.group_name)}_{self.communicator.rank}"
        segment.unlink(missing_ok=True)
        return handle

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    _CPUSHMDistributed._init_cpu_shm = init_cpu_shm
    _CPUSHMDistributed.chatgen_per_job = True


def _eager_token_ranks() -> None:
    """vLLM 0.32 compiles the token-rank count of its log-prob gather (`sampler.batched_count_greater_than`) with
    torch.compile even under enforce_eager: 2.3 s of compilation on the first generation call on CPU, and no
    faster afterwards (measured on the tiny model: 0.28 s per eval call either way). An eager engine uses the
    plain function."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _quiet_numa_notice() -> None:
    """vLLM's CPU worker binds its memory to a NUMA node and says so with a C++ TORCH_WARN ("NUMA binding: Using
    MEMBIND policy ...") on every engine start; no Python filter reaches it (chatgen.core.quiet). This wraps that
    one op so its stderr goes to /dev/null; the binding itself, and any error it raises, are unchanged."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers torch.ops._C (idempotent)
    op = getattr(torch.ops._C, "init_cpu_memory_env", None)
    if op is None or getattr(op, "chatgen_quiet", False):  # gone in a later vLLM: its notice shows, nothing else
        return

    def init_cpu_memory_env(*args):
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            return op(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)

    init_cpu_memory_env.chatgen_quiet = True
    torch.ops._C.init_cpu_memory_env = init_cpu_memory_env  # vLLM looks the op up on the namespace at each call


def add_request(llm: LLM, request_id: str, prompt_ids: list, params: SamplingParams, prompt_text=None,
                cache_salt=None, output_kind=RequestOutputKind.FINAL_ONLY) -> None:
    """Queue one prompt (token ids, optional text kept for the output) with its sampling parameters.

    output_kind: FINAL_ONLY (one output when the request finishes, as LLM.generate) or DELTA (every step's new
    tokens, for streaming). cache_salt: requests share prefix-cache blocks only with requests of the same salt.
    Log-prob entries carry no token text (`decoded_token` None) even when the request detokenizes its output:
    vLLM would decode every entry on the engine thread (measured: 15% of a serving engine step of the tiny
    model), and chatgen reads only their values.
    """
    params.output_kind = output_kind
    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if prompt_text is not None:
        prompt["prompt"] = prompt_text
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    processor = engine.output_processor
    for internal_id in processor.external_req_ids.get(request_id, ()):  # a request with n samples has n
        state = processor.request_states.get(internal_id)
        if state is not None and state.logprobs_processor is not None:
            state.logprobs_processor.tokenizer = None


def has_unfinished_requests(llm: LLM) -> bool:
    return llm.llm_engine.has_unfinished_requests()


def abort(llm: LLM, request_ids: list) -> None:
    """Drop requests (e.g. after an exception mid-loop) so the next call starts from an empty engine."""
    routing = getattr(llm, "chatgen_routing", None)
    if routing is not None:
        processor = llm.llm_engine.output_processor
        routing.forget([rid for r in request_ids for rid in processor.external_req_ids.get(r, ())])
    llm.llm_engine.abort_request(list(request_ids))


def abort_with_outputs(llm: LLM, request_ids: list) -> list:
    """Abort requests and return, for each, a finished RequestOutput holding what it generated so far
    (finish_reason "abort"; a request with n samples gives one output with all n)."""
    from vllm.v1.engine import FinishReason

    wanted, outputs = set(request_ids), []
    for state in list(llm.llm_engine.output_processor.request_states.values()):
        if state.external_req_id in wanted:
            output = state.make_request_output([], None, FinishReason.ABORT, None)
            if output is not None:
                outputs.append(output)
    abort(llm, request_ids)
    return outputs


def output_token_counts(llm: LLM) -> dict:
    """{(request id, sample index): tokens generated so far} for every unfinished request."""
    return {(state.external_req_id, state.request_index): state.detokenizer.num_output_tokens()
            for state in llm.llm_engine.output_processor.request_states.values() if state.detokenizer is not None}


def reset_prefix_cache(llm: LLM, preempt_running: bool = False) -> bool:
    """Drop every cached KV block that no request holds; with preempt_running, first preempt the running
    requests (they re-prefill prompt + generated tokens when next scheduled), so the reset always succeeds.
    Returns whether the cache was reset (False: running requests hold blocks)."""
    return llm.reset_prefix_cache(reset_running_requests=preempt_running) is not False


def shutdown(llm: LLM) -> None:
    """Stop the engine's workers and free its memory now rather than at garbage collection."""
    from vllm.platforms import current_platform

    with _host_memory_only_gc(current_platform.is_cpu()):
        llm.llm_engine.engine_core.shutdown()
    _remove_rpc_dir(getattr(llm, "chatgen_rpc_dir", None))


@contextlib.contextmanager
def _host_memory_only_gc(active: bool):
    """Within: gc.collect() of the oldest generation (what vLLM calls while it loads, warms up and shuts down,
    to hand freed device memory back before measuring it) does nothing. On CPU there is no device memory to hand
    back, and each such collection walks the ~70k objects vLLM's imports leave: 0.25-0.5 s apiece, five per
    engine life (1-2 s of a tiny run's startup). What they would free, Python's own collections free later.
    While collection is paused (`chatgen.module.startup_gc`, around every module's start) the young generations
    hold every object made since the pause, so collecting them is that same walk: nothing is collected then."""
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


def schedule(llm: LLM) -> ScheduledBatch:
    """Ask vLLM's scheduler which requests run next and how many tokens each (first half of EngineCore.step)."""
    out = _engine_core(llm).scheduler.schedule()
    return ScheduledBatch(out.num_scheduled_tokens, out)


def execute(llm: LLM, batch: ScheduledBatch) -> list:
    """Run the model on a scheduled batch, sample, and update request states (second half of EngineCore.step).

    Returns the `RequestOutput`s this step finished (requests are added with FINAL_ONLY output).
    """
    engine = llm.llm_engine
    core = _engine_core(llm)
    so = batch.scheduler_output
    future = core.model_executor.execute_model(so, non_block=True)
    grammar_output = core.scheduler.get_grammar_bitmask(so)
    model_output = future.result()
    if model_output is None:
        model_output = core.model_executor.sample_tokens(grammar_output)
    core._process_aborts_queue()
    core_outputs = core.scheduler.update_from_output(so, model_output)
    core.post_step(model_executed=so.total_num_scheduled_tokens > 0)
    routing = getattr(llm, "chatgen_routing", None)
    if routing is not None:
        routing.end_step(so, engine.output_processor)
    core_outputs = core_outputs.get(0)
    if core_outputs is None:
        return []
    processed = engine.output_processor.process_outputs(
        core_outputs.outputs, engine_core_timestamp=core_outputs.timestamp, iteration_stats=None
    )
    if routing is not None:
        routing.hand_out(processed.request_outputs)
    engine.output_processor.update_scheduler_stats(core_outputs.scheduler_stats)
    # Requests that hit a stop string finish in the output processor; the core must drop them too.
    if processed.reqs_to_abort:
        core.abort_requests(processed.reqs_to_abort)
    return processed.request_outputs


def kv_cache_usage(llm: LLM) -> float:
    """Fraction of KV-cache blocks in use right now (0..1)."""
    return _engine_core(llm).scheduler.kv_cache_manager.usage


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sleep(llm: LLM, level: int = 1) -> None:
    """Pause the engine and (on GPU) discard the KV cache and offload weights (level 1) or drop them (level 2).

    On CPU this pauses scheduling and clears the prefix cache; memory stays allocated.
    """
    llm.sleep(level=level)


def wake_up(llm: LLM, tags: list | None = None) -> None:
    """Reallocate what `sleep` released: everything, or only `tags` ("weights", "kv_cache"; all of them must be
    woken before the engine generates again)."""
    llm.wake_up(tags)


def is_sleeping(llm: LLM) -> bool:
    return llm.llm_engine.is_sleeping()


def in_process_workers(llm: LLM) -> bool:
    """True when the engine's workers run in this process (uniproc, external_launcher): tensors handed to
    `load_weights` are then used directly, never pickled."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return isinstance(_engine_core(llm).model_executor, UniProcExecutor)  # also covers external_launcher


def load_weights(llm: LLM, named_tensors: Iterable, reset_prefix_cache: bool = True) -> None:
    """Write HF-format `(name, tensor)` pairs into the running engine, in place, on every rank.

    Names and layouts are those of the HF checkpoint (`model.layers.0.self_attn.q_proj.weight`, unfused q/k/v
    and gate/up, full unsharded tensors): vLLM's own loader fuses, shards and (on CPU) repacks them. With an
    in-process executor (uniproc, external_launcher) the iterable is consumed lazily, so a generator streams
    without holding a second copy; with the multiprocess executor it is materialised and pickled to each worker.
    A subset of the weights is fine. Afterwards a tied LM head is re-packed (CPU) and (reset_prefix_cache) the
    prefix cache is reset, so no KV computed with the old weights is reused; the engine loop passes False and
    keeps the cache apart itself (chatgen.generation.vllm.engine_loop).
    """
    weights = named_tensors if in_process_workers(llm) else list(named_tensors)
    try:
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
    except BaseException:
        llm.collective_rpc(_abandon_reload)  # so that the next reload (the re-sync) can work
        raise
    llm.collective_rpc(_refresh_tied_lm_head)
    if reset_prefix_cache and llm.reset_prefix_cache() is False:  # vLLM refuses while requests hold cache blocks
        raise RuntimeError("weights were loaded but vLLM kept its prefix cache (requests still hold KV blocks), so "
                           "cached prompts would reuse KV computed with the old weights; sync only between "
                           "generation calls, when no request is running")


class _ComputedBufferReloadFilter(logging.Filter):
    """Drops vLLM 0.32's "RotaryEmbedding: Failed to load weights" warning, logged on every reload: the layer's
    only tensor is its cos/sin cache, computed at start, which no checkpoint carries. Other layers' warnings
    pass (and chatgen.param_sync's manifest check already refuses a sync that misses a parameter)."""

    LAYERS = ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith(self.LAYERS))


def _install_reload_log_filter(worker=None) -> None:
    """Install the filter in this process (called in each worker through collective_rpc); idempotent."""
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ComputedBufferReloadFilter) for f in reload_logger.filters):
        reload_logger.addFilter(_ComputedBufferReloadFilter())


def _cpu_experts(layer):
    """The CPU grouped-GEMM experts of a vLLM MoE layer that prepack its w13 / w2 (None elsewhere: GPU, zentorch)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    return experts if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch else None


def _prepack_cpu_experts_on_reload(worker=None) -> None:
    """vLLM 0.32 on CPU: a weight reload re-runs `UnquantizedFusedMoEMethod._setup_kernel` with the new expert
    weights but skips, on an update, the experts' own `process_weights_after_loading`, which is where the CPU
    backend prepacks w13 / w2 into its GEMM layout; the kernel then reads the new, unpacked weights as packed (a
    tiny Qwen3-MoE synced into an engine scored 2e-2 off in log-prob). Run it on updates too. Installed in every
    worker process by `build_llm` (idempotent)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if getattr(UnquantizedFusedMoEMethod, "chatgen_prepacks_on_reload", False):
        return
    setup_kernel = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        setup_kernel(self, layer, w13, w2)
        if update and _cpu_experts(layer) is not None:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    UnquantizedFusedMoEMethod.chatgen_prepacks_on_reload = True


def _abandon_reload(worker) -> None:
    """vLLM 0.32's layer-wise reload keeps state per layer from its start to its end (the weights received so
    far, the layer's tensors swapped for meta ones, wrapped weight loaders). A reload whose weights stop coming
    half-way (a trainer lost mid-sync, a refused bucket) never reaches its end, and every later reload then failed
    ("'Parameter' object has no attribute 'weight_loader'"): the engine could not be repaired. Drop what was
    buffered and end the reload, which puts each unfinished layer's own tensors back (old values: the engine
    loop refuses to generate until a complete sync)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, get_layerwise_info

    model = worker.model_runner.get_model()
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights, info.load_numel = [], 0
    finalize_layerwise_reload(model, worker.model_runner.vllm_config.model_config)


def _refresh_tied_lm_head(worker) -> None:
    """vLLM 0.32 on CPU packs the LM head's weight for its GEMM; with tied embeddings a reload writes
    embed_tokens but never re-packs lm_head, which would keep computing logits with the old weights.
    Re-run its post-load processing (idempotent; a no-op on GPU)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class _RoutingRecorder:
    """The experts each token of each request was routed to, as vLLM's MoE routers chose them.

    Every MoE layer's router calls `capture(layer, topk_ids)` during the forward (vLLM's `BaseRouter` capture
    hook; ids (tokens, k) in the model runner's token order); `end_step` files the step's rows per request
    and position (a request's tokens are its run of `num_scheduled_tokens` in the runner's batch order, at
    positions from its `num_computed_tokens`); `hand_out` puts each finished sample's array on its
    `CompletionOutput.routed_experts` (vLLM's own field): (positions, num_layers, k) int16, position t = the
    token the model read at t, -1 where none was routed here (a prompt prefix served from the prefix cache).
    A recomputed position (preemption) keeps its last routing."""

    def __init__(self, runner, num_layers: int, topk: int):
        self.runner, self.num_layers, self.topk = runner, num_layers, topk
        self.step = {}  # layer -> (tokens, k) ids of the running step
        self.routed = {}  # engine request id -> np.ndarray (positions, layers, k)
        self.sample = {}  # engine request id -> (request id, sample index)

    def capture(self, layer: int, topk_ids) -> None:
        self.step[layer] = topk_ids.detach().to("cpu", copy=True)

    def end_step(self, scheduler_output, output_processor) -> None:
        import numpy as np

        if not self.step:
            return
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        ids = np.stack([self.step[layer].numpy() for layer in range(self.num_layers)], axis=1)  # (tokens, L, k)
        row = 0
        for rid in self.runner.input_batch.req_ids[:self.runner.input_batch.num_reqs]:
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            start, end = starts[rid], starts[rid] + n
            have = self.routed.get(rid)
            if have is None or len(have) < end:
                grown = np.full((max(end, 2 * len(have) if have is not None else 0), self.num_layers, self.topk), -1,
                                dtype=np.int16)
                if have is not None:
                    grown[:len(have)] = have
                self.routed[rid] = have = grown
            have[start:end] = ids[row:row + n]
            row += n
            if rid not in self.sample:
                state = output_processor.request_states.get(rid)
                if state is not None:
                    self.sample[rid] = (state.external_req_id, state.request_index)
        self.step = {}

    def hand_out(self, request_outputs) -> None:
        finished = {key: rid for rid, key in self.sample.items()}
        for output in request_outputs:
            if not output.finished:
                continue
            for completion in output.outputs:
                rid = finished.get((output.request_id, completion.index))
                if rid is None:
                    continue
                routed = self.routed.pop(rid, None)
                del self.sample[rid]
                # every position the model read: the prompt and all but the last generated token
                length = len(output.prompt_token_ids or ()) + len(completion.token_ids) - 1
                if routed is not None:
                    completion.routed_experts = routed[:length]

    def forget(self, engine_request_ids) -> None:
        for rid in engine_request_ids:
            self.routed.pop(rid, None)
            self.sample.pop(rid, None)


def record_routed_experts(llm: LLM) -> None:
    """From now on `execute` records the experts vLLM routes every token to (see `_RoutingRecorder`); finished
    samples carry them as `CompletionOutput.routed_experts`. Needs the workers in this process (one engine rank,
    or external_launcher) and an MoE model; turn prefix caching off so that every prompt token is routed per
    request."""
    if not in_process_workers(llm):
        raise ValueError("recording routed experts needs the engine's workers in this process: tensor_parallel_size 1 "
                         "(or the external_launcher executor); turn return_routed_experts off for this engine")
    config = llm.llm_engine.model_config
    if config.get_num_experts() <= 0:
        raise ValueError(f"return_routed_experts: {config.model} is not a mixture-of-experts model; set it to false")
    llm.chatgen_routing = None

    def install(worker):
        from functools import partial

        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        recorder = _RoutingRecorder(worker.model_runner, config.get_total_num_hidden_layers(),
                                    config.get_num_experts_per_tok())
        layers = [m for m in worker.model_runner.get_model().modules()
                  if isinstance(getattr(m, "router", None), BaseRouter) and hasattr(m, "layer_id")]
        if sorted(m.layer_id for m in layers) != list(range(recorder.num_layers)):
            raise RuntimeError(f"chatgen's vLLM adapter found MoE routers for layers {[m.layer_id for m in layers]}; "
                               f"it records routing for an MoE MLP in each of the {recorder.num_layers} layers")
        for m in layers:
            m.router.set_capture_fn(partial(recorder.capture, m.layer_id))
        return recorder

    llm.chatgen_routing = llm.collective_rpc(install)[0]


def expert_weights(llm: LLM) -> list:
    """Each MoE layer's expert weights as the engine holds them, in layer order: [(w13, w2)] with w13 (E, 2I, H) =
    [gate; up] per expert and w2 (E, H, I) = down (vLLM's fused expert layout, `FusedMoE.w13_weight` / `w2_weight`),
    put back together over the engine's TP ranks (each holds an I/TP slice of every expert). Empty for a dense
    model. Used by `chatgen check-sync` to check every expert weight after a sync."""
    import torch

    per_rank = llm.collective_rpc(_expert_weights)
    if len(per_rank) == 1:
        return per_rank[0]
    out = []
    for layer in zip(*per_rank):  # [(w13, w2) of each TP rank]
        gates, ups = zip(*(w13.chunk(2, dim=1) for w13, _ in layer))
        out.append((torch.cat([*gates, *ups], dim=1), torch.cat([w2 for _, w2 in layer], dim=2)))
    return out


def _expert_weights(worker) -> list:
    import torch

    out = []
    for m in worker.model_runner.get_model().modules():
        if isinstance(getattr(m, "w13_weight", None), torch.Tensor) and hasattr(m, "w2_weight"):
            w13, w2 = m.w13_weight.detach().cpu(), m.w2_weight.detach().cpu()
            experts = _cpu_experts(m)
            if experts is not None:  # undo the CPU prepack (see _unpacked); a padded intermediate size is cut back
                size = m.moe_config.intermediate_size_per_partition
                w13, w2 = _unpacked(w13, experts.isa), _unpacked(w2, experts.isa)
                padded = w13.shape[1] // 2
                w13, w2 = torch.cat([w13[:, :size], w13[:, padded:padded + size]], dim=1), w2[:, :, :size]
            out.append((w13.clone(), w2.clone()))
    return out


def _unpacked(packed, isa: str):
    """Expert weights (E, N, K) as they were before the CPU backend's prepack. The prepack moves elements without
    changing them, the same way in every expert: prepacking one expert's element indices (in base-256 digits, which
    every float dtype holds exactly) says where each element went."""
    import torch
    from vllm import _custom_ops as ops

    n = packed[0].numel()
    index, source = torch.arange(n), torch.zeros(n, dtype=torch.long)
    for digit in range(max(1, (n.bit_length() + 7) // 8)):
        digits = ((index >> (8 * digit)) & 255).to(packed.dtype).view(1, *packed.shape[1:])
        source += ops.cpu_prepack_moe_weight(digits, isa).reshape(-1).long() << (8 * digit)
    out = torch.empty_like(packed).reshape(len(packed), -1)
    out[:, source] = packed.reshape(len(packed), -1)
    return out.view_as(packed)


def vocab_size(llm: LLM) -> int:
    """Token ids the engine accepts: 0 .. vocab_size - 1."""
    return llm.llm_engine.model_config.get_vocab_size()


def hf_config(llm: LLM) -> dict:
    """The HF config (config.json as a dict) the engine was started with."""
    return llm.llm_engine.model_config.hf_config.to_dict()
