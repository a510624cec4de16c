"""Every vLLM-0.32-specific patch of chatgen, in one place: each works around a behaviour of that
version (named in its docstring) by replacing or wrapping a vLLM internal. `RELIES_ON` lists what
each patch (and the adapter's other code that mirrors vLLM internals) needs of vLLM, and `check()`
what of it an installed vLLM lacks: tests/integration/test_vllm_patches.py fails loudly on an
upgrade that moves any of it, before a patch silently stops applying."""

import importlib
import inspect
import logging
import os
import sys
from pathlib import Path

from chatgen.generation.vllm.adapter import fast_step, small_linears

TESTED_VLLM = "0.32"


def per_job_cpu_shm() -> None:
    """Per-job names for the CPU shared memory of a TP group, unlinked once every rank has opened
    them.

    vLLM 0.32 on CPU names that memory after the init method, the constant "env://" under
    external_launcher: two such jobs on one machine, or the leftovers of a killed one, collide with
    "create shm in SHMManager failed. errno: 17". So MASTER_PORT (one per job, the same on all its
    ranks) is appended to the name. And vLLM never unlinks the segments when ranks end with os._exit
    (multiprocessing, Ray): each rank unlinks its own right after vLLM's join barrier, when the name
    is no longer needed (the mapping stays).
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


def eager_token_ranks() -> None:
    """vLLM 0.32 compiles the token-rank count of its log-prob gather
    (`sampler.batched_count_greater_than`) with torch.compile even under enforce_eager: 2.3 s of
    compilation on the first generation call on CPU, and no faster afterwards (measured on the
    tiny model: 0.28 s per eval call either way). An eager engine uses the plain function."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def quiet_numa_notice() -> None:
    """vLLM's CPU worker binds its memory to a NUMA node and says so with a C++ TORCH_WARN ("NUMA
    binding: Using MEMBIND policy ...") on every engine start; no Python filter reaches it
    (chatgen.core.quiet). This wraps that one op so its stderr goes to /dev/null; the binding
    itself, and any error it raises, are unchanged."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers torch.ops._C (idempotent)
    op = getattr(torch.ops._C, "init_cpu_memory_env", None)  # gone later: the notice shows
    if op is None or getattr(op, "chatgen_quiet", False):
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
    # vLLM looks the op up on the namespace at each call
    torch.ops._C.init_cpu_memory_env = init_cpu_memory_env


def rebind_kernels_past_odd_namespaces() -> None:
    """vLLM 0.32 points every module global holding a Triton kernel at its CPU fallback when a
    worker starts (`dispatcher._rebind_kernels`), reading `vars(value).get("kernel")` of each
    global; llvmlite's `ffi.lib` (numba's, loaded by bm25s) answers vars() with a wrapper, not a
    mapping, and no engine could start. The same scan past such namespaces, reading a warmup class's
    own `kernel` in vLLM's modules only, where they live (~6k modules' globals: 0.2-0.4 s)."""
    import warnings
    from types import MappingProxyType

    from vllm.triton_utils import dispatcher

    if getattr(dispatcher._rebind_kernels, "chatgen_past_odd", False):
        return

    def rebind_kernels(overrides):
        wrappers = {id(original): wrapper for original, wrapper in overrides}  # by identity
        spaces = (dict, MappingProxyType)  # what vars() gives of an instance, of a class
        with warnings.catch_warnings():  # reading every global touches deprecated ones (torch's)
            warnings.simplefilter("ignore")
            for name, module in list(sys.modules.items()):
                for attr, value in list((getattr(module, "__dict__", None) or {}).items()):
                    if id(value) in wrappers:
                        setattr(module, attr, wrappers[id(value)])
                        continue
                    inner = getattr(value, "__dict__", None) if name.startswith("vllm") else None
                    if isinstance(inner, spaces) and id(inner.get("kernel")) in wrappers:
                        value.kernel = wrappers[id(inner["kernel"])]
                        if not isinstance(value, type):
                            value.__dict__.pop("_kernel_arg_names", None)

    rebind_kernels.chatgen_past_odd = True
    rebind_kernels.__wrapped__ = dispatcher._rebind_kernels  # what `check` reads (inspect follows)
    dispatcher._rebind_kernels = rebind_kernels  # register_kernels looks it up at each call


def decode_slots_fast_path(kv_cache_manager) -> None:
    """vLLM 0.32's `KVCacheManager.allocate_slots` runs its whole admission path (remove skipped
    blocks, count blocks to allocate, allocate, cache full blocks) for every running request at
    every decode step, ~40 us of Python each: ~10% of the tiny model's 256-prompt evaluation. For
    a running request of one full-attention group whose allocated blocks already hold the step's
    tokens and which fills no new block, every stage is a no-op and vLLM returns its empty blocks:
    so does this, first. Anything else (a new request, a prefix hit, a block to allocate or cache,
    lookahead, sliding windows, several groups) takes vLLM's path."""
    from vllm.v1.core.kv_cache_coordinator import (
        KVCacheCoordinatorNoPrefixCache,
        UnitaryKVCacheCoordinator,
    )
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.request import RequestStatus

    manager = kv_cache_manager
    coordinator = manager.coordinator
    if getattr(manager, "chatgen_fast_slots", False) or type(coordinator) not in (
        UnitaryKVCacheCoordinator,
        KVCacheCoordinatorNoPrefixCache,
    ):
        return
    (group,) = coordinator.single_type_managers
    if type(group) is not FullAttentionManager or group.block_size != (
        group.block_pool.hash_block_size
    ):
        return
    block_size, max_len, running = group.block_size, manager.max_model_len, RequestStatus.RUNNING
    blocks, cached, partial = group.req_to_blocks, group.num_cached_block, group._partial_hit_reqs
    empty, allocate = manager.empty_kv_cache_blocks, manager.allocate_slots

    def allocate_slots(request, num_new_tokens, *args, **kwargs):
        # the scheduler's running requests: (request, n, num_lookahead_tokens=0) and nothing else
        if (
            not args
            and kwargs.keys() <= {"num_lookahead_tokens"}
            and not kwargs.get("num_lookahead_tokens")
            and num_new_tokens > 0
            and request.status == running
        ):
            request_id = request.request_id
            tokens = request.num_computed_tokens + num_new_tokens
            if (
                tokens <= max_len
                and tokens <= len(blocks.get(request_id, ())) * block_size
                # vLLM's cache_blocks reads a missing count as 0 too
                and min(tokens, request.num_tokens) // block_size <= cached.get(request_id, 0)
                and request_id not in partial
            ):
                return empty
        return allocate(request, num_new_tokens, *args, **kwargs)

    manager.allocate_slots = allocate_slots
    manager.chatgen_fast_slots = True


