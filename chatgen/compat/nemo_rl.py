"""NeMo RL's names for a generation module's calls (seed: NeMo RL's GenerationInterface), as a mixin.

    policy.prepare_for_generation()     # wake_up() if asleep
    texts = policy.generate_text(["Once upon a time"])
    texts = policy.generate_text({"prompts": ["Once upon a time"]})["texts"]      # NeMo RL's batch in, its out
    async for row, text in policy.generate_text_async(["Once upon a time", "Hi"]):   # as each finishes
        ...
    policy.finish_generation()          # sleep() so a colocated trainer gets the memory

`generate(batch, greedy)` and `generate_async` are chatgen's own names too (chatgen.generation.base); their
batches take NeMo RL's right-padded `input_ids` + `input_lengths`, per-row `stop_strings` and `stop_token_ids`,
and the pad id of the `pad_token_id` key.
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
        outputs = self.finished(self.build_dataset(_texts(prompts), is_eval), is_eval=is_eval, greedy=greedy)
        texts = [sample.text for request in outputs for sample in sorted(request.outputs, key=lambda s: s.index)]
        return {"texts": texts} if isinstance(prompts, Mapping) else texts

    async def generate_text_async(self, prompts, greedy=False, is_eval=False):
        """`generate_text`, streaming: an async iterator of (row, text), response j of prompt i (row i * n + j) as
        soon as prompt i's responses finish; NeMo RL's batch {"prompts": [...]} yields (row, {"texts": [text]}).
        Requests of other callers run alongside; leaving the iterator early aborts this call's requests."""
        items = self.build_dataset(_texts(prompts), is_eval)
        params = [self.sampling_params(len(item["input_ids"]), is_eval=is_eval, greedy=greedy) for item in items]
        async with contextlib.aclosing(self.stream([item["input_ids"] for item in items], params)) as outputs:
            async for i, output in outputs:
                samples = sorted(output.outputs, key=lambda s: s.index)
                for sample in samples:
                    row = i * len(samples) + sample.index
                    yield row, ({"texts": [sample.text]} if isinstance(prompts, Mapping) else sample.text)


def _texts(prompts) -> list:
    """The prompt strings of a list or of NeMo RL's {"prompts": [...]} batch (its BatchedDataDict is a Mapping)."""
    if isinstance(prompts, Mapping):
        if "prompts" not in prompts:
            raise ValueError(f"generate_text: a batch dict needs the key 'prompts' (a list of strings, NeMo RL's "
                             f"spelling); it has {sorted(prompts)}")
        return list(prompts["prompts"])
    return list(prompts)
