"""NeMo RL's names for a generation module's calls (seed: NeMo RL's GenerationInterface), as a mixin.

    policy.prepare_for_generation()     # wake_up() if asleep
    texts = policy.generate_text(["Once upon a time"])
    policy.finish_generation()          # sleep() so a colocated trainer gets the memory

`generate(batch, greedy)` and `generate_async` are chatgen's own names too (chatgen.generation.base).
"""


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

    def generate_text(self, prompts, greedy=False, is_eval=False) -> list:
        """Text in, text out, for demos: list[str] -> list[str] of S = prompts x n responses (n = 1 if greedy)."""
        outputs = self.finished(self.build_dataset(prompts, is_eval), is_eval=is_eval, greedy=greedy)
        return [sample.text for request in outputs for sample in sorted(request.outputs, key=lambda s: s.index)]
