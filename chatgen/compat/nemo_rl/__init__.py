"""NeMo RL's generation API under its names (seeds 000-002: GenerationInterface, VllmGeneration, its
worker).

    from chatgen.compat.nemo_rl import VllmGeneration              # N workers, one batch spread over them
    generation = VllmGeneration(vllm_config, num_workers=2)        # or VllmGeneration(cluster, vllm_config)
    out = generation.generate(input_data, greedy=False)            # right-padded input_ids + input_lengths
    texts = generation.generate_text({"prompts": ["Once upon a time"]})["texts"]
    generation.prepare_for_generation() / finish_generation() / shutdown()

    # refit (the seed's sequence; world_size = training ranks + inference ranks)
    refs = generation.init_collective(ip, port, world_size)        # the trainer: GroupSender(generation.token, ...)
    generation.prepare_refit_info(state_dict_info)                 # {name: (shape, dtype)}, checked now
    refs = generation.update_weights_from_collective(info)         # one broadcast of the trainer, loaded
    generation.update_weights_from_ipc_handles(handles)            # a trainer's signed file in /dev/shm
    refs = generation.update_weights_via_ipc_zmq()                 # the next generation.ipc_stream().send(model)

Here: the mixins every chatgen engine and group carries (`NemoRLGeneration` on a generation module:
prepare / finish_generation, generate_text(_async); `NemoRLRefit` on a group of workers: the refit
calls over chatgen's open_weight_channel / check_weight_manifest / receive_weights /
load_shared_weights / devices), the config's key map (config.py), and, loaded on first use from
chatgen.generation, the classes: `VllmGeneration` (worker_group.py), `VllmGenerationWorker` and
`IpcStream` (workers.py). A run's group of replicas (chatgen.rlhf.generation_group.GenerationGroup)
answers the same refit calls.

`generate(batch, greedy)` and `generate_async` are chatgen's own names too
(chatgen.generation.base); their batches take NeMo RL's right-padded `input_ids` + `input_lengths`,
per-row `stop_strings` and `stop_token_ids`, and the pad id of the `pad_token_id` key. Where chatgen
differs from NeMo RL: chatgen's trainer sends from its rank 0 only (the group formed is 1 + the
inference ranks) and signs with the group's `token`; the IPC calls are host shared memory on GPUs
too (CUDA IPC needs the trainer and the engine on one device, which chatgen's placement never makes:
colocated models share a process and sync in place); docs/migrating_from_nemo_rl.md.
"""

import contextlib
from collections.abc import Mapping


class NemoRLGeneration:
    """NeMo RL's spellings on a GenerationModule (a mixin of VLLMModule)."""

    def prepare_for_generation(self) -> bool:
        """NeMo RL's name: wake the engine if it sleeps. Returns True."""
        if self.is_sleeping():
            self.wake_up()
        return True

    def finish_generation(self) -> bool:
        """NeMo RL's name: put the engine to sleep (level 1) so a colocated trainer gets the
        memory. Returns True."""
        if not self.is_sleeping():
            self.sleep()
        return True

    def generate_text(self, prompts, greedy=False, is_eval=False):
        """Text in, text out: list[str] -> list[str] of S = prompts x n responses (n = 1 if
        greedy), response j of prompt i at i * n + j. NeMo RL's batch {"prompts": list[str]} ->
        {"texts": list[str]}."""
        outputs = self.finished(
            self.build_dataset(prompt_texts(prompts), is_eval), is_eval=is_eval, greedy=greedy
        )
        texts = [
            sample.text
            for request in outputs
            for sample in sorted(request.outputs, key=lambda s: s.index)
        ]
        return {"texts": texts} if isinstance(prompts, Mapping) else texts

    async def generate_text_async(self, prompts, greedy=False, is_eval=False):
        """`generate_text`, streaming: an async iterator of (row, text), response j of prompt i
        (row i * n + j) as soon as prompt i's responses finish; NeMo RL's batch {"prompts":
        [...]} yields (row, {"texts": [text]}). Requests of other callers run alongside; leaving
        the iterator early aborts this call's requests."""
        items = self.build_dataset(prompt_texts(prompts), is_eval)
        params = [
            self.sampling_params(len(item["input_ids"]), is_eval=is_eval, greedy=greedy)
            for item in items
        ]
        async with contextlib.aclosing(
            self.stream([item["input_ids"] for item in items], params)
        ) as outputs:
            async for i, output in outputs:
                samples = sorted(output.outputs, key=lambda s: s.index)
                for sample in samples:
                    row = i * len(samples) + sample.index
                    yield (
                        row,
                        ({"texts": [sample.text]} if isinstance(prompts, Mapping) else sample.text),
                    )


