"""NeMo RL's `VllmGeneration`: N vLLM workers behind one generation interface, in this process.

    from chatgen.compat.nemo_rl import VllmGeneration            # this class, by NeMo RL's name
    generation = VllmGeneration(vllm_config, num_workers=2)      # NeMo RL's VllmConfig (compat/nemo_rl/config.py)
    out = generation.generate({"input_ids": ids, "input_lengths": lengths}, greedy=False)
    async for row, out in generation.generate_async(batch): ...  # one row each, as its prompt finishes
    texts = generation.generate_text(["Once upon a time"])       # or {"prompts": [...]} -> {"texts": [...]}
    generation.prepare_for_generation(); generation.finish_generation(); generation.shutdown()

Each call spreads the batch's rows over the workers (chatgen.generation.batching.assign: largest first, to the
worker with the fewest tokens outstanding across concurrent calls), the workers generate at once (each its own
engine thread) and the rows come back in the caller's order: with n samples per prompt (the `n` key under
vllm_kwargs; NeMo RL repeats prompts instead and keeps n = 1), sample j of row i at row i * n + j, as one worker
returns them. Refit: chatgen.compat.nemo_rl.NemoRLRefit's calls over the workers' (chatgen.generation.workers);
the asynchronous ones (init_collective, update_weights_from_collective, update_weights_via_ipc_zmq) return
concurrent.futures.Future objects, where NeMo RL returns Ray refs: wait with `[f.result() for f in refs]`.
"""

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from chatgen.compat.nemo_rl import NemoRLRefit, prompt_texts
from chatgen.compat.nemo_rl.config import engine_config
from chatgen.generation.batching import assign
from chatgen.generation.workers import IpcStream, VllmGenerationWorker

FILL = {
    "output_ids": None,
    "weight_versions": -1,
}  # padding of (S, L) outputs; None: the pad id; others 0


