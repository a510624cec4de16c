"""NeMo RL's `VllmGeneration`: N vLLM workers behind one generation interface, in this process or on
Ray.

    from chatgen.compat.nemo_rl import VllmGeneration            # this class, by NeMo RL's name
    generation = VllmGeneration(vllm_config, num_workers=2)      # NeMo RL's VllmConfig (compat/nemo_rl/config.py)
    out = generation.generate({"input_ids": ids, "input_lengths": lengths}, greedy=False)
    async for row, out in generation.generate_async(batch): ...  # one row each, as its prompt finishes
    texts = generation.generate_text(["Once upon a time"])       # or {"prompts": [...]} -> {"texts": [...]}
    generation.prepare_for_generation(); generation.finish_generation(); generation.shutdown()

Workers run in this process (placement="process") or as Ray actors (placement="ray", on the Ray this
process started or joined). Each call spreads the batch's rows over the workers
(chatgen.generation.batching.assign: largest first, to the worker with the fewest tokens outstanding
across concurrent calls), the workers generate at once and the rows come back in the caller's order:
with n samples per prompt (the `n` key under vllm_kwargs; NeMo RL repeats prompts instead and keeps
n = 1), sample j of row i at row i * n + j, as one worker returns them. Refit:
chatgen.compat.nemo_rl.NemoRLRefit's calls over the workers' (chatgen.generation.workers); the
asynchronous ones return Futures in this process, Ray ObjectRefs on Ray or when Ray runs here
(_handles).
"""

import asyncio
import concurrent.futures
import contextlib
import secrets
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from chatgen.compat.nemo_rl import NemoRLRefit, RayHandles, prompt_texts
from chatgen.compat.nemo_rl.config import engine_config
from chatgen.generation.batching import assign, interleave, select_rows
from chatgen.generation.workers import IpcStream, VllmGenerationWorker

PLACEMENTS = ("process", "ray")
# calls that change what a worker's later calls see: each later call of that worker waits for them
ORDERED = {
    "init_collective",
    "prepare_refit_info",
    "update_weights_from_collective",
    "update_weights_from_ipc_handles",
    "update_weights_via_ipc_zmq",
    "prepare_for_generation",
    "finish_generation",
}
UPDATES = {  # ORDERED calls that load weights (see _start)
    "update_weights_from_collective",
    "update_weights_from_ipc_handles",
    "update_weights_via_ipc_zmq",
}
# padding of (S, L) outputs; None: the pad id; others 0
FILL = {
    "output_ids": None,
    "weight_versions": -1,
}


