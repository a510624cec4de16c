"""The runtime: each model of the main YAML runs as a group of workers with ranks and a master
address.

    runtime = Runtime.start(cfg)          # Ray actors (or one in-process worker), model init
    runtime["policy_trainer"].train_step(batch, loss_fn)  # as the method declares (@remote("split"))
    runtime.shutdown()                    # kill the actors; stop Ray if we started it

`runtime.launcher` picks how: `ray` runs every group as Ray actors (`ActorGroup`); `local` runs the
one group of a run whose models all share one process of one rank inside the driver (`LocalGroup`:
no Ray processes, no pickling of batches, ~7 s less start-up and a third of the memory on the tiny
CPU job); `auto` (default) is `local` for such a run without a cluster (`runtime.ray_address`,
`RAY_ADDRESS`), else `ray`. Both kinds of group answer the same calls; a generation model's handle
is a chatgen.rlhf.generation_group.GenerationGroup (its replicas as one model).

Colocation (`runtime.colocation: [[policy, policy_trainer, reference]]`) puts the models of one
group in the SAME actor processes: rank r of the group hosts rank r of each of its models, on the
same device(s). On GPUs they take turns on the memory (vLLM sleeps while the trainer trains) and the
weight sync is an in-process copy; on a machine without a GPU they share the CPU cores. A model in
no group gets actors of its own, and its weights travel to the policy over a private
torch.distributed group (chatgen.rlhf.weight_links).

Ranks (chatgen.rlhf.placement): a group has world size = the Megatron world (num_gpu on GPU; TP x PP x DP on
CPU, DP from the model's data_parallel_size), or num_replicas x tensor_parallel_size for a generation model, or 1;
rank 0 picks MASTER_ADDR / MASTER_PORT and every actor gets RANK, WORLD_SIZE, LOCAL_RANK. Ranks follow the nodes
Ray placed the group's bundles on (`runtime.placement_strategy`), so consecutive ranks, a tensor-parallel group,
share a node. An exception in an actor reaches the driver as `ActorFailure` carrying the actor's traceback, as
soon as the first rank fails; the driver then kills every actor (see `Runtime.shutdown`), so nothing is left
running.
"""

import dataclasses
import os
import time
import traceback

import torch

from chatgen.config import ConfigError
from chatgen.core import quiet
from chatgen.core.distributed import free_port, init_process_group
from chatgen.core.imports import import_class, require
from chatgen.core.process_tuning import own_cores, pin_process
from chatgen.generation.base import load_backend
from chatgen.module import remote_methods, startup_gc
from chatgen.rlhf.checkpoint import rng_state, set_rng_state
from chatgen.rlhf.checks import backend_kind
from chatgen.rlhf.generation_group import GenerationGroup
from chatgen.rlhf.model_handle import ModelHandle
from chatgen.rlhf.placement import (
    engine_tp,
    launcher,
    placement_problems,
    plan_groups,
    ranks_by_node,
    tp_span_problems,
)

# the Ray cluster's names: importable from here too
from chatgen.rlhf.ray_cluster import (
    LocalRay,  # noqa: F401
    alive_nodes,
    cluster_address,
    init_ray,
    worker_env,
)
from chatgen.rlhf.schema import model_class


CONCURRENT_CALLS = 16  # an apart engine actor's threads: generation calls, a sync, metrics at once


def engines_apart(cfg, names) -> bool:
    """Whether a group's ranks are independent engines: vLLM engines of one rank each (replicas of
    tensor_parallel_size 1) and python models, no trainer (its calls are one at a time)."""
    entries = [cfg.models[n] for n in names]
    return any(e.backend == "vllm" for e in entries) and all(
        e.backend == "python" or (e.backend == "vllm" and engine_tp(e) == 1) for e in entries
    )


class ActorFailure(RuntimeError):
    """A model's actor raised or died; the message names the model and carries the actor's
    traceback."""


