"""The main YAML of a run: `runtime:` (with the algorithm's section) and `models:`, loaded and
checked as one.

    from chatgen.rlhf.config import load_config
    cfg = load_config("configs/grpo_tiny.yaml", ["runtime.num_episode=3", "policy.temperature=0.5"])
    cfg.runtime.num_episode, cfg.models["policy"].config.temperature

Each model entry's `backend:` picks the schema of its per-model YAML and the class it runs: a
generation backend (chatgen.generation.base.load_backend: `vllm`, `hf`, or your own module),
`megatron` (the trainer), or `python` (your class; its `config_class` is the schema). The algorithm
(`runtime.algorithm.name`, chatgen.rlhf.algorithms) brings its own config section and the roles it
needs. Assembled from the generic loader's pieces (chatgen.config.loader); every problem of every
file comes back in one ConfigError. docs/configuration.md.
"""

import dataclasses
import difflib
import os
import re

import yaml

from chatgen.compat.chatlearn import dialect
from chatgen.config import CLI, ConfigError
from chatgen.config.loader import (
    at,
    key_paths,
    mask_secrets,
    merge,
    parse_override_tree,
    read_yaml,
    show,
    substitute,
)
from chatgen.config.typed import build, closest
from chatgen.core.checkpoint_io import write_private_text
from chatgen.core.imports import add_project_dir, import_class, project_dir
from chatgen.generation.config import GenerationConfig
from chatgen.rlhf import registry
from chatgen.rlhf.checks import check_colocation
from chatgen.rlhf.rewards import RewardsConfig, function_reward_config, reward_function
from chatgen.rlhf.schema import (
    ChatgenConfig,
    ModelEntry,
    RuntimeConfig,
    backend_schema,
)
from chatgen.training.config import MegatronConfig

RESOLVED_NAME = "resolved_config.yaml"


def load_config(main_yaml: str | os.PathLike, overrides: list[str] = ()) -> ChatgenConfig:
    """The main YAML (`runtime:` + `models:`), each model's `model_config_file`, and `key=value`
    overrides.

    Override paths: `runtime.num_episode=3`, `models.policy.num_gpu=1` (entry keys),
    `models.policy.temperature=0.5` or its shortcut `policy.temperature=0.5` (per-model keys).
    Raises ConfigError listing every problem.
    """
    errors, files = [], []
    main_yaml = os.path.abspath(os.fspath(main_yaml))
    # user code (rewards, algorithms) imports from there, here and in actors
    add_project_dir(project_dir(main_yaml))
    data, where = read_yaml(main_yaml, errors, files)
    if errors and not data:
        # nothing to validate: the main YAML is missing, empty or unreadable
        raise ConfigError(errors)
    overrides_tree = _route_overrides(parse_override_tree(overrides, errors), data, errors)
    merge(data, where, overrides_tree, dict.fromkeys(key_paths(overrides_tree), (CLI, "")))
    data = substitute(data, where, errors)

    runtime_data = data.get("runtime") or {}
    algorithm, roles = _load_algorithm(runtime_data, where, errors)
    for key in data:
        if key not in ("runtime", "models"):
            from_cli = where.get((key,), ("",))[0] == CLI
            models = data.get("models") if from_cli and isinstance(data.get("models"), dict) else {}
            if key in roles and from_cli:
                errors.append(
                    f"{CLI}: {key}: no model {key!r} under models; configured: {', '.join(models)}"
                )
                continue
            choices = ("runtime", "models", *models)
            errors.append(f"{at(where, (key,))}: unknown top-level key; {closest(key, choices)}")
    runtime = build(RuntimeConfig, runtime_data, where, errors, ("runtime",))
    if runtime is not None:
        runtime.algorithm = algorithm
        if runtime.train_global_batch_size is None:
            runtime.train_global_batch_size = runtime.sample_per_episode
    models_data = data.get("models")
    if not isinstance(models_data, dict) or not models_data:
        errors.append(
            f"{at(where, ('models',))}: no models; add e.g. `models: {{policy: {{backend: vllm, "
            "model_config_file: policy.yaml}}`"
        )
        models_data = {}
    models = {}
    for name, entry_data in models_data.items():
        entry = _load_entry(
            name, entry_data, os.path.dirname(main_yaml), runtime, roles, where, errors, files
        )
        if entry is not None:
            models[name] = entry
    # against every configured name: an entry with errors of its own is not "unknown"
    if runtime is not None:
        check_colocation(runtime, models_data, where, errors)
    _sampling_temperature(models, roles, where, errors)
    if errors:
        raise ConfigError(errors)
    for section in (runtime, runtime.algorithm, *(entry.config for entry in models.values())):
        _absolute_paths(section)
    return ChatgenConfig(
        runtime=runtime,
        models=models,
        path=main_yaml,
        overrides=list(overrides),
        files=list(dict.fromkeys(files)),
    )