class _ComputedBufferReloadFilter(logging.Filter):
    """Drops vLLM 0.32's "RotaryEmbedding: Failed to load weights" warning, logged on every
    reload: the layer's only tensor is its cos/sin cache, computed at start, which no checkpoint
    carries. Other layers' warnings pass (and chatgen.param_sync's manifest check already refuses
    a sync that misses a parameter)."""

    LAYERS = ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and str(record.args[0]).endswith(self.LAYERS)
        )


def install_reload_log_filter(worker=None) -> None:
    """Install the filter in this process (called in each worker through collective_rpc);
    idempotent."""
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ComputedBufferReloadFilter) for f in reload_logger.filters):
        reload_logger.addFilter(_ComputedBufferReloadFilter())


def cpu_experts(layer):
    """The CPU grouped-GEMM experts of a vLLM MoE layer that prepack its w13 / w2 (None
    elsewhere: GPU, zentorch)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts = getattr(
        getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None
    )
    return (
        experts
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch
        else None
    )


def prepack_cpu_experts_on_reload(worker=None) -> None:
    """vLLM 0.32 on CPU: a weight reload re-runs `UnquantizedFusedMoEMethod._setup_kernel` with
    the new expert weights but skips, on an update, the experts' own
    `process_weights_after_loading`, which is where the CPU backend prepacks w13 / w2 into its
    GEMM layout; the kernel then reads the new, unpacked weights as packed (a tiny Qwen3-MoE
    synced into an engine scored 2e-2 off in log-prob). Run it on updates too. Installed in every
    worker process by `build_llm` (idempotent)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if getattr(UnquantizedFusedMoEMethod, "chatgen_prepacks_on_reload", False):
        return
    setup_kernel = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        setup_kernel(self, layer, w13, w2)
        if update and cpu_experts(layer) is not None:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    UnquantizedFusedMoEMethod.chatgen_prepacks_on_reload = True


