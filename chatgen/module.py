"""The one lifecycle of every chatgen model: vLLM generation, Megatron training, plain Python (a
reward).

    module = MyModule(config, name="policy")   # config: a dict, a per-model YAML path, or the typed config
    module.start()                             # = module.init(); module.setup()
    ...                                        # the role's own calls (generate, train_step, score, ...)
    module.shutdown()

- `__init__(config, *, name, config_dialect="chatgen")` stores the config after the config loader
  has checked it, the same way for every module type: a dict or a YAML path goes through
  `chatgen.config.load_model_config` against the class's `config_class` (unknown keys, types and
  ranges reported together, each with its fix); a typed instance (loaded already, or built in code)
  only has its range rules checked; `config_dialect="chatlearn"` reads a YAML path written for
  ChatLearn.
- `init()` is the framework's part: whatever must exist before a model is built (Megatron joins
  torch.distributed and its parallel groups; vLLM picks its executor). Users do not override it.
- `setup()` is the user hook (ChatLearn's name): build the model / engine and anything around it.
  The defaults build everything; an override does its own work around `super().setup()`.

The Ray runtime (chatgen/rlhf/runtime.py) constructs every model of a run this way, whatever its
backend. A reward model is a plain subclass:

    class LengthReward(chatgen.Module):
        def score(self, data):                       # data: {"texts": [...], record fields...}
            return torch.tensor([-len(t) / 100 for t in data["texts"]])
"""

import atexit
import contextlib
import gc
import os
import threading

from chatgen.compat.chatlearn import dialect as compat_dialect
from chatgen.config import ConfigError, load_model_config

# Objects still frozen at exit are never freed, and native extensions report them as leaks: a
# process that never shut its Megatron model down printed 60 lines of "nanobind: leaked ... triton"
# (megatron-core imports Triton).
atexit.register(gc.unfreeze)


@contextlib.contextmanager
def startup_gc():
    """Python's cyclic garbage collector paused while models are imported and built; what they made,
    frozen after.

    Importing torch, vLLM and megatron-core and building the models leaves ~660k long-lived objects.
    Python starts a full collection, a scan of all of them (up to 0.4 s on a 2-core CPU), each time
    that heap grows by a quarter: 2.0 s of collections before the tiny GRPO run's first evaluation,
    0.005 s with this pause. Inside this block collection is off; on leaving it every object alive
    is frozen (`gc.freeze`: left out of every later collection, as vLLM's engine does with its own
    heap after warm-up) and collection resumes as it was. Objects are still freed by reference
    counting; reference cycles made before the freeze wait for a module's shutdown, which unfreezes
    (vLLM's engine shutdown and MegatronModule.shutdown do), or the process's exit. Nested blocks
    are one pause (the outermost resumes collection).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


_pauses = 0  # collection_paused blocks open now, over all threads
_resume = False  # whether collection was on when the first of them began
_pauses_lock = threading.Lock()


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector off inside the block (what was collected before, and
    whether collection was on, unchanged after it).

    A generation call makes and drops thousands of small objects per engine step (vLLM's per-request
    scheduler and output records): ~6% of the tiny model's 256-prompt evaluation went to the
    young-generation collections they set off, which find almost nothing (their objects are freed by
    reference counting). Blocks may overlap across threads (a server's calls): collection resumes
    when the last one ends, and only if it was on when the first began.
    """
    global _pauses, _resume
    with _pauses_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


# How the run dispatches a declared method over a model's worker ranks (chatgen.rlhf.runtime's
# ModelHandle):
DISPATCH = {
    "all": "every rank (a collective call); one result per rank",
    "first": "every rank; rank 0's result",
    "split": "every rank, the batch (first argument) split over the data-parallel ranks; one result per "
    "DP rank",
}


def remote(dispatch: str = "all"):
    """Declare a method the run calls from the driver, and how (DISPATCH); verl declares its
    workers' methods the same way (`@register(dispatch_mode=...)`). The run calls it as a method
    of the model's handle: `runtime["policy_trainer"].train_step(batch, loss_fn)`; an undeclared
    method is not callable there, so what a trainer offers the run is read off its class. An
    override in a subclass keeps its base's declaration."""
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch {dispatch!r}: use one of {', '.join(DISPATCH)}")

    def declare(method):
        method.chatgen_dispatch = dispatch
        return method

    return declare


def remote_methods(cls) -> dict:
    """{method name: dispatch} of every method `cls` or a base of it declares with `remote`."""
    declared = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if hasattr(value, "chatgen_dispatch"):
                declared[name] = value.chatgen_dispatch
    return declared


class Module:
    """Base of VLLMModule, MegatronModule and user Python modules; see the module docstring."""

    config_class = dict  # the schema of this module's per-model config (a dataclass of chatgen.config, or dict)

    def __init__(self, config=None, *, name: str | None = None, config_dialect: str = "chatgen"):
        self.config = self._checked_config(config, config_dialect)
        self.name = name or type(self).__name__

    @classmethod
    def config_problems(cls, config):
        """(key, problem) pairs beyond the schema's own checks (e.g. what this platform cannot
        do)."""
        return ()

    def _checked_config(self, config, dialect: str = "chatgen"):
        """The typed config: a YAML path or a dict goes through the loader (every problem in one
        ConfigError); an instance of the schema (loaded already, or built in code) has its range
        rules and this platform's checked, without being read a second time."""
        schema = self.config_class
        if config is None:
            config = {}
        # dialect "chatlearn": a ChatLearn per-model YAML
        if isinstance(config, (str, os.PathLike)):
            return load_model_config(
                config, schema, extra_check=self.config_problems, dialect=compat_dialect(dialect)
            )
        if isinstance(config, dict):
            return load_model_config(
                None,
                schema,
                dict(config),
                extra_check=self.config_problems,
                dialect=compat_dialect(dialect),
            )
        if schema is not dict and isinstance(config, schema):
            problems = [*getattr(config, "check", tuple)(), *self.config_problems(config)]
            if problems:
                raise ConfigError([f"{key}: {problem}" for key, problem in problems])
            return config
        expected = "a dict or a YAML path" + ("" if schema is dict else f" or a {schema.__name__}")
        raise TypeError(
            f"{type(self).__name__}(config): expected {expected}, got {type(config).__name__}"
        )

    def init(self) -> None:
        """Framework: prepare what must exist before the model is built. Called once, before
        `setup()`."""

    def setup(self) -> None:
        """User hook: build the model (the defaults of VLLMModule / MegatronModule build it).
        Called once."""

    def start(self):
        """`init()` then `setup()`: how the framework (and a standalone script) brings a module
        up, with garbage collection paused meanwhile (`startup_gc`). Returns self."""
        with startup_gc():
            self.init()
            self.setup()
        return self

    def shutdown(self) -> None:
        """Release what `setup()` built (engines, threads). Safe to call twice."""