def _absolute_paths(section) -> None:
    """Make a typed section's path keys (`opt(..., path=True)`) absolute, against the current
    directory, where the docs say relative paths start: the run's actors work in their raylet's
    directory, on other nodes too, so a relative path would point elsewhere there."""
    if not dataclasses.is_dataclass(section):
        return
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value:
            setattr(section, f.name, os.path.abspath(os.path.expanduser(value)))


def _route_overrides(tree: dict, data: dict, errors: list) -> dict:
    """`policy.x=` -> `models.policy.x`; `models.<name>.<per-model key>` ->
    `models.<name>.config.<key>`."""
    models = dict(data.get("models")) if isinstance(data.get("models"), dict) else {}
    # a model added on the command line takes shortcuts too
    if isinstance(tree.get("models"), dict):
        for name, sub in tree["models"].items():
            models.setdefault(name, sub)
    shortcuts = {
        key: tree.pop(key)
        for key in list(tree)
        if key not in ("runtime", "models") and key in models
    }
    if shortcuts:
        tree.setdefault("models", {})
    if not isinstance(tree.get("models"), dict):
        return tree  # no model overrides, or `models=<not a mapping>` (reported by the validation)
    merge(tree["models"], {}, shortcuts, {})
    entry_keys = [f.name for f in dataclasses.fields(ModelEntry)]
    for name, sub in tree["models"].items():
        if not isinstance(sub, dict) or not isinstance(sub.get("config", {}), dict):
            continue
        extra = {k: sub.pop(k) for k in list(sub) if k not in entry_keys}
        backend = models[name].get("backend") if isinstance(models.get(name), dict) else None
        for key in extra:
            # a python model's keys are free: a near-miss of an entry key would vanish into them
            # unnoticed
            if backend == "python" and difflib.get_close_matches(key, entry_keys, n=1, cutoff=0.8):
                errors.append(
                    f"{CLI}: models.{name}.{key}: unknown model entry key; {closest(key, entry_keys)} "
                    f"(a python model's own keys go under models.{name}.config.{key})"
                )
        merge(sub.setdefault("config", {}), {}, extra, {})
    return tree


def _load_algorithm(runtime_data, where: dict, errors: list):
    """(the algorithm's typed section, its MODELS roles) from `runtime.algorithm` (popped from
    runtime_data)."""
    section = runtime_data.pop("algorithm", None) if isinstance(runtime_data, dict) else None
    section = {} if section is None else section
    name = section.get("name", "grpo") if isinstance(section, dict) else "grpo"
    try:
        module = registry.load(name)
    except ValueError as e:
        errors.append(f"{at(where, ('runtime', 'algorithm', 'name'))}: {e}")
        return None, {}
    return build(module.Config, section, where, errors, ("runtime", "algorithm")), module.MODELS


