"""Weight handover at a defined engine step: a generation call that asks for it takes `steps` engine
steps, and if the engine still holds weight version `version` then, it waits for the next weight
update and its requests continue under the new weights (partial rollouts by construction, not by
timing).

    with handover.hold_after(4, version=policy.weight_version):   # this thread's generation calls
        batch = policy.run_generation(items)       # returns once the weights changed and it finished

chatgen.rlhf.algorithms.grpo.loop marks the batches generating ahead of the trainer with it
(runtime.algorithm.handover_step, docs/async_rl.md). The engine
(chatgen.generation.vllm.engine_loop) stops stepping only while every running call is such a call,
past its steps, with the engine at its version: a call nobody marked (the trainer's next batch, an
evaluation, a server's request) always runs, and a marked call never waits once the version moved
on, so no call waits on an update that waits on it. The mark travels with the calling thread (a
context variable), so it reaches an engine in the same process (runtime.launcher: local); an engine
in another process, or one without an engine thread (external_launcher), never holds.
"""

import contextlib
import contextvars

_HOLD = contextvars.ContextVar("chatgen_hold", default=None)


@contextlib.contextmanager
def hold_after(steps: int | None, version: int = 0):
    """Mark the generation calls this thread makes inside the block: after `steps` engine steps,
    wait while the engine's weight version is `version` (None: no mark)."""
    if steps is not None and steps < 1:
        raise ValueError(f"hold_after: steps must be >= 1, got {steps}")
    token = _HOLD.set(None if steps is None else (steps, version))
    try:
        yield
    finally:
        _HOLD.reset(token)


def requested() -> tuple | None:
    """(steps, version) of a generation call made now on this thread, or None (unmarked)."""
    return _HOLD.get()
