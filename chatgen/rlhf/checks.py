"""The checks of a whole run, before anything starts: what a schema cannot see.

check_run: the models the algorithm needs, the batch sizes against the data-parallel layout, the
data files and the placement of the groups (chatgen.rlhf.placement), every problem at once in one
ConfigError; check_colocation and policy_sampling_problems: rules across sections that load_config
and the policy-gradient algorithms apply. chatgen.rlhf.config (the schema, the YAML assembly and
saving) imports these, and re-exports check_run, trainer_rows and policy_sampling_problems for the
code that imports them from there.
"""

import inspect

from chatgen.config import ConfigError
from chatgen.config.loader import at
from chatgen.config.typed import closest
from chatgen.rlhf.data import data_problems
from chatgen.rlhf.placement import (
    TRAINER_BACKENDS,
    model_world_size,
    placement_problems,
    plan_groups,
    topology_problems,
)


def backend_kind(backend: str) -> str:
    """ "megatron" (a trainer: megatron or fsdp), "python", or "generation" (any other name: a
    generation backend) for a `backend:` value."""
    if backend in TRAINER_BACKENDS:
        return "megatron"
    return backend if backend == "python" else "generation"


def check_colocation(runtime, models: dict, where: dict, errors: list) -> None:
    """`runtime.colocation`: every name a configured model (`models`: the entries as written),
    each in one group."""
    seen = set()
    for group in runtime.colocation:
        for name in group:
            if name not in models:
                errors.append(
                    f"{at(where, ('runtime', 'colocation'))}: {name!r} is not a configured model; "
                    f"{closest(name, models, 'models')}"
                )
            elif name in seen:
                errors.append(
                    f"{at(where, ('runtime', 'colocation'))}: {name!r} is in two groups; "
                    "put each model in one group"
                )
            seen.add(name)


