"""Where a run's models go: groups of ranks, what one rank needs, and whether it all fits on a
cluster. Pure Python (no Ray import): `chatgen config` checks a layout with it before anything
starts, the runtime places by it.

    plans = plan_groups(cfg)                    # [GroupPlan]: colocation groups first, then lone models
    problems = topology_problems(cfg)           # what no cluster can run: ranks that disagree, TP vs heads, devices
    problems = placement_problems(plans, nodes, "PACK", cfg)   # do the groups fit on these nodes' resources?
    order = ranks_by_node(bundle_nodes)         # the bundle of each rank, node by node

Ranks of a model: a Megatron model its world (num_gpu on GPUs; on CPU TP x PP x data_parallel_size,
whose default is the expert-parallel size: EP ranks for a mixture-of-experts model's experts), a
generation model num_replicas x tensor_parallel_size engine ranks, a python model one. Replica i of
a generation model is ranks i*T .. i*T + T - 1 (T = its tensor_parallel_size): consecutive ranks
form its TP group (vLLM's "external data parallel" layout: every TP group generates on its own), so
the runtime orders ranks node by node and a TP group stays on one node whenever each node holds a
multiple of T of them. Models colocated in a group share its ranks, so they must agree on the count:
colocated engines tile the trainer's ranks (num_replicas x tensor_parallel_size = the trainer's
world), independent of its TP / PP / DP.
"""

import json
import typing
from pathlib import Path

from chatgen.config import ConfigError
from chatgen.rlhf.ray_cluster import cluster_address

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK")
# the trainer backends: their models train and score (a Role of backend "megatron" takes either)
TRAINER_BACKENDS = ("megatron", "fsdp")


