"""NeMo RL's `VllmGenerationWorker`: one chatgen vLLM engine with the seed's refit calls under their
names.

    worker = VllmGenerationWorker(config, token=secret)      # chatgen's per-model keys (a VLLMModule), started
    worker.init_collective(rank_prefix, ip, port, world_size, train_world_size=1)   # joins the trainer's group
    worker.prepare_refit_info({name: (shape, dtype)})         # checked against the engine now
    worker.update_weights_from_collective(info)               # one broadcast of the trainer, loaded
    worker.update_weights_from_ipc_handles(handles)           # a trainer's signed file in /dev/shm, loaded
    worker.update_weights_via_ipc_zmq()                       # the next write of the group's IpcStream, loaded
    worker.generate(batch) / generate_text(prompts) / ...     # VLLMModule's calls (chatgen.compat.nemo_rl)

Workers are what `chatgen.generation.worker_group.VllmGeneration` (NeMo RL's VllmGeneration) spreads
a batch over; a user rarely builds one. World sizes are the seed's: the training world plus the
inference world, a worker's `rank_prefix` its first rank in it. chatgen's trainer sends from its
rank 0 only (one broadcast per bucket), so the group formed has 1 + the inference ranks as members,
the trainer's other ranks staying out.

Authentication as everywhere in chatgen: every channel proves `token`, the secret of the worker's
group (`VllmGeneration.token`), which the trainer's sender signs with (chatgen.param_sync). NeMo
RL's CUDA IPC handles are host shared memory here, on GPUs too: the same call, the same dict in, the
engine checking the trainer's signed header before it maps a byte (chatgen.param_sync.shm). ZMQ is
replaced by an `IpcStream`: the trainer writes, every waiting worker loads.
"""

import asyncio
import contextlib
import secrets
import socket
import threading

import torch

from chatgen.compat.nemo_rl import refit_shapes
from chatgen.compat.nemo_rl.config import engine_config
from chatgen.generation.vllm.module import VLLMModule
from chatgen.param_sync import GroupReceiver, ShmSender, check_manifest, load_shm

IPC_WAIT_S = 600.0  # how long update_weights_via_ipc_zmq waits for the trainer's write


class _Turns:
    """When the engines of this process may step and load. vLLM keeps the running step's forward
    context in a module global, and shares modules between engines of one process (its
    rotary-embedding cache): an engine that steps while another steps, or while another's reload
    has put those modules on the meta device, crashes (an assertion, a meta-tensor copy, or
    memory corrupted). So a step runs alone; loads run together (the workers of a broadcast
    receive it at once), never beside a step."""

    def __init__(self):
        self._changed = threading.Condition()
        self._stepping, self._loading = False, 0

    @contextlib.contextmanager
    def step(self):
        with self._changed:
            self._changed.wait_for(lambda: not self._stepping and not self._loading)
            self._stepping = True
        try:
            yield
        finally:
            with self._changed:
                self._stepping = False
                self._changed.notify_all()

    def loading(self, buckets, tied: bool):
        """`buckets` passed through while holding a load turn from the first bucket to the end (a
        tied model's lm_head.weight left out); receiving the first happens before the turn is
        taken."""
        taken = False
        try:
            for bucket in buckets:
                if not taken:
                    with self._changed:
                        self._changed.wait_for(lambda: not self._stepping)
                        self._loading += 1
                    taken = True
                yield (item for item in bucket if not (tied and item[0] == TIED_HEAD))
        finally:
            if taken:
                with self._changed:
                    self._loading -= 1
                    self._changed.notify_all()


_TURNS = _Turns()
TIED_HEAD = "lm_head.weight"  # a tied model's head: NeMo RL's trainers send it, the engine has no such weight