class VllmGeneration(NemoRLRefit):
    """NeMo RL's VllmGeneration(cluster, config, name_prefix, workers_per_node), or (config) as seed
    000 builds it, over `num_workers` chatgen engines (default: the cluster's world_size() /
    tensor_parallel_size, else 1).

    placement: "process" (the workers in this process, taking turns per engine step) or "ray" (each
    worker a Ray actor of its own on the running Ray, one CPU each, tensor_parallel_size GPUs on a
    GPU machine; calls in flight are Ray ObjectRefs, as NeMo RL's, and generate_async streams
    through Ray's streaming generators).

    Attributes: `workers` (VllmGenerationWorker each, or their actors), `token` (the secret the
    trainer signs weights with), `weight_stream` (the IpcStream of update_weights_via_ipc_zmq),
    `pad_token_id`.
    """

    def __init__(
        self,
        cluster_or_config,
        config: Mapping | None = None,
        name_prefix: str = "vllm_policy",
        workers_per_node=None,
        defer_model_load: bool = False,
        *,
        num_workers: int | None = None,
        placement: str = "process",
    ):
        cluster, config = (
            (None, cluster_or_config) if config is None else (cluster_or_config, config)
        )
        nemo = engine_config(config)  # checked once here; each worker adds the config's stops
        keys, self.cfg, self.colocated = nemo.keys, config, nemo.colocated
        self.tp = keys.get("tensor_parallel_size", 1)
        if num_workers is None:
            size = getattr(cluster, "world_size", None)
            num_workers = max(1, size() // self.tp) if callable(size) else 1
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"VllmGeneration: num_workers={num_workers!r}; give at least 1")
        if placement not in PLACEMENTS:
            raise ValueError(f"VllmGeneration: placement={placement!r} is not one of {PLACEMENTS}")
        self.placement = placement
        self.samples = keys.get("n", 1)
        self.token = secrets.token_hex(16)
        self.weight_stream = IpcStream(self.token)
        self.workers = []
        # threads for calls waiting on others (_start) beside the running ones
        self._pool = ThreadPoolExecutor(4 * num_workers, thread_name_prefix=name_prefix)
        self._ordered = [None] * num_workers  # each worker's last ORDERED call (see _start)
        self._in_flight = {
            True: set(),
            False: set(),
        }  # updates / other calls in flight (see _start)
        self._ray_handles, self._handed = None, 0  # the RayHandles actor (see _handles), keys given
        self._lock = threading.Lock()
        self._outstanding, self._served = [0] * num_workers, [0] * num_workers
        # NeMo RL's: no HTTP servers here (expose_http_server is refused); the engines' devices once
        # loaded
        self.dp_openai_server_base_urls, self.device_uuids = [None] * num_workers, None
        seed = keys.get("seed", 1234)  # seeds differ: two workers never draw the same samples
        self._to_load = [(config, seed + i, f"{name_prefix}_{i}") for i in range(num_workers)]
        if not defer_model_load:
            self.load_and_start()

    def load_and_start(self) -> None:
        """Start the engines (at construction unless defer_model_load=True: NeMo RL's overlapped
        start)."""
        try:
            while self._to_load:
                self.workers.append(self._worker(*self._to_load.pop(0)))
            self.pad_token_id, self.max_new_tokens = self._wait([self._start(0, "limits")])[0]
            self.device_uuids = self.devices()
        except BaseException:
            self.shutdown()
            raise

    def _worker(self, config, seed: int, name: str):
        """A worker in this process, or a Ray actor on a CPU (and tensor_parallel_size GPUs when
        CUDA is here)."""
        if self.placement == "process":
            return VllmGenerationWorker(
                config, seed=seed, token=self.token, stream=self.weight_stream, name=name
            )
        import ray

        # never Ray's own auto-start: its defaults are not chatgen's (loopback only)
        if not ray.is_initialized():
            raise RuntimeError(
                "VllmGeneration(placement='ray') needs a running Ray: call ray.init(...) first (chatgen's "
                "runs start theirs on loopback: chatgen.rlhf.runtime.init_ray)"
            )
        gpus = self.tp if torch.cuda.is_available() else 0
        actor = ray.remote(VllmGenerationWorker).options(num_cpus=1, num_gpus=gpus)
        return actor.remote(config, seed=seed, token=self.token, name=name)

    # ---- generation
    # ---------------------------------------------------------------------------------

    def generate(self, data, greedy: bool = False) -> dict:
        """chatgen.generation.base's `generate` over the workers: the same keys, rows in the
        caller's order."""
        lengths = data["input_lengths"].tolist()
        with self._spread(lengths, greedy) as shares:
            used = [(i, share) for i, share in enumerate(shares) if share]
            outs = self._wait(
                [self._start(i, "generate", select_rows(data, s), greedy) for i, s in used]
            )
            parts = [(share, out) for (_, share), out in zip(used, outs)]
        return self._merge(parts, len(lengths))

    async def generate_async(self, data, greedy: bool = False):
        """`generate`, streaming from every worker at once: (row, one-row output) as each prompt
        finishes, row in the caller's numbering. Leaving early aborts this call's requests on
        every worker."""
        batch = data
        lengths = batch["input_lengths"].tolist()
        n = 1 if greedy else self.samples
        with self._spread(lengths, greedy) as shares:
            streams = [
                (share, self._stream(i, "generate_async", select_rows(batch, share), greedy))
                for i, share in enumerate(shares)
                if share
            ]
            async for share, row, out in interleave(streams):
                yield share[row // n] * n + row % n, out

    def generate_text(self, prompts, greedy: bool = False):
        """Text in, text out over the workers: list[str] -> list[str] (prompt i's sample j at i *
        n + j), NeMo RL's {"prompts": [...]} -> {"texts": [...]}."""
        texts = prompt_texts(prompts)
        with self._spread([len(t) for t in texts], greedy) as shares:
            used = [(w, share) for w, share in enumerate(shares) if share]
            outs = self._wait(
                [self._start(w, "generate_text", [texts[i] for i in s], greedy) for w, s in used]
            )
            out = [None] * (len(texts) * (1 if greedy else self.samples))
            for (_, share), rows in zip(used, outs):
                n = len(rows) // len(share)
                for r, text in enumerate(rows):
                    out[share[r // n] * n + r % n] = text
        return {"texts": out} if isinstance(prompts, Mapping) else out

    async def generate_text_async(self, prompts, greedy: bool = False):
        """`generate_text`, streaming: (row, text), or (row, {"texts": [text]}) for NeMo RL's
        batch."""
        texts = prompt_texts(prompts)
        n = 1 if greedy else self.samples
        wrap = (lambda sub: {"prompts": sub}) if isinstance(prompts, Mapping) else list
        with self._spread([len(t) for t in texts], greedy) as shares:
            streams = [
                (
                    share,
                    self._stream(w, "generate_text_async", wrap([texts[i] for i in share]), greedy),
                )
                for w, share in enumerate(shares)
                if share
            ]
            async for share, row, out in interleave(streams):
                yield share[row // n] * n + row % n, out

    def prepare_for_generation(self, *args, **kwargs) -> bool:
        """Wake every worker's engine (NeMo RL: before generating, after the trainer's turn).
        True."""
        return all(self._all("prepare_for_generation"))

    def finish_generation(self, *args, **kwargs) -> bool:
        """Colocated (`colocated.enabled`, the default): put every worker's engine to sleep (the
        memory goes to the trainer). Not colocated: only reset every prefix cache, as NeMo RL
        does. True."""
        return all(self._all("finish_generation" if self.colocated else "reset_prefix_cache"))

    def start_gpu_profiling(self) -> None:
        """Every worker's CUDA profiler range starts (nothing on CPU)."""
        self._all("start_gpu_profiling")

    def stop_gpu_profiling(self) -> None:
        self._all("stop_gpu_profiling")

    def pop_metrics(self) -> dict:
        """`worker/<i>/samples`: the rows each worker generated since the last call."""
        with self._lock:
            served, self._served = self._served, [0] * len(self._served)
        return {f"worker/{i}/samples": rows for i, rows in enumerate(served)}

    def shutdown(self) -> bool:
        """Stop every worker's engine, free its memory, end the threads, remove the IPC file.
        True."""
        workers, self.workers, self._to_load = self.workers, [], []
        if self.placement == "ray" and workers:
            import ray

            # a dead actor has nothing left to free
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([w.shutdown.remote() for w in workers])
            for worker in workers:
                ray.kill(worker)
        for worker in workers if self.placement == "process" else ():
            worker.shutdown()
        self.weight_stream.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._ray_handles is not None:
            import ray

            ray.kill(self._ray_handles)
            self._ray_handles = None
        return True

    # ---- refit: the chatgen calls NemoRLRefit names
    # ----------------------------------------------------

    @property
    def inference_world_size(self) -> int:
        return len(self.workers) * self.tp

    def open_weight_channel(self, ip: str, port: int, world_size: int) -> list:
        """Every worker joins the trainer's group as member 1 + its index (world_size = 1 +
        workers)."""
        if self.tp != 1:
            raise ValueError(
                "init_collective: workers with tensor_parallel_size > 1 in this process take their weights "
                "through update_weights_from_ipc_handles; the collective needs one member per engine rank"
            )
        return self._handles(
            [
                self._start(i, "init_collective", 1 + i, ip, port, world_size)
                for i in range(len(self.workers))
            ]
        )

    def check_weight_manifest(self, manifest: dict) -> None:
        self._all("prepare_refit_info", manifest)

    def receive_weights(self) -> list:
        return self._handles(
            [self._start(i, "update_weights_from_collective") for i in range(len(self.workers))]
        )

    def load_shared_weights(self, handles: dict) -> list:
        self._all("update_weights_from_ipc_handles", handles)
        return self._all("sync_report")

    def devices(self) -> list:
        return [device for devices in self._all("report_device_id") for device in devices]

    def update_weights_via_ipc_zmq(self) -> list:
        """Every worker waits for the next `ipc_stream().send(model)` of the trainer and loads it; returns the
        calls in flight (Futures, each True once loaded). In this process only: Ray workers take
        update_weights_from_ipc_handles(handles)."""
        if self.placement != "process":
            raise ValueError(
                "update_weights_via_ipc_zmq: the IpcStream lives in this process; with placement='ray' write "
                "the weights with ShmSender.owned(generation.token).write(model) and call "
                "update_weights_from_ipc_handles(handles)"
            )
        return self._handles(
            [self._start(i, "update_weights_via_ipc_zmq") for i in range(len(self.workers))]
        )

    def ipc_stream(self) -> IpcStream:
        """The trainer's end of update_weights_via_ipc_zmq (NeMo RL's
        stream_weights_via_ipc_zmq)."""
        return self.weight_stream

    # ---- helpers
    # ------------------------------------------------------------------------------------

    def _start(self, i: int, method: str, *args):
        """Worker i's `method` in flight: a Future (this process) or a Ray ObjectRef (what NeMo
        RL returns). Per worker, a call issued after an ORDERED one (a refit, sleep / wake)
        starts once that one ended, whether or not the caller waited for it, as an actor runs its
        calls in order; its failure is raised by the calls that waited for it. Weight updates and
        generate calls of the group never overlap, on any worker: an update waits for the calls
        in flight, a later call for every update in flight (engines of one process share modules
        a reload empties, workers._Turns; and a broadcast some workers load while others still
        generate would wait on them forever)."""
        worker = self.workers[i]
        if self.placement == "ray":
            return getattr(worker, method).remote(*args)
        with self._lock:
            others = self._others(method)
            call = self._pool.submit(
                _after, self._ordered_before(i), others, getattr(worker, method), *args
            )
            if method in ORDERED:
                self._ordered[i] = call
            if method in UPDATES or method not in ORDERED:
                self._in_flight[method in UPDATES].add(call)
        call.add_done_callback(self._ended)
        return call

    def _others(self, method: str) -> list:
        """The calls of other kinds a call of `method` waits for (see _start); under self._lock."""
        if method in UPDATES:
            return [c for c in self._in_flight[False] if not c.done()]
        return [] if method in ORDERED else [c for c in self._in_flight[True] if not c.done()]

    def _ended(self, call) -> None:
        with self._lock:
            for calls in self._in_flight.values():
                calls.discard(call)

    def _handles(self, calls: list) -> list:
        """Refit calls in flight as NeMo RL waits on them (`ray.get`): Futures become ObjectRefs
        when Ray runs in this process, each made ready by a RayHandles actor when its call ends."""
        if self.placement == "ray" or not calls:
            return calls
        import ray

        if not ray.is_initialized():
            return calls
        if self._ray_handles is None:
            self._ray_handles = ray.remote(RayHandles).options(num_cpus=0).remote()
        broker, refs = self._ray_handles, []
        for call in calls:
            self._handed += 1
            refs.append(broker.result.remote(self._handed))

            def done(call, key=self._handed):
                error = call.exception()
                broker.put.remote(key, error is None, call.result() if error is None else error)

            call.add_done_callback(done)
        return refs

    def _ordered_before(self, i: int):
        """Worker i's ORDERED call still running (None: none; one that ended is no later call's
        concern)."""
        before = self._ordered[i]
        return None if before is None or before.done() else before

    def _wait(self, calls: list) -> list:
        if self.placement == "ray":
            import ray

            return ray.get(calls)
        return [call.result() for call in calls]

    def _all(self, method: str, *args) -> list:
        return self._wait([self._start(i, method, *args) for i in range(len(self.workers))])

    def _stream(self, i: int, method: str, *args):
        """Worker i's async generator `method`: itself here, through Ray's streaming generator on
        Ray."""
        if self.placement == "process":
            with self._lock:
                before, others = self._ordered_before(i), self._others(method)
            return _stream_after(before, others, getattr(self.workers[i], method)(*args))
        return _ray_stream(
            getattr(self.workers[i], method).options(num_returns="streaming").remote(*args)
        )

    @contextlib.contextmanager
    def _spread(self, lengths: list, greedy: bool):
        """Which rows each worker generates (counted outstanding while the call runs)."""
        if not self.workers:
            raise RuntimeError(
                "VllmGeneration: not started (defer_model_load=True): call load_and_start() first"
                if self._to_load
                else "VllmGeneration: shut down; build a new one"
            )
        n = 1 if greedy else self.samples
        costs = [n * (length + self.max_new_tokens) for length in lengths]
        with self._lock:
            shares = assign(costs, self._outstanding)
            for i, share in enumerate(shares):
                self._outstanding[i] += sum(costs[r] for r in share)
                self._served[i] += n * len(share)
        try:
            yield shares
        finally:
            with self._lock:
                for i, share in enumerate(shares):
                    self._outstanding[i] -= sum(costs[r] for r in share)

    def _merge(self, parts: list, rows: int) -> dict:
        """One output of the workers' parts [(their rows, their output)]: sample j of row i at i
        * n + j, every (S, L) tensor padded to the longest part."""
        n = len(parts[0][1]["generation_lengths"]) // len(parts[0][0])
        merged = {}
        for key, first in parts[0][1].items():
            if not torch.is_tensor(first):
                continue
            width = max(out[key].shape[1] for _, out in parts) if first.dim() == 2 else None
            fill = FILL.get(key, 0)
            merged[key] = torch.full(
                (rows * n,) + ((width,) if width else ()),
                self.pad_token_id if fill is None else fill,
                dtype=first.dtype,
            )
            for share, out in parts:
                index = torch.tensor([i * n + j for i in share for j in range(n)])
                if width:
                    merged[key][index, : out[key].shape[1]] = out[key]
                else:
                    merged[key][index] = out[key]
        return merged


def _after(before, others: list, fn, *args):
    """fn(*args) once `before` (an ORDERED call of the same worker, or None) and the calls
    `others` ended; a failure of `before` is raised (the caller expected its effect)."""
    concurrent.futures.wait(others)
    if before is not None and before.exception() is not None:
        raise _failed_before(fn.__name__, before.exception())
    return fn(*args)


async def _stream_after(before, others: list, stream):
    """The items of `stream` once `before` and `others` (as in _after) ended."""
    waits = [asyncio.wrap_future(c) for c in [before, *others] if c is not None]
    if waits:
        await asyncio.wait(waits)
    if before is not None and before.exception() is not None:
        raise _failed_before("generate_async", before.exception())
    async with contextlib.aclosing(stream) as rows:
        async for item in rows:
            yield item


def _failed_before(name: str, error: BaseException) -> RuntimeError:
    failed = RuntimeError(
        f"{name}: the weight update or sleep issued before this call on its worker failed ({error}); "
        "the engine may hold other weights than the caller expects"
    )
    failed.__cause__ = error
    return failed


async def _ray_stream(refs):
    """The items of a Ray streaming generator; closed early, it cancels the actor's call (which aborts its
    requests)."""
    import ray

    try:
        async for ref in refs:
            yield await ref
    finally:
        with contextlib.suppress(Exception):  # a finished call has nothing to cancel
            ray.cancel(refs)
