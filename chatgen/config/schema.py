"""The building blocks of chatgen's typed configs: one dataclass per YAML mapping, one line per key.

A field is `name: type = opt(default, "one-line doc")`; adding a key is a one-line change in its
dataclass (and a row in docs/configuration.md, which `chatgen config --reference` prints). A
dataclass's `check()` yields `(key, "problem; fix")` for range and cross-key rules that a type alone
cannot say. The loader (loader.py) checks types, enums (`Literal`) and unknown keys for every field,
so a dataclass never validates its own types.

The dataclasses live with what reads them: a generation backend's per-model keys beside the backend
(chatgen/generation/config.py, chatgen/generation/vllm/config.py), the trainer's in
chatgen/training/config.py, the main YAML's (runtime, models, algorithm) in chatgen/rlhf/config.py.
This package knows none of them.
"""

import copy
import dataclasses
from typing import Literal

REQUIRED = dataclasses.MISSING
DTYPES = Literal["float32", "float16", "bfloat16"]


def opt(default, doc: str, path: bool = False):
    """A dataclass field with its one-line doc; list/dict/dataclass defaults are copied per
    instance. path: the value is a file or directory, which a run's loader makes absolute
    (chatgen.rlhf.config: actors may run in another working directory, on another node)."""
    meta = {"doc": doc, "path": path}
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


USER_KEYS_DOC = (
    "your own keys, free-form: chatgen reads none of them (`model_args(config)` gives them with the "
    "typed keys in one flat dict); a key of this section may not be repeated here"
)


def args_problem(config) -> str | None:
    """Why `config.args` (user keys) cannot sit beside the typed keys in one flat `model_args`,
    or None."""
    shadowed = sorted(
        key for key in config.args if key in {f.name for f in dataclasses.fields(config)}
    )
    if shadowed:
        return (
            f"{', '.join(map(repr, shadowed))} {'is a chatgen key' if len(shadowed) == 1 else 'are chatgen keys'} "
            "of this model; set it at the top level of the file, or give your key another name"
        )
    return None