def abandon_reload(worker) -> None:
    """vLLM 0.32's layer-wise reload keeps state per layer from its start to its end (the weights
    received so far, the layer's tensors swapped for meta ones, wrapped weight loaders). A reload
    whose weights stop coming half-way (a trainer lost mid-sync, a refused bucket) never reaches
    its end, and every later reload then failed ("'Parameter' object has no attribute
    'weight_loader'"): the engine could not be repaired. Drop what was buffered and end the
    reload, which puts each unfinished layer's own tensors back (old values: the engine loop
    refuses to generate until a complete sync)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
    )

    model = worker.model_runner.get_model()
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights, info.load_numel = [], 0
    finalize_layerwise_reload(model, worker.model_runner.vllm_config.model_config)


def refresh_tied_lm_head(worker) -> None:
    """vLLM 0.32 on CPU packs the LM head's weight for its GEMM; with tied embeddings a reload
    writes embed_tokens but never re-packs lm_head, which would keep computing logits with the
    old weights. Re-run its post-load processing (idempotent; a no-op on GPU)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(
        head, "quant_method"
    ):
        head.quant_method.process_weights_after_loading(head)


def replace_lora_in_worker(worker, lora_id: int, config: dict, tensors: dict) -> None:
    """vLLM 0.32 loads a LoRA adapter only from a directory. In a vLLM worker (collective_rpc):
    replace the adapter of id `lora_id` by one built from `tensors` (PEFT names) and `config`
    (its adapter_config.json): what `WorkerLoRAManager._load_adapter` does from a directory, then
    the in-place swap of `LRUCacheWorkerLoRAManager.add_adapter` (load_inplace). Building comes
    first, so an adapter vLLM refuses leaves the previous one in place (adapter/lora.py)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
    )
    adapters.remove_adapter(lora_id)
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora_id)


_CPU_SHM = "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed"
_MOE_METHOD = (
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
)
_CPU_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts"
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_INPUTS = "vllm.v1.engine.input_processor:InputProcessor"

# patch -> what it needs of vLLM: "module:attribute.path" must exist; (target, "text") its source
# must contain the text; (target, (names,)) its parameters must be these (fast_step.py's too).
RELIES_ON = {
    "rebind_kernels_past_odd_namespaces": [
        ("vllm.triton_utils.dispatcher:_rebind_kernels", ("overrides",)),
        (
            "vllm.triton_utils.dispatcher:_rebind_kernels",
            'wrapper = lookup(vars(value).get("kernel"))',
        ),
        ("vllm.triton_utils.dispatcher:register_kernels", "_rebind_kernels(["),
    ],
    "per_job_cpu_shm": [
        f"{_CPU_SHM}.make_group_name",
        (f"{_CPU_SHM}._init_cpu_shm", ("self",)),
        (_CPU_SHM, "self.group_name"),
        (_CPU_SHM, "self.communicator"),
    ],
    "decode_slots_fast_path": [
        (
            "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
            ("self", "request", "num_new_tokens", "num_new_computed_tokens"),
        ),
        (
            "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
            "self.empty_kv_cache_blocks",
        ),
        (
            "vllm.v1.core.sched.scheduler:Scheduler.schedule",
            "num_lookahead_tokens=self.num_lookahead_tokens,",
        ),
        (
            "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
            "self.num_cached_block",
        ),
        (
            "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
            "self._partial_hit_reqs",
        ),
        "vllm.v1.core.kv_cache_coordinator:UnitaryKVCacheCoordinator",
        "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache",
    ],
    "eager_token_ranks": ["vllm.v1.sample.sampler:batched_count_greater_than"],
    "install_reload_log_filter": [
        (_LAYERWISE, '"%s: Failed to load weights", layer.__class__.__name__')
    ],
    "cpu_experts": [
        _CPU_EXPERTS,
        (_CPU_EXPERTS, "self._use_zentorch"),
        (_MOE_METHOD, "self.moe_kernel"),
    ],
    "prepack_cpu_experts_on_reload": [
        (f"{_MOE_METHOD}._setup_kernel", ("self", "layer", "w13", "w2")),
        (f"{_CPU_EXPERTS}.process_weights_after_loading", ("self", "layer")),
    ],
    "replace_lora_in_worker": [
        (
            "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
            ("lora_model_id", "tensors", "peft_helper"),
        ),
        "vllm.lora.peft_helper:PEFTHelper.from_dict",
        "vllm.lora.peft_helper:PEFTHelper.validate_legal",
        ("vllm.lora.worker_manager:WorkerLoRAManager", "self.max_position_embeddings"),
        (
            "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.add_adapter",
            "self._adapter_manager.remove_adapter(lora.id)",
        ),
        ("vllm.v1.worker.lora_model_runner_mixin", "self.lora_manager = "),
        "vllm.lora.model_manager:LoRAModelManager.remove_adapter",
        "vllm.lora.model_manager:LRUCacheLoRAModelManager.add_adapter",
        "vllm.lora.model_manager:LRUCacheLoRAModelManager.activate_adapter",
    ],
    # sampled_logprobs.py wraps the sampler's forward, reads discarded rows, labels rows by request
    "record_sampled_logprobs": [
        ("vllm.v1.sample.sampler:Sampler.forward", ("self", "logits", "sampling_metadata")),
        ("vllm.v1.sample.sampler:Sampler.forward", "raw_logprobs = self.compute_logprobs(logits)"),
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", "self.sampler("),
        (
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
            "self.discard_request_mask.np[:num_reqs] = (",
        ),
        ("vllm.v1.worker.gpu_input_batch:InputBatch", "def req_ids("),
        ("vllm.v1.engine.output_processor:RequestState", "self.request_index = "),
        "vllm.logprobs:Logprob",
    ],
    "add_request": [(f"{_INPUTS}.assign_request_id", "-{random_uuid():.8}")],
    "abandon_reload": [
        f"{_LAYERWISE}:finalize_layerwise_reload",
        f"{_LAYERWISE}:get_layerwise_info",
        *[
            ("vllm.model_executor.model_loader.reload.types", name)
            for name in ("def can_load", "loaded_weights", "load_numel")
        ],
    ],
    **fast_step.RELIES_ON,
    **small_linears.RELIES_ON,
}


def check() -> list:
    """What an installed vLLM lacks of `RELIES_ON`, one line per miss naming the patch; [] when
    every patch still fits."""
    problems = []
    for patch, needs in RELIES_ON.items():
        for need in needs:
            target, want = need if isinstance(need, tuple) else (need, None)
            try:
                found = _resolve(target)
            except (ImportError, AttributeError) as e:
                problems.append(f"{patch}: {target} is missing ({e})")
                continue
            if isinstance(want, str) and want not in inspect.getsource(found):
                problems.append(f"{patch}: the source of {target} no longer contains {want!r}")
            elif isinstance(want, tuple):
                params = tuple(inspect.signature(found).parameters)
                if params[: len(want)] != want:
                    problems.append(f"{patch}: {target} takes {params}, the patch expects {want}")
    return problems


def _resolve(target: str):
    module, _, path = target.partition(":")
    found = importlib.import_module(module)
    for attr in filter(None, path.split(".")):
        found = getattr(found, attr)
    return found