def rendezvous_host(multi_node: bool) -> str:
    """Where this process's torch.distributed rendezvous listens: loopback on one machine
    (reachable from this machine only), the node's address on a cluster."""
    if not multi_node:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class ModelWorker:
    """One actor process: hosts rank `rank` of every model of its group (`self.models[name]`),
    and what the run attaches to them (`self.attached[(name, kind)]`: a weight-sync channel, an
    HTTP server), closed before the models shut down."""

    def __init__(self, rank: int, world_size: int, num_threads: int, env: dict, first_core=None):
        os.environ.update(env)
        # an engine apart on a CPU node: `num_threads` of the node's cores its own, from index
        # first_core, unless VLLM_CPU_OMP_THREADS_BIND says otherwise (nobind, or its own cores)
        if first_core is not None and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
            cores = own_cores(first_core, num_threads, os.sched_getaffinity(0))
            if cores is not None:
                pin_process(cores)
        # Ray: own devices
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        quiet.apply()  # before the models import their libraries (CHATGEN_VERBOSE came with env)

        # before vLLM, which pins the thread count once it has started
        torch.set_num_threads(num_threads)
        self.rank, self.models, self.attached = rank, {}, {}

    def address(self, multi_node: bool):
        host = rendezvous_host(multi_node)
        return host, free_port(host)

    def setup(self, master_addr: str, master_port: int, specs: list) -> None:
        """Build and start this rank of each model of the group: specs = [(name, model_class,
        config)], each the same way (chatgen.module: `cls(config, name=name).start()`). With
        several ranks the group's torch.distributed world is joined first, on a rendezvous this
        process controls (loopback on one machine), and every model of the group uses it."""
        world = int(os.environ["WORLD_SIZE"])
        # one rank has no rendezvous: a model that wants a world of its own binds port 0 for it
        if world > 1:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            import torch

            init_process_group(
                "nccl" if torch.cuda.is_available() else "gloo",
                self.rank,
                world,
                master_addr,
                master_port,
            )
        with startup_gc():  # the models' imports too (vLLM's and megatron-core's)
            for name, model_class, config in specs:
                self.models[name] = import_class(model_class)(config, name=name).start()

    def call(self, name: str, method: str, *args, **kwargs):
        return getattr(self.models[name], method)(*args, **kwargs)

    def run(self, fn, *args, **kwargs):
        """fn(worker, *args, **kwargs) in this process (module-level functions only):
        `worker.models[name]`."""
        return fn(self, *args, **kwargs)

    def attach(self, name: str, kind: str, obj):
        """Keep `obj` (with an optional `close()`) for model `name` until the worker stops;
        returns it."""
        self.attached[(name, kind)] = obj
        return obj

    def stop(self) -> None:
        """Close the attachments, then shut the models down in order (engines first: vLLM's teardown also ends
        torch.distributed)."""
        for obj in self.attached.values():
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self.attached.clear()
        for model in self.models.values():
            shutdown = getattr(model, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self.models.clear()


class ActorGroup:
    """The Ray actors of one colocation group (a `placement.GroupPlan`): `world` ModelWorkers in
    one placement group placed by `strategy`, one bundle per rank; rank r runs on the r-th bundle
    in node order (`placement.ranks_by_node`), and `nodes[r]` is its node's id.

    `engines_apart` (`engines_apart(cfg, names)`: engines of one rank, no trainer): each actor
    is a process of its own (no group-wide torch.distributed world; its engine steps on its own
    thread) and serves up to CONCURRENT_CALLS calls at once, so a weight update or a server's
    request reaches the engine between two engine steps while generation calls run (partial
    rollouts across processes; the engine loop orders everything that touches the engine)."""

    def __init__(
        self,
        plan,
        env: dict,
        multi_node: bool = False,
        strategy: str = "PACK",
        engines_apart: bool = False,
        taken: dict | None = None,
    ):
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.names, self.world_size = list(plan.names), plan.world
        bundle = plan.bundle()
        self.pg = placement_group([dict(bundle) for _ in range(plan.world)], strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=300)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {'+'.join(plan.names)} in 300 s: {plan.world} x {bundle} "
                f"({strategy}) is more than the cluster has free ({ray.available_resources()}); lower "
                "num_gpu / num_cpu, add nodes, or stop what holds them"
            )
        placed = placement_group_table(self.pg)["bundles_to_node_id"]
        order = ranks_by_node([placed[b] for b in range(plan.world)])
        self.nodes = [placed[b] for b in order]
        worker = ray.remote(ModelWorker)
        # apart: every actor a world of one (RANK still its index), serving CONCURRENT_CALLS calls
        world = 1 if engines_apart else plan.world
        threads = max(1, int(plan.cpus))
        if engines_apart:  # calls step the engine from Ray's threads: each must plan and run its
            # steps with the same OpenMP team (vLLM's CPU attention refuses a step planned for
            # another), and torch.set_num_threads reaches only its calling thread
            env = {**env, "OMP_NUM_THREADS": str(threads)}
        # on CPU nodes each engine apart gets cores of its own, after those of the engines apart
        # of the groups before (taken: node -> the cores they hold)
        taken, first_core = ({} if taken is None else taken), []
        for node in self.nodes:
            first_core.append(taken.get(node, 0) if engines_apart and not plan.gpus else None)
            if first_core[-1] is not None:
                taken[node] = first_core[-1] + threads
        self.actors = [
            worker.options(
                max_concurrency=CONCURRENT_CALLS if engines_apart else 1,
                num_cpus=plan.cpus,
                num_gpus=plan.gpus,
                resources=plan.resources or None,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=b
                ),
            ).remote(r, world, threads, env, first_core[r])
            for r, b in enumerate(order)
        ]
        self.multi_node = multi_node
        self.master_addr, self.master_port = self.get(
            [self.actors[0].address.remote(multi_node)], "start"
        )[0]

    def get(self, refs: list, what: str, labels: list | None = None):
        """ray.get of `refs`, failing as soon as the first of them fails (the others may still be
        running): the actor's traceback as an ActorFailure naming this group, `what` and the
        failing call's label (labels[i] for refs[i]; default: its rank, when there is one ref per
        rank)."""
        import ray

        if labels is None and len(refs) == self.world_size > 1:
            labels = [f"rank {r}" for r in range(self.world_size)]
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            where = f" ({labels[index[ready[0]]]})" if labels else ""
            try:
                ray.get(ready)
            except ray.exceptions.RayTaskError as e:
                raise ActorFailure(
                    f"{'+'.join(self.names)}: {what} failed in an actor{where}:\n{e}"
                ) from None
            except ray.exceptions.RayActorError as e:
                raise ActorFailure(
                    f"{'+'.join(self.names)}: an actor died during {what}{where}:\n{e}"
                ) from None
        return ray.get(refs)

    def setup(self, specs: list) -> None:
        """specs[r]: [(name, model_class, config)] of rank r (see ModelWorker.setup)."""
        self.get(
            [
                a.setup.remote(self.master_addr, self.master_port, specs[r])
                for r, a in enumerate(self.actors)
            ],
            "setup",
        )

    def call_async(self, name: str, method: str, *args, **kwargs) -> list:
        return [a.call.remote(name, method, *args, **kwargs) for a in self.actors]

    def run_each(self, fn, per_rank_args: list) -> list:
        """`fn(models, *per_rank_args[r])` on rank r (not on a rank whose args are None)."""
        return [
            a.run.remote(fn, *args)
            for a, args in zip(self.actors, per_rank_args)
            if args is not None
        ]

    def run_async(self, fn, *args, **kwargs) -> list:
        return [a.run.remote(fn, *args, **kwargs) for a in self.actors]

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.pg)