class VllmGeneration(NemoRLRefit):
    """NeMo RL's VllmGeneration(cluster, config, name_prefix, workers_per_node), or (config) as seed 000 builds
    it, over `num_workers` chatgen engines (default: the cluster's world_size() / tensor_parallel_size, else 1).

    Attributes: `workers` (VllmGenerationWorker each), `token` (the secret the trainer signs weights with),
    `weight_stream` (the IpcStream of update_weights_via_ipc_zmq), `pad_token_id`.
    """

    def __init__(
        self,
        cluster_or_config,
        config: Mapping | None = None,
        name_prefix: str = "vllm_policy",
        workers_per_node=None,
        *,
        num_workers: int | None = None,
    ):
        cluster, config = (
            (None, cluster_or_config) if config is None else (cluster_or_config, config)
        )
        keys, _ = engine_config(config)  # checked once here; each worker adds the config's stops
        self.tp = keys.get("tensor_parallel_size", 1)
        if num_workers is None:
            size = getattr(cluster, "world_size", None)
            num_workers = max(1, size() // self.tp) if callable(size) else 1
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"VllmGeneration: num_workers={num_workers!r}; give at least 1")
        self.samples = keys.get("n", 1)
        self.token = secrets.token_hex(16)
        self.weight_stream = IpcStream(self.token)
        self.workers = []
        # threads for one call per worker at a time, plus as many again: a refit waiting on the trainer and a
        # generate call must not queue behind each other
        self._pool = ThreadPoolExecutor(2 * num_workers, thread_name_prefix=name_prefix)
        self._lock = threading.Lock()
        self._outstanding, self._served = [0] * num_workers, [0] * num_workers
        seed = keys.get("seed", 1234)
        try:
            for i in range(num_workers):  # seeds differ: two workers never draw the same samples
                self.workers.append(
                    VllmGenerationWorker(
                        config,
                        seed=seed + i,
                        token=self.token,
                        stream=self.weight_stream,
                        name=f"{name_prefix}_{i}",
                    )
                )
        except BaseException:
            self.shutdown()
            raise
        self.pad_token_id = self.workers[0].pad_token_id
        self.max_new_tokens = self.workers[0].config.max_new_tokens

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, data, greedy: bool = False) -> dict:
        """chatgen.generation.base's `generate` over the workers: the same keys, rows in the caller's order."""
        batch = data
        lengths = batch["input_lengths"].tolist()
        with self._spread(lengths, greedy) as shares:
            calls = [
                (share, self._pool.submit(worker.generate, _rows(batch, share), greedy))
                for worker, share in zip(self.workers, shares)
                if share
            ]
            parts = [(share, call.result()) for share, call in calls]
        return self._merge(parts, len(lengths))

    async def generate_async(self, data, greedy: bool = False):
        """`generate`, streaming from every worker at once: (row, one-row output) as each prompt finishes, row
        in the caller's numbering. Leaving early aborts this call's requests on every worker."""
        batch = data
        lengths = batch["input_lengths"].tolist()
        n = 1 if greedy else self.samples
        with self._spread(lengths, greedy) as shares:
            streams = [
                (share, worker.generate_async(_rows(batch, share), greedy))
                for worker, share in zip(self.workers, shares)
                if share
            ]
            async for share, row, out in _interleave(streams):
                yield share[row // n] * n + row % n, out

    def generate_text(self, prompts, greedy: bool = False):
        """Text in, text out over the workers: list[str] -> list[str] (prompt i's sample j at i * n + j), NeMo
        RL's {"prompts": [...]} -> {"texts": [...]}."""
        texts = prompt_texts(prompts)
        with self._spread([len(t) for t in texts], greedy) as shares:
            calls = [
                (share, self._pool.submit(w.generate_text, [texts[i] for i in share], greedy))
                for w, share in zip(self.workers, shares)
                if share
            ]
            out = [None] * (len(texts) * (1 if greedy else self.samples))
            for share, call in calls:
                rows = call.result()
                n = len(rows) // len(share)
                for r, text in enumerate(rows):
                    out[share[r // n] * n + r % n] = text
        return {"texts": out} if isinstance(prompts, Mapping) else out

    async def generate_text_async(self, prompts, greedy: bool = False):
        """`generate_text`, streaming: (row, text), or (row, {"texts": [text]}) for NeMo RL's batch."""
        texts = prompt_texts(prompts)
        n = 1 if greedy else self.samples
        wrap = (lambda sub: {"prompts": sub}) if isinstance(prompts, Mapping) else list
        with self._spread([len(t) for t in texts], greedy) as shares:
            streams = [
                (share, w.generate_text_async(wrap([texts[i] for i in share]), greedy))
                for w, share in zip(self.workers, shares)
                if share
            ]
            async for share, row, out in _interleave(streams):
                yield share[row // n] * n + row % n, out

    def prepare_for_generation(self, *args, **kwargs) -> bool:
        """Wake every worker's engine (NeMo RL: before generating, after the trainer's turn). True."""
        return all(self._each(lambda w: w.prepare_for_generation()))

    def finish_generation(self, *args, **kwargs) -> bool:
        """Put every worker's engine to sleep (the memory goes to a colocated trainer). True."""
        return all(self._each(lambda w: w.finish_generation()))

    def pop_metrics(self) -> dict:
        """`worker/<i>/samples`: the rows each worker generated since the last call."""
        with self._lock:
            served, self._served = self._served, [0] * len(self._served)
        return {f"worker/{i}/samples": rows for i, rows in enumerate(served)}

    def shutdown(self) -> bool:
        """Stop every worker's engine, free its memory, end the threads, remove the IPC file. True."""
        for worker in self.workers:
            worker.shutdown()
        self.workers = []
        self.weight_stream.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        return True

    # ---- refit: the chatgen calls NemoRLRefit names ----------------------------------------------------

    @property
    def inference_world_size(self) -> int:
        return len(self.workers) * self.tp

    def open_weight_channel(self, ip: str, port: int, world_size: int) -> list:
        """Every worker joins the trainer's group as member 1 + its index (world_size = 1 + workers)."""
        if self.tp != 1:
            raise ValueError(
                "init_collective: workers with tensor_parallel_size > 1 in this process take their weights "
                "through update_weights_from_ipc_handles; the collective needs one member per engine rank"
            )
        return [
            self._pool.submit(w.init_collective, 1 + i, ip, port, world_size)
            for i, w in enumerate(self.workers)
        ]

    def check_weight_manifest(self, manifest: dict) -> None:
        self._each(lambda w: w.prepare_refit_info(manifest))

    def receive_weights(self) -> list:
        return [self._pool.submit(w.update_weights_from_collective) for w in self.workers]

    def load_shared_weights(self, handles: dict) -> list:
        self._each(lambda w: w.update_weights_from_ipc_handles(handles))
        return [w.last_sync for w in self.workers]

    def devices(self) -> list:
        return [device for w in self.workers for device in w.report_device_id()]

    def update_weights_via_ipc_zmq(self) -> list:
        """Every worker waits for the next `ipc_stream().send(model)` of the trainer and loads it; returns the
        calls in flight (Futures, each True once loaded)."""
        return [self._pool.submit(w.update_weights_via_ipc_zmq) for w in self.workers]

    def ipc_stream(self) -> IpcStream:
        """The trainer's end of update_weights_via_ipc_zmq (NeMo RL's stream_weights_via_ipc_zmq)."""
        return self.weight_stream

    # ---- helpers ------------------------------------------------------------------------------------

    def _each(self, fn) -> list:
        return [call.result() for call in [self._pool.submit(fn, w) for w in self.workers]]

    @contextlib.contextmanager
    def _spread(self, lengths: list, greedy: bool):
        """Which rows each worker generates (counted outstanding while the call runs)."""
        if not self.workers:
            raise RuntimeError("VllmGeneration: shut down; build a new one")
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
        """One output of the workers' parts [(their rows, their output)]: sample j of row i at i * n + j, every
        (S, L) tensor padded to the longest part."""
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


def _rows(batch: Mapping, share: list) -> dict:
    """The rows `share` of a batch: tensors and per-row lists indexed, other entries as they are."""
    rows = len(batch["input_ids"])
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() and len(value) == rows:
            out[key] = value[share]
        elif isinstance(value, list) and len(value) == rows:
            out[key] = [value[i] for i in share]
        else:
            out[key] = value
    return out


async def _interleave(streams: list):
    """(share, row, output) of several async iterators [(share, iterator)] as each yields; closing this one
    cancels them all (each closes its iterator: the worker aborts the requests left)."""
    queue, done = asyncio.Queue(), object()

    async def pump(share, stream):
        try:
            async with contextlib.aclosing(stream) as rows:
                async for row, out in rows:
                    queue.put_nowait((share, row, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(share, stream)) for share, stream in streams]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