class GroupPlan(typing.NamedTuple):
    """One colocation group: its models, ranks, and what each rank's bundle holds."""

    names: list
    world: int
    gpus: float  # per rank
    cpus: float  # per rank
    resources: dict  # per rank: custom Ray resources ({} = none)

    def bundle(self) -> dict:
        """The Ray placement-group bundle of one rank."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **self.resources}


def engine_tp(entry) -> int:
    """Tensor-parallel ranks of one engine of a generation model (1 for a backend without the
    key)."""
    return getattr(entry.config, "tensor_parallel_size", 1) or 1


def model_world_size(entry) -> int:
    """Ranks a model needs (see the module docstring)."""
    if entry.backend in TRAINER_BACKENDS:
        c = entry.config
        # default: one replica of a dense model's weights
        dp = c.data_parallel_size or c.expert_model_parallel_size
        return entry.num_gpu or c.tensor_model_parallel_size * c.pipeline_model_parallel_size * dp
    if entry.backend == "python":
        return 1
    return entry.num_replicas * engine_tp(entry)


def tp_sizes(cfg, names) -> dict:
    """{model: ranks of one of its tensor-parallel groups} for the models of a group with TP > 1."""
    sizes = {}
    for name in names:
        entry = cfg.models[name]
        tp = (
            entry.config.tensor_model_parallel_size
            if entry.backend in TRAINER_BACKENDS
            else engine_tp(entry)
            if entry.backend != "python"
            else 1
        )
        if tp > 1:
            sizes[name] = tp
    return sizes


def plan_groups(cfg) -> list:
    """[GroupPlan]: the runtime.colocation groups first, then a group for each model in none. A
    ConfigError names every group whose models need different numbers of ranks, with the fix."""
    grouped = [list(g) for g in cfg.runtime.colocation]
    grouped += [[name] for name in cfg.models if not any(name in g for g in grouped)]
    plans, problems = [], []
    for names in grouped:
        entries = {n: cfg.models[n] for n in names}
        worlds = {n: model_world_size(e) for n, e in entries.items()}
        trainers = {n: w for n, w in worlds.items() if entries[n].backend in TRAINER_BACKENDS}
        world = max(trainers.values()) if trainers else max(worlds.values())
        if len(set(trainers.values())) > 1:
            problems.append(
                f"runtime.colocation: {names} need different numbers of ranks {worlds}; colocated "
                "Megatron models need the same num_gpu (GPU) or TP x PP x DP (CPU)"
            )
        for n, e in entries.items():
            if e.backend in (*TRAINER_BACKENDS, "python") or worlds[n] == world:
                continue
            tp = engine_tp(e)
            if trainers:
                fix = (
                    f"set num_replicas: {world // tp}"
                    if world % tp == 0
                    else "pick a tensor_parallel_size that divides it"
                )
                other_tp = world // e.num_replicas if world % e.num_replicas == 0 else world
                problems.append(
                    f"models.{n}: num_replicas {e.num_replicas} x tensor_parallel_size {tp} = {worlds[n]} "
                    f"engine rank(s), but it is colocated with {world} trainer ranks "
                    f"({', '.join(trainers)}); colocated engines tile the group's ranks: {fix} (or set "
                    f"tensor_parallel_size: {other_tp})"
                )
            else:
                problems.append(
                    f"models.{n}: needs {worlds[n]} ranks, another generation model of its group "
                    f"{names} needs {world}; give them the same num_replicas x tensor_parallel_size, or "
                    "separate groups"
                )
        gpus = max((e.num_gpu for e in entries.values()), default=0)
        cpus = max((e.num_cpu for e in entries.values()), default=1)
        resources = {}
        for e in entries.values():
            for key, amount in e.resources.items():
                resources[key] = max(resources.get(key, 0), amount)
        plans.append(
            GroupPlan(names, world, gpus / world if gpus else 0, max(cpus / world, 0.01), resources)
        )
    if problems:
        raise ConfigError(problems)
    return plans


def topology_problems(cfg) -> list:
    """Every layout problem of a run that no cluster can fix, each naming the key and the fix:
    ranks colocated models disagree on, devices that do not match the engine ranks, TP sizes that
    do not divide the model's attention heads (read from `load`/config.json where the driver can
    read it)."""
    problems = []
    for name, entry in cfg.models.items():
        if entry.config is None or entry.backend == "python":
            continue
        if entry.backend in TRAINER_BACKENDS:
            tp, key, kv_rule = (
                entry.config.tensor_model_parallel_size,
                "tensor_model_parallel_size",
                False,
            )
        else:
            tp, key, kv_rule = engine_tp(entry), "tensor_parallel_size", True
            ranks = model_world_size(entry)
            if entry.num_gpu and entry.num_gpu != ranks:
                problems.append(
                    f"models.{name}.num_gpu: {entry.num_gpu} GPUs, but num_replicas {entry.num_replicas} x "
                    f"tensor_parallel_size {tp} = {ranks} engine ranks of one GPU each; set num_gpu: "
                    f"{ranks}, or num_replicas: {entry.num_gpu // tp} to use {entry.num_gpu} GPUs"
                    if entry.num_gpu % tp == 0
                    else f"models.{name}.num_gpu: {entry.num_gpu} GPUs is not a multiple of tensor_parallel_size "
                    f"{tp}; set num_gpu to num_replicas x tensor_parallel_size = {ranks}"
                )
        heads = _attention_heads(entry.config)
        if heads is not None and tp > 1:
            q, kv = heads
            if q % tp or (kv_rule and kv % tp and tp % kv):
                divisors = [
                    d
                    for d in range(1, q + 1)
                    if q % d == 0 and (not kv_rule or kv % d == 0 or d % kv == 0)
                ]
                problems.append(
                    f"models.{name}.{key}: {tp} does not split the model's {q} attention heads ({kv} KV "
                    f"heads; {entry.config.load}/config.json); use one of {divisors}"
                    + (" and more num_replicas for the same devices" if kv_rule else "")
                )
    try:
        plan_groups(cfg)
    except ConfigError as e:
        problems += e.errors
    return problems


def _attention_heads(config):
    """(query heads, KV heads) from the config.json of a model's `load` directory, or None when
    it cannot be read here (a path on the cluster only, a Megatron checkpoint)."""
    try:
        hf = json.loads((Path(config.load) / "config.json").read_text())
        return hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    except (OSError, TypeError, KeyError, ValueError):
        return None


def placement_problems(plans: list, nodes: list, strategy: str, cfg) -> list:
    """Whether the groups' bundles fit on `nodes` (each a dict of the resources it has free, as
    Ray reports them), placed one group after the other as Ray's `strategy` would, greedily: PACK
    fills the nodes a group already uses first, SPREAD puts each bundle on the node with the
    fewest of its group, STRICT_PACK needs one node for the whole group. Also names a
    tensor-parallel group that would straddle two nodes. Greedy, as Ray places bundles: for
    groups of equal bundles on nodes as sized by `ray start`, what it cannot place Ray cannot
    either (Ray would wait for resources that never come)."""
    free = [dict(n) for n in nodes]
    problems = []
    for plan in plans:
        bundle, label = plan.bundle(), "+".join(plan.names)
        counts = [0] * len(free)
        if strategy == "STRICT_PACK":
            whole = {k: v * plan.world for k, v in bundle.items()}
            fits = [i for i, node in enumerate(free) if _fits(node, whole)]
            if fits:
                counts[fits[0]] = plan.world
        else:
            for _ in range(plan.world):
                fits = [i for i, node in enumerate(free) if _fits(node, bundle)]
                if not fits:
                    break
                used = [i for i in fits if counts[i]]
                i = (
                    min(fits, key=lambda j: counts[j])
                    if strategy == "SPREAD"
                    else (used or fits)[0]
                )
                counts[i] += 1
                _take(free[i], bundle)
        if sum(counts) < plan.world:
            have = "; ".join(f"node {i}: {_show(n)}" for i, n in enumerate(nodes)) or "no nodes"
            problems.append(
                f"runtime.placement_strategy: {strategy}: {label} needs {plan.world} x {_show(bundle)}"
                f"{' on one node' if strategy == 'STRICT_PACK' else ''}, which the cluster cannot place "
                f"beside the groups before it ({have}); lower num_gpu / num_cpu, add nodes"
                f"{', or use PACK' if strategy == 'STRICT_PACK' else ''}"
            )
            continue
        if strategy == "STRICT_PACK":
            _take(free[counts.index(plan.world)], {k: v * plan.world for k, v in bundle.items()})
        problems += [
            f"runtime.placement_strategy: {strategy}: {p}"
            for p in tp_span_problems(cfg, plan.names, counts)
        ]
    return problems


def tp_span_problems(cfg, names, counts: list) -> list:
    """A problem for each model of a group whose tensor-parallel groups would straddle nodes,
    given the group's ranks per node (`counts`, ranks ordered node by node)."""
    problems = []
    for name, tp in tp_sizes(cfg, names).items():
        if any(c % tp for c in counts):
            problems.append(
                f"models.{name}: a tensor-parallel group of {tp} ranks would span two nodes (ranks per "
                f"node: {[c for c in counts if c]}); use STRICT_PACK, or num_gpu / num_cpu that put a "
                f"multiple of {tp} ranks on each node"
            )
    return problems