class LocalGroup:
    """A group of one rank whose worker lives in the driver process (runtime.launcher: local).
    Same calls as `ActorGroup`; a call runs when its result is asked for (`get`), and an
    exception in a model reaches the driver as the same `ActorFailure`, with the model's
    traceback."""

    multi_node = False
    world_size = 1

    RANK_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    def __init__(self, names: list, num_cpus: float, env: dict):
        self.names = list(names)
        self.driver_ranks = {k: os.environ.get(k) for k in self.RANK_KEYS}  # given back by kill()
        self.worker = ModelWorker(0, 1, max(1, int(num_cpus)), env)

    def get(self, thunks: list, what: str, labels: list | None = None):
        try:
            return [thunk() for thunk in thunks]
        except Exception as e:  # noqa: BLE001 - every model error, reported like a Ray actor's
            raise ActorFailure(
                f"{'+'.join(self.names)}: {what} failed:\n{traceback.format_exc()}"
            ) from e

    def setup(self, specs: list) -> None:
        # one rank: no rendezvous
        self.get([lambda: self.worker.setup("127.0.0.1", 0, specs[0])], "setup")

    def call_async(self, name: str, method: str, *args, **kwargs) -> list:
        return [lambda: self.worker.call(name, method, *args, **kwargs)]

    def run_each(self, fn, per_rank_args: list) -> list:
        return (
            [lambda: self.worker.run(fn, *per_rank_args[0])] if per_rank_args[0] is not None else []
        )

    def run_async(self, fn, *args, **kwargs) -> list:
        return [lambda: self.worker.run(fn, *args, **kwargs)]

    def kill(self) -> None:
        self.worker.stop()
        # the driver is no rank once its models are gone
        for key, value in self.driver_ranks.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Runtime:
    """All model groups of a run; `runtime[name]` is that model's ModelHandle."""

    def __init__(self, groups: list, handles: dict, local_ray: "LocalRay | None"):
        # the Ray this run started
        self.groups, self.handles, self.local_ray = (
            groups,
            handles,
            local_ray,
        )

    def __getitem__(self, name: str) -> ModelHandle:
        return self.handles[name]

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def rng_states(self) -> list:
        """Every worker's RNG states, per group, per rank."""
        return [group.get(group.run_async(_rng_state), "rng state") for group in self.groups]

    def set_rng_states(self, states: list) -> None:
        for group, ranks in zip(self.groups, states):
            group.get(group.run_each(_set_rng_state, [(s,) for s in ranks]), "rng state")

    @classmethod
    def start(cls, cfg, log=print) -> "Runtime":
        """Start every group of `cfg` (chatgen.rlhf.placement.plan_groups) and its models. On
        Ray, the groups are checked against the cluster's nodes first: a layout that cannot be
        placed is a ConfigError naming the key, at once, instead of a wait for resources that
        never come."""
        plans = plan_groups(cfg)
        local = launcher(cfg, plans) == "local"
        require_packages(cfg, local)
        address = cluster_address(cfg.runtime)
        started = None if local else init_ray(address, sum(p.world * p.cpus for p in plans))
        groups, handles = [], {}
        try:
            strategy = cfg.runtime.placement_strategy
            if not local and (problems := placement_problems(plans, alive_nodes(), strategy, cfg)):
                raise ConfigError(problems)
            env, taken = worker_env(), {}  # taken: node -> cores its engines apart hold
            for plan in plans:
                t0 = time.perf_counter()
                if local:
                    os.environ.update(env)  # what a Ray actor would get, before vLLM is imported
                    group = LocalGroup(plan.names, plan.cpus, env)
                else:
                    group = ActorGroup(
                        plan,
                        env,
                        multi_node=bool(address),
                        strategy=strategy,
                        engines_apart=engines_apart(cfg, plan.names),
                        taken=taken,
                    )
                groups.append(group)
                if not local and (
                    problems := tp_span_problems(
                        cfg, plan.names, [group.nodes.count(n) for n in dict.fromkeys(group.nodes)]
                    )
                ):
                    raise ConfigError(problems)  # Ray placed a tensor-parallel group across nodes
                group.setup(
                    [
                        [
                            (n, model_class(cfg.models[n]), rank_config(cfg.models[n], r))
                            for n in plan.names
                        ]
                        for r in range(plan.world)
                    ]
                )
                for n in plan.names:
                    handles[n] = ModelHandle(n, cfg.models[n], group)
                    # its replicas, its weight channel
                    if backend_kind(cfg.models[n].backend) == "generation":
                        handles[n] = GenerationGroup(handles[n])
                nodes = (
                    ""
                    if local
                    else f" on node(s) {', '.join(n[:8] for n in dict.fromkeys(group.nodes))}"
                )
                log(
                    f"[chatgen] started {'+'.join(plan.names)}: {plan.world} rank(s) x ({plan.cpus:g} CPU"
                    f"{f', {plan.gpus:g} GPU' if plan.gpus else ''}){nodes} in {time.perf_counter() - t0:.1f}s"
                )
            # data-parallel rank of each actor (None for a model without DP)
            for h in handles.values():
                h.dp_ranks = h.group.get(h.group.run_async(_dp_rank, h.name), "dp rank")
                if isinstance(h, ModelHandle):  # what its class declares (chatgen.module.remote)
                    h.declared = h.group.get(h.group.run_async(_remote_methods, h.name), "methods")[
                        0
                    ]
        except BaseException:
            cls(groups, handles, started).shutdown()
            raise
        return cls(groups, handles, started)

    def shutdown(self) -> None:
        """Kill every actor of this run and stop Ray if this run started it (leaving no Ray
        process or session file); safe to call twice."""
        for group in self.groups:
            try:
                group.kill()
            except Exception:  # noqa: BLE001 - already dead / Ray going down: nothing left to free
                pass
        self.groups = []
        if self.local_ray is not None:
            self.local_ray.stop()
        self.local_ray = None


