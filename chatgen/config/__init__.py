"""chatgen's config system: YAML + `includes:` + `${VAR:default}` + `key=value` overrides, typed by
dataclasses.

    from chatgen.config import load_model_config, opt
    cfg = load_model_config("configs/grpo_tiny/policy.yaml", VLLMConfig, ["temperature=0.5"])

It knows no schema: each dataclass lives with what reads it (a generation backend's keys beside the backend,
the trainer's in chatgen.training.config, the main YAML's in chatgen.rlhf.config, whose `load_config` reads a
whole run). Check a config from the shell: `chatgen config configs/grpo_tiny.yaml`. Layout and key reference:
docs/configuration.md.
"""

from chatgen.config.loader import CLI, ConfigError, parse_overrides
from chatgen.config.schema import DTYPES, REQUIRED, USER_KEYS_DOC, args_problem, opt
from chatgen.config.typed import Dialect, load_model_config

__all__ = [
    "CLI",
    "ConfigError",
    "Dialect",
    "load_model_config",
    "parse_overrides",
    "DTYPES",
    "REQUIRED",
    "USER_KEYS_DOC",
    "args_problem",
    "opt",
]