class IpcStream:
    """The trainer end of `update_weights_via_ipc_zmq` (NeMo RL's `stream_weights_via_ipc_zmq`):
    `send(source)` writes the weights once into a private file in /dev/shm, signed with the
    workers' token, and hands the handles to every worker waiting in
    `update_weights_via_ipc_zmq`. One stream per group of workers."""

    def __init__(self, token: str):
        self._sender = ShmSender.owned(token)
        self._changed = threading.Condition()
        self.version, self.handles = 0, None

    def send(self, source, validate: bool = False) -> dict:
        """Write `source` (a torch.nn.Module with HF names, a MegatronModule, (name, tensor)
        pairs) and post it; returns the handles (what update_weights_from_ipc_handles takes,
        too)."""
        handles = self._sender.write(source, validate)
        with self._changed:
            self.version, self.handles = self.version + 1, handles
            self._changed.notify_all()
        return handles

    def wait_newer(self, version: int, timeout: float) -> tuple:
        """(version, handles) of the first write after `version`; TimeoutError after `timeout`
        seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.version > version, timeout):
                raise TimeoutError(
                    f"update_weights_via_ipc_zmq: no weights arrived within {timeout:g} s; the trainer "
                    "sends them with the group's ipc_stream().send(model)"
                )
            return self.version, self.handles

    def close(self) -> None:
        """Remove the last file (once every worker loaded it)."""
        self._sender.close()


class VllmGenerationWorker(VLLMModule):
    """A started VLLMModule plus NeMo RL's worker-level refit calls. config: NeMo RL's VllmConfig
    (its stops added to every row) or chatgen's per-model generation keys; seed: the sampling seed.

    token: the secret every weight channel of this worker proves (None: a new one, `worker.token`).
    stream: the IpcStream whose writes `update_weights_via_ipc_zmq` loads (a group shares one).
    """

    def __init__(
        self,
        config,
        bundle_indices=None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        *,
        token: str | None = None,
        stream: IpcStream | None = None,
        name: str | None = None,
    ):
        # NeMo RL's VllmConfig (it has model_name), else chatgen's keys; bundle_indices and
        # fraction_of_gpus place NeMo RL's Ray actor: this worker runs where it is built
        nemo = engine_config(config) if "model_name" in config else None
        keys, self.stops = (nemo.keys, nemo.stops) if nemo else (dict(config), {})
        super().__init__(
            {**keys, **({} if seed is None else {"seed": seed})}, name=name or "vllm_policy"
        )
        self.token = token or secrets.token_hex(16)
        self.weight_stream = stream or IpcStream(self.token)
        self.last_sync = None  # the SyncReport of the last refit
        self._receiver, self._streamed = None, 0
        self._head_sent = False  # the trainer's refit info names lm_head.weight of a tied model
        self.start()

    def sampling_params(self, prompt_len, *, stop_strings=(), stop_token_ids=(), **kwargs):
        """VLLMModule's, with the config's stops before the row's own (NeMo RL merges them so):
        every call, generate_text's too. A text keeps the stop string it ended at, as NeMo RL's
        (and HF's) do."""
        params = super().sampling_params(
            prompt_len,
            stop_strings=[*self.stops.get("stop_strings", ()), *stop_strings],
            stop_token_ids=[*self.stops.get("stop_token_ids", ()), *stop_token_ids],
            **kwargs,
        )
        # what SamplingParams' constructor derives for include_stop_str_in_output=True (no text held
        # back)
        params.include_stop_str_in_output, params.output_text_buffer_length = True, 0
        return params

    def limits(self) -> tuple:
        """(pad_token_id, max_new_tokens): what the group pads with and budgets by."""
        return self.pad_token_id, self.config.max_new_tokens

    def sync_report(self):
        """The SyncReport of the last refit (None before the first)."""
        return self.last_sync

    def execute_step(self, data):
        """One engine step, never beside another worker's step or load in this process (_Turns)."""
        with _TURNS.step():
            return super().execute_step(data)

    def init_collective(
        self, rank_prefix: int, ip: str, port: int, world_size: int, *, train_world_size: int = 1
    ) -> None:
        """Join the trainer's broadcast group at ip:port (blocks until every member joined).
        rank_prefix: this worker's first rank in the seed's world of world_size = training ranks
        + inference ranks."""
        member, size = 1 + rank_prefix - train_world_size, 1 + world_size - train_world_size
        if train_world_size < 1 or not 1 <= member < size:
            raise ValueError(
                f"init_collective: rank_prefix={rank_prefix} is not an inference rank of a world of "
                f"world_size={world_size} with train_world_size={train_world_size} training ranks first; "
                "give rank_prefix = train_world_size + this worker's first inference rank"
            )
        self._receiver = GroupReceiver(ip, port, member, size, self.token)

    def prepare_refit_info(self, state_dict_info: dict) -> None:
        """Check the trainer's {name: shape} or NeMo RL's {name: (shape, dtype)} against the
        engine now: a SyncError naming each mismatch (the same check every refit makes). A tied
        model's lm_head.weight is accepted (and left unloaded: the engine's head is its
        embedding)."""
        shapes = refit_shapes(state_dict_info)
        self._head_sent = TIED_HEAD in shapes
        check_manifest({name: tuple(s) for name, s in shapes.items()}, self.weight_manifest())

    def weight_manifest(self) -> dict:
        manifest = super().weight_manifest()
        if self._head_sent and self._tied() and TIED_HEAD not in manifest:
            manifest[TIED_HEAD] = manifest["model.embed_tokens.weight"]
        return manifest

    def load_weights(self, buckets, mode: str = "wait") -> int:
        """VLLMModule's, in a load turn (_Turns); a tied model's lm_head.weight is skipped (the
        engine's head is its embedding)."""
        stream = _TURNS.loading(buckets, self._tied())
        try:
            return super().load_weights(stream, mode)
        finally:
            stream.close()  # the turn ends even when the load failed midway

    def _tied(self) -> bool:
        return bool((self.hf_config or {}).get("tie_word_embeddings", False))

    def update_weights_from_collective(self, info: dict | None = None) -> bool:
        """Receive one broadcast of the trainer (it sends at the same time) and load it; `info`
        (the refit info, as seed 002 passes it) is checked first. True once loaded; a SyncError
        leaves the old weights."""
        if self._receiver is None:
            raise RuntimeError(
                "update_weights_from_collective: call init_collective(...) first (the trainer's group)"
            )
        if info is not None:
            self.prepare_refit_info(info)
        self.last_sync = self._receiver.receive_into(self)
        return True

    def update_weights_from_ipc_handles(self, ipc_handles: dict) -> bool:
        """Load the weights a trainer on this host wrote (IpcStream.send, or
        ShmSender.owned(token).write): {"path", "header" signed with this worker's token}. True
        once loaded."""
        self._head_sent = any(
            n == TIED_HEAD for b in ipc_handles["header"]["buckets"] for n, _ in b
        )
        self.last_sync = load_shm(self, ipc_handles, self.token)
        return True

    def update_weights_via_ipc_zmq(self, timeout: float = IPC_WAIT_S) -> bool:
        """Wait for the next write of this worker's IpcStream (the trainer's `send`) and load it."""
        self._streamed, handles = self.weight_stream.wait_newer(self._streamed, timeout)
        return self.update_weights_from_ipc_handles(handles)

    def report_device_id(self) -> list:
        """[the device of this worker's engine]: the GPU's UUID, or cpu@<host>."""
        if torch.cuda.is_available():
            return [f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"]
        return [f"cpu@{socket.gethostname()}"]

    def is_alive(self) -> bool:
        return self.engine is not None and self.health_problem is None

    def llm(self):
        """The engine (a `vllm.LLM`), as NeMo RL's worker hands it out."""
        return self.engine

    def start_gpu_profiling(self) -> None:
        """Start the CUDA profiler's range (nsys --capture-range=cudaProfilerApi); nothing on
        CPU."""
        if torch.cuda.is_available():
            torch.cuda.profiler.start()

    def stop_gpu_profiling(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.profiler.stop()

    # NeMo RL's `_async` twins (its async engine's spellings): the same call, off the caller's event
    # loop
    async def init_collective_async(self, *args, **kwargs) -> None:
        return await asyncio.to_thread(self.init_collective, *args, **kwargs)

    async def update_weights_from_collective_async(self, info: dict | None = None) -> bool:
        return await asyncio.to_thread(self.update_weights_from_collective, info)

    async def update_weights_from_ipc_handles_async(self, ipc_handles: dict) -> bool:
        return await asyncio.to_thread(self.update_weights_from_ipc_handles, ipc_handles)

    async def report_device_id_async(self) -> list:
        return self.report_device_id()

    async def reset_prefix_cache_async(self) -> bool:
        return await asyncio.to_thread(self.reset_prefix_cache)

    async def sleep_async(self, level: int = 1) -> None:
        return await asyncio.to_thread(self.sleep, level)

    async def wake_up_async(self, **kwargs) -> None:
        return await asyncio.to_thread(self.wake_up, **kwargs)

    def shutdown(self) -> bool:
        """Leave the weight group, stop the engine and free its memory. True."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        super().shutdown()
        return True
