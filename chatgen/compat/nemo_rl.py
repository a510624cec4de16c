"""NeMo RL's names for chatgen's generation calls (seed: NeMo RL's GenerationInterface and VllmGeneration), as
mixins: one for a generation module, one for a run's group of generation workers.

    policy.prepare_for_generation()     # wake_up() if asleep
    texts = policy.generate_text(["Once upon a time"])
    texts = policy.generate_text({"prompts": ["Once upon a time"]})["texts"]      # NeMo RL's batch in, its out
    async for row, text in policy.generate_text_async(["Once upon a time", "Hi"]):   # as each finishes
        ...
    policy.finish_generation()          # sleep() so a colocated trainer gets the memory

    group = runtime["policy"]           # chatgen.rlhf.generation_group.GenerationGroup: the refit calls
    refs = group.init_collective(ip, port, world_size)    # open_weight_channel
    group.prepare_refit_info(state_dict_info)             # check_weight_manifest
    refs = group.update_weights_from_collective()         # receive_weights
    group.update_weights_via_ipc(handles)                 # load_shared_weights
    group.report_device_id()                              # devices

`generate(batch, greedy)` and `generate_async` are chatgen's own names too (chatgen.generation.base); their
batches take NeMo RL's right-padded `input_ids` + `input_lengths`, per-row `stop_strings` and `stop_token_ids`,
and the pad id of the `pad_token_id` key. Where chatgen differs from NeMo RL: init_collective's world_size
counts one trainer rank (chatgen's trainer sends from its rank 0 only) and the trainer signs with the group's
`token`; update_weights_via_ipc is host shared memory on GPUs too (CUDA IPC needs the trainer and the engine on
one device, which chatgen's placement never makes: colocated models share a process and sync in place).
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
        """NeMo RL's name: put the engine to sleep (level 1) so a colocated trainer gets the memory. Returns True."""
        if not self.is_sleeping():
            self.sleep()
        return True

    def generate_text(self, prompts, greedy=False, is_eval=False):
        """Text in, text out: list[str] -> list[str] of S = prompts x n responses (n = 1 if greedy), response j of
        prompt i at i * n + j. NeMo RL's batch {"prompts": list[str]} -> {"texts": list[str]}."""
        outputs = self.finished(
            self.build_dataset(_texts(prompts), is_eval), is_eval=is_eval, greedy=greedy
        )
        texts = [
            sample.text
            for request in outputs
            for sample in sorted(request.outputs, key=lambda s: s.index)
        ]
        return {"texts": texts} if isinstance(prompts, Mapping) else texts

    async def generate_text_async(self, prompts, greedy=False, is_eval=False):
        """`generate_text`, streaming: an async iterator of (row, text), response j of prompt i (row i * n + j) as
        soon as prompt i's responses finish; NeMo RL's batch {"prompts": [...]} yields (row, {"texts": [text]}).
        Requests of other callers run alongside; leaving the iterator early aborts this call's requests."""
        items = self.build_dataset(_texts(prompts), is_eval)
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


def _texts(prompts) -> list:
    """The prompt strings of a list or of NeMo RL's {"prompts": [...]} batch (its BatchedDataDict is a Mapping)."""
    if isinstance(prompts, Mapping):
        if "prompts" not in prompts:
            raise ValueError(
                f"generate_text: a batch dict needs the key 'prompts' (a list of strings, NeMo RL's "
                f"spelling); it has {sorted(prompts)}"
            )
        return list(prompts["prompts"])
    return list(prompts)


class NemoRLRefit:
    """NeMo RL's refit calls on a group of generation workers (its VllmGeneration), over chatgen's own names."""

    def init_collective(self, ip: str, port: int, world_size: int) -> list:
        """NeMo RL's name of `open_weight_channel`: every engine rank joins the trainer's broadcast group."""
        return self.open_weight_channel(ip, port, world_size)

    def prepare_refit_info(self, state_dict_info: dict) -> None:
        """NeMo RL's name of `check_weight_manifest`; takes {name: shape} or NeMo RL's {name: (shape, dtype)}."""
        return self.check_weight_manifest(
            {
                name: info[0] if len(info) == 2 and not isinstance(info[0], int) else info
                for name, info in state_dict_info.items()
            }
        )

    def update_weights_from_collective(self) -> list:
        """NeMo RL's name of `receive_weights`: every engine rank loads one broadcast of the trainer."""
        return self.receive_weights()

    def update_weights_via_ipc(self, handles: dict) -> list:
        """NeMo RL's name of `load_shared_weights`: weights a trainer on this host wrote into shared memory."""
        return self.load_shared_weights(handles)

    def report_device_id(self) -> list:
        """NeMo RL's name of `devices`: the device of every engine rank."""
        return self.devices()
