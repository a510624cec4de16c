"""A vLLM policy that dies on purpose, for the tests of a replica lost mid-run (test_replicas.py,
test_async_rl.py): a model entry names it as `model_class: dying_policy:DyingPolicy`, and the Ray actor
imports it from this directory."""

import os
import time
from pathlib import Path

from chatgen.generation.vllm.module import VLLMModule


class DyingPolicy(VLLMModule):
    """The vLLM policy, except that on group rank `args.die_on_rank` its `args.die_on_call`-th generation call
    writes the time to `args.stamp` and ends the process, as a crashed engine would (imported inside the actor)."""

    calls = 0

    def run_generation(self, data, is_eval=False):
        args = self.config.args
        DyingPolicy.calls += 1
        if (
            int(os.environ["RANK"]) == args["die_on_rank"]
            and DyingPolicy.calls == args["die_on_call"]
        ):
            Path(args["stamp"]).write_text(str(time.time()))
            os._exit(1)
        return super().run_generation(data, is_eval)
