# CHATGEN_HIDE_PACKAGES=vllm,ray PYTHONPATH=scripts/hide_packages:$PWD python -m chatgen.cli train ...
"""Make Python behave as if some installed packages were absent: `import vllm` raises ModuleNotFoundError and
`importlib.util.find_spec("vllm")` returns None, as where vLLM is not installed.

Python imports `sitecustomize` at start-up from sys.path, so putting this directory on PYTHONPATH hides the
packages in this process and in every Python subprocess that inherits the environment. It lets one venv check the
code paths of a smaller one (the GPU machine has no vLLM, Ray or fastapi) without building a second one.
CHATGEN_HIDE_PACKAGES: comma-separated top-level package names.
"""

import os
import sys

for _name in os.environ.get("CHATGEN_HIDE_PACKAGES", "").split(","):
    if _name.strip():
        # None in sys.modules is Python's own "not importable" mark: import raises ModuleNotFoundError and
        # find_spec returns None (a meta_path finder that raised would break libraries probing with find_spec)
        sys.modules[_name.strip()] = None
