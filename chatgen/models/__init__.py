"""Model families: what chatgen knows about an architecture, one file per family.

    from chatgen import models
    spec = models.spec_from_hf_config(json.load(open("DIR/config.json")))   # dispatches on model_type
    layout.hf_param_shapes(spec)          # (chatgen.models.layout) {HF name: shape}: what a sync delivers
    models.family(spec).param_mappings(spec)

A family is the module `chatgen/models/<model_type>.py` (llama.py, qwen2.py, qwen3.py) with four
functions: `spec_from_hf(hf_config) -> ModelSpec` (refusing what Megatron cannot express),
`param_mappings(spec)` (each Megatron parameter, its HF tensors with shapes and its layout kind),
`transformer_config_kwargs(spec)` and `gpt_model_kwargs(spec)` (the megatron-core model). Adding a
family adds that file and nothing else; a family kept outside chatgen registers itself with
`register_family("my_type", module)`. Tensor layouts under TP/PP are in layout.py; shared types in
spec.py. Nothing here imports Megatron or vLLM.
"""

import importlib
import importlib.util
import pkgutil
from pathlib import Path

from chatgen.models.spec import ModelSpec, ParamMapping

_REGISTERED = {}  # model_type -> family module registered from outside chatgen/models
_FAMILY_FUNCTIONS = (
    "spec_from_hf",
    "param_mappings",
    "transformer_config_kwargs",
    "gpt_model_kwargs",
)


def register_family(model_type: str, module) -> None:
    """Make a family module kept outside chatgen/models known under an HF `model_type`."""
    missing = [f for f in _FAMILY_FUNCTIONS if not hasattr(module, f)]
    if missing:
        raise TypeError(f"register_family({model_type!r}): the family module lacks {missing}")
    _REGISTERED[model_type] = module


def _is_family(name: str):
    """The module chatgen/models/<name>.py if it is a family (has the four functions), else None."""
    if importlib.util.find_spec(f"{__name__}.{name}") is None:
        return None
    module = importlib.import_module(f"{__name__}.{name}")
    return module if all(hasattr(module, f) for f in _FAMILY_FUNCTIONS) else None


def supported() -> list[str]:
    """The model_types chatgen can map: the family modules here plus registered ones."""
    here = [
        m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if _is_family(m.name)
    ]
    return sorted({*here, *_REGISTERED})


def family(spec_or_model_type):
    """The family module for a ModelSpec or an HF `model_type`; a clear error lists the supported
    ones."""
    name = getattr(spec_or_model_type, "family", spec_or_model_type)
    module = _REGISTERED.get(name) or (
        _is_family(name) if isinstance(name, str) and name.isidentifier() else None
    )
    if module is None:
        raise ValueError(
            f"model_type {name!r} is not supported; chatgen maps {supported()} (a new family is one "
            "file in chatgen/models/, see docs/extending.md)"
        )
    return module


def spec_from_hf_config(hf_config: dict) -> ModelSpec:
    """ModelSpec from an HF config.json dict (dispatches on `model_type`)."""
    return family(hf_config.get("model_type")).spec_from_hf(hf_config)


__all__ = [
    "ModelSpec",
    "ParamMapping",
    "family",
    "spec_from_hf_config",
    "register_family",
    "supported",
]
