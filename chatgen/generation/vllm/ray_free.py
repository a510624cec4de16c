"""`without_ray()`: import vLLM and build its engines without importing Ray, in a process that never did.

vLLM imports `ray` when it is imported (vllm.v1.executor.ray_utils, for its Ray executor) and again when it builds
an engine (`is_ray_initialized()` in `create_engine_config`). chatgen never uses vLLM's Ray executor (its own
Ray actors host the engines; multi-rank engines use external_launcher or vLLM's multiprocess executor). A
process that has not imported ray cannot have started Ray, so with ray hidden vLLM learns what it would have
learned (Ray is not running) without the import, which costs a local `chatgen train` 43 MiB of RSS and ~0.8 s
of startup (measured on the tiny task, issue 36). In a Ray worker, or once anything imported ray, nothing
changes.
"""

import contextlib
import sys


@contextlib.contextmanager
def without_ray():
    """Within it, `import ray` raises ImportError (which vLLM handles as "Ray is not installed") unless ray was
    imported before; afterwards ray imports as usual."""
    if "ray" in sys.modules:
        yield
        return
    sys.modules["ray"] = None  # the import system's "not importable" marker
    try:
        yield
    finally:
        if "ray" in sys.modules and sys.modules["ray"] is None:
            del sys.modules["ray"]
