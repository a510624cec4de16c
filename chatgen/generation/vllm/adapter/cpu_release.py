"""A colocated CPU engine's memory let go while its trainer trains (the `release_during_training`
key, docs/generation_keys.md): what vLLM's sleep level 2 does on a GPU, which its CPU worker does
not do (its `sleep` is a no-op).

    release(llm)            # the weights and the KV cache freed; the engine refuses to generate
    regrow(llm, "weights")  # right before a weight sync that writes every weight
    regrow(llm, "kv_cache") # before the next generation

vLLM 0.32's reload (adapter/weights.py) puts each layer's tensors on the meta device, loads the
checkpoint's tensors into fresh ones, re-runs the layer's post-load processing (on CPU the oneDNN
matmul handler that holds a packed copy of a linear layer's weight, `layer.cpu_linear`; the
weight itself is then a 0-element placeholder) and copies the result into the layer's old
tensors, which it keeps. So `release` drops every `cpu_linear` handler (the reload builds new
ones) and shrinks the storage of every other weight tensor (embeddings, norms, a small layer's
weight where `small_linears.bucketed_small_linears` leaves it to torch) to 0 bytes; `regrow`
gives the storage back, filled with NaN, so that a tensor the sync did not write shows as NaN in
`check_rewritten`, which the caller runs after the reload. The KV cache keeps its allocation and hands its pages to the
kernel instead (`_drop_pages`); the prefix cache is reset by every sync, so nothing reads the old
contents, and it comes back zeroed.

The freed blocks are large (a layer's weight, the KV cache): glibc hands them to the kernel on free
where they were mmapped, and `release` trims the heap for the rest, so the process's RSS drops.
"""

import ctypes
import math
import mmap

from vllm import LLM

from chatgen.core.process_tuning import glibc_malloc_trim
from chatgen.generation.vllm.adapter.engine import in_process_workers


def release(llm: LLM) -> None:
    """Free the engine's weights and KV cache on every rank (again: a no-op). Only in-process
    workers: the storages and handlers are this process's objects."""
    if not in_process_workers(llm):
        raise NotImplementedError(
            "release_during_training needs the engine in this process (CPU, uniproc executor)"
        )
    llm.collective_rpc(_release)


def regrow(llm: LLM, what: str) -> None:
    """Give back the storage `release` took of `what` ("weights" or "kv_cache"): the weights'
    filled with NaN until a sync writes them, the KV cache's zeroed."""
    llm.collective_rpc(_regrow, kwargs=dict(what=what))


def check_rewritten(llm: LLM) -> str | None:
    """After a weight sync into an engine whose weights were regrown: None when it wrote every
    weight `release` freed (every handler rebuilt, no NaN left), else which one it missed. None
    at once when no regrow came before."""
    return next((missed for missed in llm.collective_rpc(_missed) if missed), None)


def _released_linear(x, weight, bias):
    raise RuntimeError(
        "the engine's weights were released for training (release_during_training) and no full "
        "weight sync has rebuilt this layer yet"
    )


def _state(worker) -> dict:
    if not hasattr(worker, "chatgen_released"):
        worker.chatgen_released = {"weights": [], "kv_cache": []}
    return worker.chatgen_released


def _release(worker) -> None:
    import torch

    state, model = _state(worker), worker.model_runner.get_model()
    if not state["weights"]:
        for module in model.modules():
            if getattr(module, "cpu_linear", None) not in (None, torch.nn.functional.linear):
                module.cpu_linear = _released_linear  # the handler and its packed weight go
        state["weights"] = _shrink(model.parameters())
    if not state["kv_cache"]:
        state["kv_cache"] = _drop_pages(worker.model_runner.kv_caches)
    _trim_heap()


def _shrink(tensors) -> list:
    """[(storage, bytes)] of the distinct storages of `tensors` holding more than one element,
    each shrunk to 0 bytes (scalars such as a quantization scale are left: reloads may not write
    them)."""
    out, seen = [], set()
    for t in tensors:
        storage = t.untyped_storage()
        if t.numel() <= 1 or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append((storage, storage.nbytes()))
    for storage, _ in out:
        storage.resize_(0)
    return out


MADV_DONTNEED = 4  # Linux madvise(2): a private anonymous page reads as zeros after it


def _drop_pages(tensors) -> list:
    """The KV cache's release: the whole pages of each of `tensors`' storages handed back to the
    kernel (madvise MADV_DONTNEED), the allocation kept; the partial pages at its ends zeroed. A
    private anonymous page (what malloc gives) then reads as zeros and is faulted in when first
    written, so the wake has nothing to regrow or zero, and a generation faults in only the blocks
    it writes. Against shrinking the storage and zeroing all of it at the wake: SmolLM2's 320 MiB
    cache, 60% of it written after, 0.18-0.21 s of CPU against 0.42-0.47 (3 rounds, load ~30).
    Each storage is probed first (a byte written in its first whole page must read 0 after): one
    that is not dropped so (no madvise, a shared mapping) is shrunk instead; returns those, as
    `_shrink` does, for the wake to regrow and zero."""
    kept = []
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        madvise = None
    seen = set()
    for t in tensors:
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or start in seen:
            continue
        seen.add(start)
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        probe = ctypes.c_ubyte.from_address(first) if end > first else None
        if probe is not None and madvise is not None:
            probe.value = 1
            if madvise(first, end - first, MADV_DONTNEED) == 0 and probe.value == 0:
                ctypes.memset(start, 0, first - start)
                ctypes.memset(end, 0, start + nbytes - end)
                continue
        kept.append(t)
    return _shrink(kept)


def _regrow(worker, what: str) -> None:
    state = _state(worker)
    if not state[what]:  # not released, or regrown already
        return
    for storage, nbytes in state[what]:
        storage.resize_(nbytes)
    if what == "kv_cache":
        for storage, _ in state[what]:
            storage.fill_(0)
        state[what] = []
        return
    # NaN through the tensors (the storage has no dtype), so a weight no sync wrote shows
    regrown = {s.data_ptr() for s, _ in state[what]}
    worker.chatgen_regrown = [
        p
        for p in worker.model_runner.get_model().parameters()
        if p.untyped_storage().data_ptr() in regrown and p.is_floating_point()
    ]
    for p in worker.chatgen_regrown:
        p.data.fill_(math.nan)
    worker.chatgen_rewrite_pending = True
    state[what] = []


def _missed(worker) -> str | None:
    import torch

    if not getattr(worker, "chatgen_rewrite_pending", False):
        return None
    worker.chatgen_rewrite_pending = False
    model = worker.model_runner.get_model()
    for name, module in model.named_modules():
        if getattr(module, "cpu_linear", None) is _released_linear:
            return f"{name} (its matmul handler was not rebuilt)"
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for p in getattr(worker, "chatgen_regrown", []):
        if torch.isnan(p).any():
            return names.get(id(p), "a weight tensor")
    worker.chatgen_regrown = []
    return None


def _trim_heap() -> None:
    if (trim := glibc_malloc_trim()) is not None:
        trim(0)