def prompt_texts(prompts) -> list:
    """The prompt strings of a list or of NeMo RL's {"prompts": [...]} batch (its BatchedDataDict
    is a Mapping)."""
    if isinstance(prompts, Mapping):
        if "prompts" not in prompts:
            raise ValueError(
                f"generate_text: a batch dict needs the key 'prompts' (a list of strings, NeMo RL's "
                f"spelling); it has {sorted(prompts)}"
            )
        return list(prompts["prompts"])
    return list(prompts)


class NemoRLRefit:
    """NeMo RL's refit calls on a group of generation workers (its VllmGeneration), over
    chatgen's own names. A group has `inference_world_size` (its engine ranks) and the chatgen
    calls named below."""

    def init_collective(
        self, ip: str, port: int, world_size: int, train_world_size: int | None = None
    ) -> list:
        """NeMo RL's name of `open_weight_channel`: every engine rank joins the trainer's
        broadcast group. world_size: the seed's, training ranks + inference ranks
        (train_world_size: the training ranks, else world_size - inference ranks). chatgen's
        trainer sends from its rank 0, so the group formed has 1 + the inference ranks as
        members: the trainer's `GroupSender(group.token, 1 + group.inference_world_size)`."""
        engines = self.inference_world_size
        train = world_size - engines if train_world_size is None else train_world_size
        if train < 1 or train + engines != world_size:
            raise ValueError(
                f"init_collective: world_size={world_size} must be the training ranks (at least 1"
                f"{'' if train_world_size is None else f', train_world_size={train_world_size}'}) plus "
                f"this group's {engines} inference ranks"
            )
        return self.open_weight_channel(ip, port, 1 + engines)

    def prepare_refit_info(self, state_dict_info: dict) -> None:
        """NeMo RL's name of `check_weight_manifest`; takes {name: shape} or NeMo RL's {name:
        (shape, dtype)}."""
        return self.check_weight_manifest(refit_shapes(state_dict_info))

    def update_weights_from_collective(self, info: dict | None = None) -> list:
        """NeMo RL's name of `receive_weights`: every engine rank loads one broadcast of the
        trainer. `info` (the refit info, as seed 002 passes it) is checked against every engine
        first."""
        if info is not None:
            self.prepare_refit_info(info)
        return self.receive_weights()

    def update_weights_from_ipc_handles(self, ipc_handles: dict) -> bool:
        """NeMo RL's name of `load_shared_weights`: weights a trainer on this host wrote, signed
        with the group's token ({"path", "header"}:
        chatgen.param_sync.ShmSender.owned(token).write). True once loaded."""
        self.load_shared_weights(ipc_handles)
        return True

    update_weights = update_weights_via_ipc = (
        update_weights_from_ipc_handles  # the seed's other spellings
    )

    def report_device_id(self) -> list:
        """NeMo RL's name of `devices`: the device of every engine rank."""
        return self.devices()


def refit_shapes(state_dict_info: dict) -> dict:
    """{name: shape} of NeMo RL's refit info {name: (shape, dtype)} (or of {name: shape} as it
    is)."""
    return {
        name: info[0] if len(info) == 2 and not isinstance(info[0], int) else info
        for name, info in state_dict_info.items()
    }


class RayHandles:
    """A Ray actor (async) that holds the results of calls running in the driver's process, so
    that NeMo RL's `ray.get(refs)` waits on them: `ref = handles.result.remote(key)` is the
    ObjectRef handed out, and `handles.put.remote(key, ok, value)` (when the call ended) makes it
    ready, with the value or the error. Defined here, import-light, because the actor's process
    imports it."""

    def __init__(self):
        self._results, self._ready = {}, {}

    def _event(self, key):
        import asyncio

        return self._ready.setdefault(key, asyncio.Event())

    async def put(self, key: int, ok: bool, value) -> None:
        self._results[key] = (ok, value)
        self._event(key).set()

    async def result(self, key: int):
        await self._event(key).wait()
        ok, value = self._results.pop(key)
        del self._ready[key]
        if not ok:
            raise value
        return value


# NeMo RL's classes over chatgen's engines live with the engines (chatgen.generation: vLLM,
# param_sync), above this floor; loaded on first use, as the package root loads its classes, so this
# module stays import-light.
_LAZY = {
    "VllmGeneration": "chatgen.generation.worker_group",
    "VllmGenerationWorker": "chatgen.generation.workers",
    "IpcStream": "chatgen.generation.workers",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