def rank_config(entry, rank: int):
    """A model's config on rank `rank` of its group: the config itself, except that each replica
    of a generation model samples with its own seed (seed + replica index; the ranks of one
    replica must sample alike)."""
    if entry.num_replicas == 1:
        return entry.config
    return dataclasses.replace(entry.config, seed=entry.config.seed + rank // engine_tp(entry))


def _dp_rank(worker, name):
    return getattr(worker.models[name], "dp_rank", None)


def _remote_methods(worker, name):  # chatgen.module.remote
    return remote_methods(type(worker.models[name]))


def _rng_state(worker):
    return rng_state()


def _set_rng_state(worker, state):
    set_rng_state(state)


def require_packages(cfg, local: bool) -> None:
    """Before anything starts: the optional packages this run needs are installed (Ray unless
    `local`; what each model's generation backend lists in its REQUIRES), else a MissingPackage
    naming the setup.py extra."""
    if not local:
        require(
            "ray",
            "a run on Ray actors (a model with num_gpu, several ranks, or runtime.ray_address)",
        )
    for name, entry in cfg.models.items():
        if backend_kind(entry.backend) == "generation" and not entry.model_class:
            for package in getattr(load_backend(entry.backend), "REQUIRES", ()):
                require(package, f"models.{name} (backend: {entry.backend})")