def _load_entry(
    name, entry_data, main_dir: str, runtime, roles: dict, where: dict, errors: list, files: list
):
    path = ("models", name)
    if roles and name not in roles:
        algorithm = (
            runtime.algorithm.name
            if runtime is not None and runtime.algorithm is not None
            else "the algorithm"
        )
        errors.append(
            f"{at(where, path)}: not a model of {algorithm}; {closest(name, roles, 'model names')}"
        )
        return None
    if not isinstance(entry_data, dict):
        return build(ModelEntry, entry_data, where, errors, path)  # reports the non-mapping
    entry_data = dict(entry_data)
    inline = entry_data.pop("config", None) or {}
    if not isinstance(inline, dict):
        errors.append(
            f"{at(where, (*path, 'config'))}: expected a mapping of per-model keys, got "
            f"{type(inline).__name__}; write the keys indented under `config:`"
        )
        return None
    entry_keys = {f.name for f in dataclasses.fields(ModelEntry)}
    # a missing backend: ModelEntry's own error below
    backend, schema = (
        entry_data.get("backend"),
        dict,
    )
    if isinstance(backend, str) and backend != "python":
        try:
            schema = backend_schema(backend)
        except ValueError as e:
            errors.append(f"{at(where, (*path, 'backend'))}: {e}")
            return None
    for key in [k for k in entry_data if k not in entry_keys]:
        if schema is not dict and key in {f.name for f in dataclasses.fields(schema)}:
            del entry_data[key]
            errors.append(
                f"{at(where, (*path, key))}: a per-model key, not a model entry key; move it into "
                f"the model_config_file or under models.{name}.config"
            )
    entry = build(ModelEntry, entry_data, where, errors, path)
    if entry is None:
        return None

    data, model_where = {}, {(): where[()]}
    if entry.model_config_file:
        target = os.path.join(main_dir, os.path.expanduser(entry.model_config_file))
        data, model_where = read_yaml(
            target, errors, files, at(where, (*path, "model_config_file"))
        )
    inline_where = {
        p[3:]: (file, f"{prefix}models.{name}.config.")
        for p, (file, prefix) in where.items()
        if p[:3] == (*path, "config") and len(p) > 3
    }
    merge(data, model_where, inline, inline_where)
    if entry.backend == "python":
        schema = _class_schema(entry, where, path, errors)
        # a plain reward function: the Rewards module runs it as its one term
        if schema is FUNCTION:
            if data:
                errors.append(
                    f"{at(where, (*path, 'config'))}: {entry.model_class} is a function and takes no "
                    f"keys ({', '.join(data)}); for settings use model_class: {REWARDS_CLASS} "
                    "with `terms:` (docs/rewards.md)"
                )
                return None
            data, schema = function_reward_config(entry.model_class), RewardsConfig
            entry.model_class = REWARDS_CLASS
    if schema is None:
        return None
    reader = dialect(entry.config_dialect)
    if reader.read is not None:
        data = reader.read(data, model_where, schema, errors, f"models.{name}")
    # after the dialect: an ignored key needs no variable
    data = substitute(data, model_where, errors)
    entry.config = build(schema, data, model_where, errors, dialect=reader)
    if runtime is not None and entry.config is not None:
        _derive(entry, runtime, model_where, errors)
    return entry


FUNCTION = "function"  # _class_schema's answer for a model_class that names a plain function
REWARDS_CLASS = "chatgen.rlhf.rewards:Rewards"


def _class_schema(entry: ModelEntry, where: dict, path: tuple, errors: list):
    """A python model's config schema: its class's `config_class` (chatgen.Module), imported here
    in the driver so that a bad key fails before anything starts; FUNCTION when model_class names
    a function (a reward)."""
    try:
        cls = import_class(entry.model_class)
    except ValueError as e:
        errors.append(f"{at(where, (*path, 'model_class'))}: {e}")
        return None
    if not isinstance(cls, type):
        try:
            reward_function(entry.model_class)  # takes `completions`?
        except ValueError as e:
            errors.append(f"{at(where, (*path, 'model_class'))}: {e}")
            return None
        return FUNCTION
    return getattr(cls, "config_class", dict)


def _sampling_temperature(models: dict, roles: dict, where: dict, errors: list) -> None:
    """A model whose role scores the policy's samples scores logits / the policy's sampling
    temperature, renormalised over its top-k / top-p set: the distribution the engine sampled from
    (read once, when the trainer is built)."""
    policy = getattr(models.get("policy"), "config", None)
    temperature = getattr(policy, "temperature", None)
    if temperature is None or temperature <= 0:  # no policy, or greedy (refused elsewhere)
        return
    top_k, top_p = getattr(policy, "top_k", 0), getattr(policy, "top_p", 1.0)
    derived = {  # trainer key: (policy key, value; None = off)
        "logits_temperature": ("temperature", temperature),
        "logits_top_k": ("top_k", top_k if top_k > 0 else None),
        "logits_top_p": ("top_p", top_p if top_p < 1 else None),
    }
    for name, role in roles.items():
        cfg = getattr(models.get(name), "config", None)
        if not role.scores_samples or not hasattr(cfg, "logits_temperature"):
            continue
        for key, (policy_key, value) in derived.items():
            if getattr(cfg, key) is None:
                setattr(cfg, key, value)
            elif getattr(cfg, key) != value:
                errors.append(
                    f"{name}.{key}: {getattr(cfg, key)} differs from policy.{policy_key}="
                    f"{getattr(policy, policy_key)}, the distribution the samples it scores come "
                    "from; remove it (it is derived)"
                )