def _fits(node: dict, bundle: dict) -> bool:
    return all(node.get(k, 0) >= v - 1e-9 for k, v in bundle.items())


def _take(node: dict, bundle: dict) -> None:
    for k, v in bundle.items():
        node[k] = node.get(k, 0) - v


def _show(resources: dict) -> str:
    return (
        "{"
        + ", ".join(
            f"{k}: {v:g}"
            for k, v in sorted(resources.items())
            if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))
        )
        + "}"
    )


def ranks_by_node(bundle_nodes: list) -> list:
    """The bundle index of each rank: bundles grouped by node (nodes in order of first
    appearance), so that consecutive ranks, and with them a TP group, share a node. bundle_nodes:
    the node id of each bundle."""
    first = {}
    for node in bundle_nodes:
        first.setdefault(node, len(first))
    return sorted(range(len(bundle_nodes)), key=lambda b: (first[bundle_nodes[b]], b))


def launcher(cfg, plans: list) -> str:
    """ "local" or "ray" for runtime.launcher (see the module docstring); an impossible `local`
    is an error."""
    choice = cfg.runtime.launcher
    fits = len(plans) == 1 and plans[0].world == 1 and not cluster_address(cfg.runtime)
    if choice == "local" and not fits:
        raise ValueError(
            "runtime.launcher: local needs every model in one colocation group of one rank and no "
            "cluster (runtime.ray_address, RAY_ADDRESS); use launcher: ray (or auto) for this run"
        )
    return "local" if choice == "local" or (choice == "auto" and fits) else "ray"