def check_run(cfg, algorithm, nodes: list | None = None) -> None:
    """Problems a schema cannot see (which models the algorithm needs, how they fit together, the
    layout of their ranks: chatgen.rlhf.placement), all at once, before any actor starts.
    `algorithm` is the algorithm's module (chatgen.rlhf.registry.load); `nodes`: the free
    resources of each node of the cluster the run will use
    (chatgen.rlhf.ray_cluster.cluster_nodes), to check that the groups fit there. Raises
    ConfigError."""
    name, where = cfg.runtime.algorithm.name, cfg.path or "config"
    errors = []
    for model, role in algorithm.MODELS.items():
        entry = cfg.models.get(model)
        if entry is None:
            if not role.optional:
                shown = (
                    "vllm (or another generation backend)"
                    if role.backend == "generation"
                    else role.backend
                )
                errors.append(
                    f"{where}: models.{model}: {name} needs a `{model}` model (backend: {shown}"
                    f"{', trainable: true' if role.trainable else ''}){': ' + role.doc if role.doc else ''}; "
                    "add it"
                )
            continue
        if backend_kind(entry.backend) != role.backend:
            need = (
                "a generation backend (vllm, hf, ...)"
                if role.backend == "generation"
                else f"backend {role.backend}"
            )
            errors.append(
                f"{where}: models.{model}.backend: {name} needs {need}, got {entry.backend}"
            )
        if role.trainable is not None and entry.trainable != role.trainable:
            what = "the model being trained" if role.trainable else "frozen"
            errors.append(
                f"{where}: models.{model}.trainable: must be {str(role.trainable).lower()} ({what})"
            )
    errors += [
        f"{where}: {problem}" for problem in getattr(algorithm, "check", lambda cfg: ())(cfg)
    ]
    rt = cfg.runtime
    rows = trainer_rows(cfg, algorithm)  # per episode
    rows_are = (
        f"runtime.sample_per_episode: {rows}"
        if rows == rt.sample_per_episode
        else f"runtime.sample_per_episode: {rt.sample_per_episode} gives {rows} trainer rows per episode ({name}), which"
    )
    gbs = rt.train_global_batch_size or rows
    if rows % gbs:
        errors.append(
            f"{where}: {rows_are} is not a multiple of runtime.train_global_batch_size={gbs}; make it one "
            "so every episode is whole optimizer steps"
        )
    # each DP rank gets 1/DP of a batch, in whole micro-batches
    for (
        model,
        entry,
    ) in cfg.models.items():
        if entry.backend not in TRAINER_BACKENDS or entry.config is None:
            continue
        mc = entry.config
        model_parallel = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
        world = model_world_size(entry)  # as plan_groups places it
        if world % model_parallel:
            continue  # init_distributed names this one
        if (world // model_parallel) % mc.expert_model_parallel_size:
            errors.append(
                f"{where}: models.{model}.expert_model_parallel_size: {mc.expert_model_parallel_size} does "
                f"not divide the data-parallel size {world // model_parallel}; the experts are split over "
                "data-parallel ranks: make DP a multiple of EP"
            )
            continue
        if mc.data_parallel_size and world != model_parallel * mc.data_parallel_size:
            errors.append(
                f"{where}: models.{model}.data_parallel_size: {mc.data_parallel_size} needs TP "
                f"{mc.tensor_model_parallel_size} x PP {mc.pipeline_model_parallel_size} x DP "
                f"{mc.data_parallel_size} = {model_parallel * mc.data_parallel_size} GPUs, num_gpu is "
                f"{entry.num_gpu}; make them agree (or set data_parallel_size: null)"
            )
            continue
        dp, micro = world // model_parallel, mc.micro_batch_size or rt.train_micro_batch_size
        how = (
            f"models.{model} has DP = {world} ranks / (TP {mc.tensor_model_parallel_size} x PP "
            f"{mc.pipeline_model_parallel_size}) = {dp} and micro batch {micro}"
        )
        if entry.trainable and gbs % (micro * dp):
            errors.append(
                f"{where}: runtime.train_global_batch_size: {gbs} does not split into whole micro-batches "
                f"on every data-parallel rank ({how}); make it a multiple of {micro * dp}"
            )
        elif rows % (micro * dp):
            errors.append(
                f"{where}: {rows_are} does not split into whole micro-batches on every data-parallel rank "
                f"({how}); make it a multiple of {micro * dp}"
            )
    if not rt.data_path:
        errors.append(
            f"{where}: runtime.data_path: required (a JSONL file of records, e.g. "
            "{\"prompt\": ..., \"answer\": ...}, or a .json, .parquet, .arrow or .csv "
            "file: docs/data_and_rewards.md)"
        )
    errors += [f"{where}: {problem}" for problem in data_problems(rt, reward_columns(cfg))]
    if rt.eval_episode_interval and not rt.eval_data_path:
        errors.append(
            f"{where}: runtime.eval_episode_interval: set, but runtime.eval_data_path is not; set both"
        )
    errors += [f"{where}: {problem}" for problem in release_problems(cfg)]
    layout = topology_problems(cfg)
    errors += [f"{where}: {problem}" for problem in layout]
    if nodes is not None and not layout:
        errors += [
            f"{where}: {problem}"
            for problem in placement_problems(plan_groups(cfg), nodes, rt.placement_strategy, cfg)
        ]
    if errors:
        raise ConfigError(errors)


def release_problems(cfg):
    """A generation model's release_during_training (chatgen.rlhf.weight_links) needs a CPU
    engine colocated with a trainer, in a synchronous run (an asynchronous one generates while
    the trainer trains)."""
    algo = cfg.runtime.algorithm
    for name, entry in cfg.models.items():
        if not getattr(entry.config, "release_during_training", False):
            continue
        key = f"models.{name}: release_during_training"
        with_trainer = any(
            name in group
            and any(cfg.models[m].backend in TRAINER_BACKENDS for m in group if m in cfg.models)
            for group in cfg.runtime.colocation
        )
        if entry.num_gpu:
            yield (
                f"{key} is for CPU engines: on GPUs the engine colocated with its trainer sleeps "
                "while it trains already; remove the key"
            )
        elif not with_trainer:
            yield (
                f"{key} needs {name} in a runtime.colocation group with the trainer that syncs "
                "into it (the engine's memory goes to that trainer); colocate them or remove the key"
            )
        if getattr(algo, "max_staleness", None) is not None or getattr(
            algo, "overlap_generation", False
        ):
            yield (
                f"{key}: runtime.algorithm.max_staleness / overlap_generation generate while the "
                "trainer trains, when the released engine has no weights; remove one of them"
            )


def trainer_rows(cfg, algorithm) -> int:
    """Rows each trainer call of an episode gets: the algorithm's `trainer_rows(cfg)` where it
    defines one (e.g. Online DPO trains on one pair per prompt), else sample_per_episode (one row
    per sample)."""
    return (
        algorithm.trainer_rows(cfg)
        if hasattr(algorithm, "trainer_rows")
        else cfg.runtime.sample_per_episode
    )


def policy_sampling_problems(cfg):
    """For policy-gradient algorithms: the policy must sample from the distribution the trainer
    scores. The trainer scores logits / temperature (its logits_temperature, derived from the
    policy's: rlhf.config), so a temperature > 0 is honoured exactly when the engine reports the
    log-probs of that same distribution (logprobs_mode: processed); top-k / top-p likewise, the
    trainer renormalising over the set vLLM keeps (logits_top_k / logits_top_p, derived there too);
    min-p / repetition penalty would need the same and are refused, each naming its key."""
    pc = cfg.models["policy"].config if "policy" in cfg.models else None
    if pc is not None:
        truncated = [key for key, on in (("top_k", pc.top_k > 0), ("top_p", pc.top_p < 1)) if on]
        if pc.temperature <= 0:
            yield (
                f"models.policy.temperature: {pc.temperature} is greedy decoding; a "
                "policy-gradient run samples: set a temperature > 0 (1.0: the model's own)"
            )
        elif (pc.temperature != 1.0 or truncated) and pc.logprobs_mode != "processed":
            what = " and ".join(
                [f"temperature {pc.temperature}"] * (pc.temperature != 1.0)
                + [f"{key} {getattr(pc, key)}" for key in truncated]
            )
            yield (
                f"models.policy.logprobs_mode: {pc.logprobs_mode} reports the log-probs before "
                f"{what}, but the trainer scores the distribution the engine sampled from; set "
                "logprobs_mode: processed"
            )
        off = {"min_p": 0.0, "repetition_penalty": 1.0}
        for key, value in off.items():
            if getattr(pc, key) != value:
                yield (
                    f"models.policy.{key}: {getattr(pc, key)}: the trainer scores the tempered, "
                    f"top-k / top-p distribution and cannot renormalise over what {key} keeps, so "
                    f"every update would be off-policy; set {key}: {value} (temperature, top_k or "
                    "top_p shape sampling)"
                )
    # the experts a trainer replays are the ones the engine recorded
    for (
        name,
        entry,
    ) in cfg.models.items():
        if (
            getattr(entry.config, "moe_routing_replay", False)
            and pc is not None
            and not getattr(pc, "return_routed_experts", False)
        ):
            yield (
                f"models.{name}.moe_routing_replay: true replays the experts the policy routed each token to; set "
                "models.policy.return_routed_experts: true (or moe_routing_replay: false)"
            )
    if pc is not None and cfg.runtime.sample_per_episode % pc.n:
        yield (
            f"runtime.sample_per_episode: {cfg.runtime.sample_per_episode} is not a multiple of policy n={pc.n} "
            "(samples per prompt); make it one"
        )


def reward_columns(cfg) -> dict:
    """{record field: which reward takes it} of the run's rewards: RuleReward's `answer`, and
    each reward function's parameters without a default besides completions and prompts (the data
    columns it is called with), so that a record lacking one is refused before any model starts."""
    from chatgen.rlhf.rewards import RewardsConfig, RuleRewardConfig, reward_function

    needed = {}
    for name, entry in cfg.models.items():
        if isinstance(entry.config, RuleRewardConfig):
            needed.setdefault("answer", f"models.{name} (RuleReward)")
        terms = entry.config.terms if isinstance(entry.config, RewardsConfig) else {}
        for term, spec in terms.items() if isinstance(terms, dict) else ():
            try:
                params = inspect.signature(reward_function(spec["function"])).parameters.values()
            except (KeyError, TypeError, ValueError):  # not a function term, or refused elsewhere
                continue
            for p in params:
                if (
                    p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.default is p.empty
                    and p.name not in ("completions", "prompts")
                ):
                    needed.setdefault(
                        p.name, f"models.{name}.config.terms.{term} ({spec['function']})"
                    )
    return needed