def _derive(entry: ModelEntry, runtime: RuntimeConfig, where: dict, errors: list) -> None:
    """Fill a model's batch dials left at None from the runtime; a trainer's explicit ones must
    agree."""
    cfg = entry.config
    if isinstance(cfg, GenerationConfig) and cfg.generation_batch_size is None:
        cfg.generation_batch_size = runtime.generation_batch_size
    if isinstance(cfg, MegatronConfig):
        for key, runtime_key in (
            ("micro_batch_size", "train_micro_batch_size"),
            ("global_batch_size", "train_global_batch_size"),
        ):
            runtime_value = getattr(runtime, runtime_key)
            if getattr(cfg, key) is None:
                setattr(cfg, key, runtime_value)
            elif entry.trainable and getattr(cfg, key) != runtime_value:
                errors.append(
                    f"{at(where, (key,))}: {getattr(cfg, key)} disagrees with runtime.{runtime_key}="
                    f"{runtime_value}; remove it (a trainer takes the runtime's value)"
                )


def to_dict(cfg) -> dict:
    """Plain dicts/lists/scalars of a ChatgenConfig (runtime + models) or of any schema
    dataclass."""
    if isinstance(cfg, ChatgenConfig):
        return {
            "runtime": dataclasses.asdict(cfg.runtime),
            "models": {name: dataclasses.asdict(entry) for name, entry in cfg.models.items()},
        }
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


def format_config(cfg) -> str:
    """The resolved config as YAML text, for the log at start (`logger.info("%s",
    format_config(cfg))`), secrets masked (chatgen.config.loader.mask_secrets)."""
    head = ""
    if isinstance(cfg, ChatgenConfig) and cfg.path:
        head = f"# resolved from {' '.join([show(cfg.path), *mask_overrides(cfg.overrides)])}\n"
    data = mask_secrets(to_dict(cfg))
    return head + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def mask_overrides(overrides: list) -> list:
    """`key=value` overrides as shown: a secret's value masked (a secret's key, ${VAR} text)."""
    shown = []
    for item in overrides:
        key, sep, value = str(item).partition("=")
        last = key.rsplit(".", 1)[-1]
        shown.append(key + sep + str(mask_secrets({last: value})[last]))
    return shown


def save_resolved(cfg: ChatgenConfig, out_dir: str | os.PathLike | None = None) -> str:
    """Write `<out_dir>/resolved_config.yaml` (default out_dir: runtime.output_dir); returns its
    path.

    Every include and override is applied and each model's keys are inline under `config:`, so
    `load_config(<that file>)` gives back the same config without the original files. Secrets are
    not written (mask_secrets: text read from the environment stays `${VAR}`, read again on load; a
    key named like a secret is masked), the file is this user's only (0600; a new output dir 0700),
    and a symbolic link planted at its path is refused.
    """
    out_dir = os.fspath(out_dir if out_dir is not None else cfg.runtime.output_dir)
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    out = os.path.join(out_dir, RESOLVED_NAME)
    data = to_dict(cfg)
    for entry in data["models"].values():
        entry["model_config_file"] = None  # its keys are all inline now
    source = (
        " ".join([show(cfg.path), *mask_overrides(cfg.overrides)])
        if cfg.path
        else "(built in code)"
    )
    write_private_text(
        out,
        f"# chatgen config {show(out)}\n# resolved from: {source}\n"
        f"# files read: {', '.join(show(p) for p in cfg.files) or '-'}\n"
        + yaml.safe_dump(mask_secrets(data), sort_keys=False, allow_unicode=True),
    )
    return out


SCHEMA_MARKER = re.compile(r"#\s*chatgen-schema:\s*(\S+)\s*(.*)")


def schema_marker(path) -> tuple | None:
    """(schema, reason) from a `# chatgen-schema: <schema> [reason]` line in a YAML's first 5 lines,
    else None.

    A per-model YAML that no main YAML reads names its schema this way (`vllm`, `megatron`,
    `python`, `package.module:DataclassName`, or `none <why>` for a YAML that is not a chatgen
    config), so that `chatgen config FILE` and the shipped-config test know how to validate it.
    """
    with open(path, encoding="utf-8") as f:
        for _, line in zip(range(5), f):
            if m := SCHEMA_MARKER.match(line.strip()):
                return m.group(1), m.group(2)
    return None


def resolve_schema(schema):
    """A schema class from a backend name (vllm, hf, megatron; python: a free mapping),
    'package.module:Class', or a class (returned as it is)."""
    if not isinstance(schema, str):
        return schema
    if schema == "python":
        return dict
    if ":" in schema:
        return import_class(schema)
    return backend_schema(schema)
