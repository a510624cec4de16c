"""chatgen's config system: YAML + `includes:` + `${VAR:default}` + `key=value` overrides, typed by dataclasses.

    from chatgen.config import load_config, format_config, save_resolved
    cfg = load_config("configs/grpo_tiny.yaml", ["runtime.num_episode=3", "policy.temperature=0.5"])
    cfg.runtime.num_episode, cfg.models["policy"].config.temperature

Check a config from the shell (prints it resolved, or every error): `chatgen config configs/grpo_tiny.yaml`.
Layout and key reference: docs/configuration.md.
"""
from chatgen.config.loader import (
    ConfigError,
    format_config,
    load_config,
    load_model_config,
    model_args,
    parse_overrides,
    resolve_schema,
    save_resolved,
    schema_marker,
    to_dict,
)
from chatgen.config.schema import (
    DEFAULT_MODEL_CLASSES,
    SCHEMAS,
    AlgorithmConfig,
    ChatgenConfig,
    MegatronConfig,
    ModelEntry,
    Role,
    RuntimeConfig,
    VLLMConfig,
    opt,
)

__all__ = [
    "ConfigError", "load_config", "load_model_config", "model_args", "parse_overrides", "resolve_schema",
    "schema_marker", "to_dict", "format_config", "save_resolved", "DEFAULT_MODEL_CLASSES", "SCHEMAS",
    "AlgorithmConfig", "ChatgenConfig", "MegatronConfig", "ModelEntry", "Role", "RuntimeConfig", "VLLMConfig", "opt",
]
