"""`chatgen config`: check a config before launching anything and print it resolved.

    chatgen config configs/grpo_tiny.yaml runtime.num_episode=3 policy.max_new_tokens=12  # a main YAML
    chatgen config configs/grpo_tiny/policy.yaml temperature=0.7  # a per-model YAML (schema from its main YAML's
    chatgen config --schema vllm configs/grpo_tiny/policy.yaml    #  backend, a `# chatgen-schema:` line, or --schema)
    chatgen config --reference                                                      # key reference (markdown)

A main YAML gets every check `chatgen train` makes before it starts a model, by the same function
(`checked_run_config`): the imports of the user code it names, chatgen.rlhf.checks.check_run (the
algorithm's models, batch sizes, every line of the data files, the layout of the ranks: TP against
the model's heads, replicas x TP against the devices), and, when the run would attach to a Ray
cluster (runtime.ray_address or RAY_ADDRESS), whether its groups fit on that cluster's nodes (it
connects to read them; it starts nothing there). Exit status 2 with every problem listed (file, key,
fix) when the config is invalid (as every command).
"""

import dataclasses
import sys
import typing

from chatgen.compat.chatlearn import dialect
from chatgen.config import ConfigError, load_model_config
from chatgen.config.loader import read_yaml
from chatgen.config.typed import type_name
from chatgen.generation import base as generation
from chatgen.rlhf import registry
from chatgen.rlhf.checks import check_run
from chatgen.rlhf.config import format_config, load_config, resolve_schema, schema_marker, to_dict
from chatgen.rlhf.ray_cluster import cluster_address, cluster_nodes
from chatgen.rlhf.rewards import RewardsConfig, RewardTerm
from chatgen.rlhf.schema import ModelEntry, RuntimeConfig
from chatgen.training.config import FSDPConfig, LoRAConfig, MegatronConfig


def checked_run_config(path, overrides) -> tuple:
    """(config, algorithm module) of a main YAML after every check made before anything starts: the
    one function `chatgen config` and `chatgen train` both call, so the two cannot disagree. Loading
    imports the user code the config names (python models' classes); chatgen.rlhf.checks.check_run
    checks the algorithm's models, batch sizes, every line of the data files, the ranks' layout and,
    attached to a Ray cluster, that the groups fit its nodes. Raises ConfigError listing every
    problem."""
    cfg = load_config(path, overrides)
    algorithm = registry.load(cfg.runtime.algorithm.name)
    address = cluster_address(cfg.runtime)
    check_run(cfg, algorithm, cluster_nodes(address) if address else None)
    return cfg, algorithm


def sections() -> list:
    """(title, where, dataclass) of every config section, the shipped algorithms' and backends'
    included."""
    return [
        ("runtime", "main YAML, `runtime:`", RuntimeConfig),
        *[
            (
                "runtime.algorithm",
                f"name: {name}; chatgen/rlhf/algorithms/{name}.py",
                registry.load(name).Config,
            )
            for name in registry.available()
        ],
        ("models.<name>", "main YAML, one entry per model", ModelEntry),
        *[
            (
                name,
                f"per-model YAML of a `backend: {name}` model; chatgen/generation/{name}/",
                generation.load_backend(name).Config,
            )
            for name in generation.available()
        ],
        ("megatron", "per-model YAML of a `backend: megatron` model", MegatronConfig),
        ("megatron.lora", "`lora:` of a `backend: megatron` model; docs/lora.md", LoRAConfig),
        (
            "fsdp",
            "per-model YAML of a `backend: fsdp` model; Megatron-only keys must keep their defaults; "
            "docs/fsdp_backend.md",
            FSDPConfig,
        ),
        (
            "rewards",
            "config of a `model_class: chatgen.rlhf.rewards:Rewards` reward; docs/rewards.md",
            RewardsConfig,
        ),
        ("rewards.terms.<name>", "one term of a Rewards reward", RewardTerm),
    ]


