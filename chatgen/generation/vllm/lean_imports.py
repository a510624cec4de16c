"""`without_unused_imports()`: import vLLM and build its engines without the packages chatgen never
has vLLM use, in a process that has not imported them.

- `ray`: vLLM imports it when it is imported (vllm.v1.executor.ray_utils, for its Ray executor) and
  again when it builds an engine (`is_ray_initialized()` in `create_engine_config`). chatgen never
  uses vLLM's Ray executor (its own Ray actors host the engines; multi-rank engines use
  external_launcher or vLLM's multiprocess executor). A process that has not imported ray cannot
  have started Ray, so with ray hidden vLLM learns what it would have learned (Ray is not running).
  Measured on the tiny task's `chatgen train` (issue 36): 43 MiB of RSS, ~0.8 s.
- `opentelemetry`: vLLM's request tracing, imported (with its gRPC exporter, grpc and protobuf)
  inside a try/except at vLLM's import and used only when an OTLP traces endpoint is configured,
  which chatgen has no key for; hidden, vLLM takes it as not installed. Measured: vLLM's import 160
  -> 147 MiB of RSS, 0.2-0.4 s less.

Where a package was imported before (a Ray worker; a tracker that loaded opentelemetry), nothing
changes; after the block each imports as usual.
"""

from chatgen.core.imports import hidden_imports

UNUSED = ("ray", "opentelemetry")


def without_unused_imports():
    """Within it, importing a package of UNUSED raises ImportError (which vLLM handles as "not
    installed") unless it was imported before; afterwards each imports as usual."""
    return hidden_imports(UNUSED)