def add_arguments(parser) -> None:
    parser.add_argument(
        "path", nargs="?", help="main YAML (runtime: + models:), or a per-model YAML with --schema"
    )
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. runtime.num_episode=3"
    )
    parser.add_argument(
        "--schema",
        help="validate PATH as one per-model YAML: vllm, megatron, fsdp, python or "
        "package.module:DataclassName",
    )
    parser.add_argument(
        "--reference", action="store_true", help="print the key reference of every section"
    )


def key_reference() -> str:
    """Markdown tables of every section's keys: type, default, meaning (pasted into
    docs/configuration.md)."""
    out = []
    for title, where, cls in sections():
        out += [
            f"### `{title}` ({where})",
            "",
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = (
                    f"`{f.default!r}`".replace("None", "null")
                    .replace("True", "true")
                    .replace("False", "false")
                )
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
                default = "(section)" if dataclasses.is_dataclass(value) else f"`{value!r}`"
            else:
                default = "required"
            kind = type_name(hints[f.name]).replace("|", "or")
            doc = f.metadata.get("doc", "").replace("|", "\\|")
            out.append(f"| `{f.name}` | {kind} | {default} | {doc} |")
        out.append("")
    return "\n".join(out)


def _is_main_yaml(path) -> bool:
    errors = []
    data, _ = read_yaml(str(path), errors, [])  # the loader's own reading, with its bounds
    if errors:
        return True  # let load_config report the problem with its file and line
    return bool({"runtime", "models"} & set(data))


def print_memory_estimate(cfg) -> None:
    """The per-GPU memory estimate (chatgen.rlhf.memory) as YAML comments after the config;
    warnings on stderr."""
    import os

    import torch

    from chatgen.rlhf.memory import GIB, host_estimate, host_warnings, memory_report

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not any(e.num_gpu for e in cfg.models.values()):  # a CPU run: host memory
        estimate = host_estimate(cfg)
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        print(
            "# host memory estimate of this CPU run, one process (docs/long_context.md): "
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.items())
            + f" GiB of {host / GIB:.1f}"
        )
        for warning in host_warnings(cfg, estimate, host):
            print(f"chatgen config: warning: {warning}", file=sys.stderr)
        return
    device = torch.cuda.get_device_properties(0).total_memory if on_gpu else 80 << 30
    lines, warnings = memory_report(cfg, device)
    where = "this machine's GPU" if on_gpu else "an 80 GiB GPU assumed (no CUDA here)"
    print(
        f"# memory estimate per GPU (docs/scaling.md; {where}):",
        *(f"#   {line}" for line in lines),
        sep="\n",
    )
    for warning in warnings:
        print(f"chatgen config: warning: {warning}", file=sys.stderr)


def run(args) -> int:
    if args.reference:
        print(key_reference())
        return 0
    if args.path is None:
        print("chatgen config: give a YAML path (or --reference)", file=sys.stderr)
        return 2
    schema = args.schema
    if schema is None and not _is_main_yaml(args.path):
        marker = schema_marker(args.path)
        if marker is None or marker[0] == "none":
            print(
                f"chatgen config: {args.path} is not a main YAML (runtime: + models:) and names no schema; pass "
                "--schema vllm|megatron|python|package.module:DataclassName",
                file=sys.stderr,
            )
            return 2
        schema = marker[0]
        # a YAML file names code to import: chatgen's only
        if ":" in schema and not schema.startswith("chatgen."):
            print(
                f"chatgen config: {args.path}: `# chatgen-schema: {schema}` names a module outside chatgen, which "
                f"a YAML line may not import; pass it on the command line instead: --schema {schema}",
                file=sys.stderr,
            )
            return 2
    try:
        if schema:
            import yaml

            config = load_model_config(
                args.path, resolve_schema(schema), args.overrides, dialect=dialect("chatgen")
            )
            print(yaml.safe_dump(to_dict(config), sort_keys=False))
        else:
            cfg, _ = checked_run_config(args.path, args.overrides)
            print(format_config(cfg))
            print_memory_estimate(cfg)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return 0
