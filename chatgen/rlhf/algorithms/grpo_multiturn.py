"""Multi-turn GRPO: environments talk to the policy over OpenAI HTTP; GRPO trains on the token ids
it served.

    chatgen train configs/grpo_multiturn_tiny.yaml    # runtime.algorithm: {name: grpo_multiturn, environment: ...}

The run serves its policy (`VLLMModule.serve`: chatgen's OpenAI-compatible server on a loopback port
of the process holding the engine). Each episode: take sample_per_episode / n records; run n
episodes of the environment per record at once (threads, so the server batches their requests); each
episode is a chat the environment drives with the official `openai` client (user turn, model turn,
tool turn, model turn, ...) and ends with the episode's reward. Each episode becomes one training
sample: its first prompt, then every later token, trained on where the model generated it
(`response_mask` 1) and not where the chat template or the environment wrote it (0), with the
server's log-probs. Then GRPO as grpo.py: group advantages, old log-probs, clipped policy-gradient
steps, sync into the policy the server runs. The loop is GRPO's (grpo/loop.py), so max_staleness k
runs the conversations of the next k episodes while the trainer trains, with the weights pushed
mid-conversation (mode keep) and each token stamped with its version. docs/multiturn_rl.md has the
details.

`runtime.algorithm.environment` names the environment (chatgen.environments, docs/agents.md): a
built-in (`calculator`, `tool_math`, `search`), an adapter (`gymnasium:ENV_ID`, `verifiers:ENV_ID`,
`openenv:URL`), or your own 'package.module:Object': a reset/step protocol environment, played turn
by turn with its tools and the server's parsed `tool_calls` (`tool_call_parser`), or a class with
`episode`:

    class MyEnv:
        def __init__(self, base_url: str, api_key: str, model: str): ...   # once per run
        def episode(self, record: dict, temperature: float, max_tokens: int) -> Episode: ...
            # called from many threads at once; reaches the policy only through openai.OpenAI(base_url, api_key)

`runtime.algorithm.agent: 'package.module:function'` instead trains an unmodified agent program
through the agent gateway (chatgen.environments.agent, chatgen.serving.gateway): one gateway session
per episode, the function called with (base_url, api_key, task record).
"""

import concurrent.futures
import dataclasses
import secrets
import threading
from typing import Optional

from chatgen import environments
from chatgen.config import opt
from chatgen.config.typed import did_you_mean
from chatgen.core.imports import import_object
from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.environments import agent as agent_runner
from chatgen.environments.base import Episode
from chatgen.rlhf.algorithms import grpo
from chatgen.rlhf.algorithms.grpo import loop as grpo_loop
from chatgen.rlhf.health import RunHealthError
from chatgen.rlhf.placement import plan_groups
from chatgen.rlhf.runtime import engines_apart
from chatgen.rlhf.schema import Role


@dataclasses.dataclass(kw_only=True)
class Config(grpo.Config):
    environment: Optional[str] = opt(
        None,
        "the environment: a built-in (calculator, tool_math, search), an adapter "
        "(gymnasium:ENV_ID, verifiers:ENV_ID, openenv:URL or openenv:module:app), or "
        "'package.module:Object' (importable from the directory you run in; docs/agents.md)",
    )
    environment_args: dict = opt(
        {}, "keyword arguments of the environment (or gymnasium.make, vf.load_environment)"
    )
    max_turns: int = opt(8, "protocol environments: model turns per episode, then truncated")
    max_episode_tokens: Optional[int] = opt(
        None,
        "protocol environments: tokens of an episode after its first prompt (model, template and "
        "environment tokens); the episode stops there, truncated, and tokens past it are cut",
    )
    step_advantage_weight: float = opt(
        1.0, "advantage_estimator gigpo: the weight of the step advantage beside the episode's"
    )
    step_discount: float = opt(
        0.95, "advantage_estimator gigpo: the discount of later turns' rewards in a step's return"
    )
    step_timeout_s: float = opt(
        60.0, "protocol environments: seconds a step may take (a tool that never returns)"
    )
    agent: Optional[str] = opt(
        None,
        "instead of an environment: an agent program's entry point 'package.module:function', "
        "called per episode with (base_url, api_key, task record) and talking to the policy "
        "through the agent gateway with the plain openai SDK; returns the reward, or None when "
        "the harness POSTs it (docs/agents.md)",
    )
    agent_timeout_s: float = opt(
        600.0, "agent: seconds an episode's session may stay open; then it is dropped and counted"
    )
    tool_call_parser: Optional[str] = opt(
        None,
        "vLLM's tool-call parser the run's server reads the policy's tool calls with (hermes, "
        "llama3_json, mistral, pythonic, ...; chatgen serve --tool-call-parser)",
    )

    def check(self):
        yield from super().check()
        if self.overlap_generation:
            yield (
                "overlap_generation",
                (
                    "hands the weights over once the engine is idle, which a conversation "
                    "waiting on its tool can be mid-episode; use max_staleness: 1 (per-token "
                    "versions, the bound checked on the samples)"
                ),
            )
        if self.handover_step is not None:
            yield (
                "handover_step",
                (
                    "marks the generating thread's calls, and a conversation's requests reach "
                    "the engine through the server's threads; set it null"
                ),
            )
        if self.dynamic_sampling:
            yield (
                "dynamic_sampling",
                (
                    "grpo_multiturn plays a fixed set of conversations per "
                    "episode and does not refill dropped groups; set it false"
                ),
            )
        if self.replay_buffer_size:
            yield (
                "replay_buffer_size",
                "grpo_multiturn's loop has no replay of stored groups; set it 0",
            )
        if self.agent is not None:
            problem = agent_runner.check_name(self.agent)
            if problem:
                yield "agent", problem
            if self.environment is not None:
                yield "agent", "an agent plays the episodes itself: remove environment, or agent"
            if self.agent_timeout_s <= 0:
                yield "agent_timeout_s", f"must be > 0, got {self.agent_timeout_s}"
        else:
            problem = environments.check_name(self.environment)
            if problem:
                yield "environment", problem
        if self.max_turns < 1:
            yield "max_turns", f"must be at least 1, got {self.max_turns}"
        if self.tool_call_parser is not None:  # an unknown name: before any engine starts
            from chatgen.serving.tool_calls import parser_names

            names = parser_names()
            if self.tool_call_parser not in names:
                close = did_you_mean(self.tool_call_parser, names)
                hint = f"did you mean {close!r}? " if close else ""
                yield (
                    "tool_call_parser",
                    f"{self.tool_call_parser!r} is no vLLM tool-call parser; {hint}vLLM's are "
                    f"{', '.join(sorted(names))}",
                )
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            yield (
                "max_episode_tokens",
                f"must be at least 1 (or null), got {self.max_episode_tokens}",
            )
        if not 0.0 <= self.step_discount <= 1.0:
            yield "step_discount", f"is a discount in [0, 1], got {self.step_discount}"


MODELS = {
    "policy": Role("generation", doc="serves the environments' chat requests (OpenAI HTTP)"),
    "policy_trainer": grpo.MODELS["policy_trainer"],
    "reference": grpo.MODELS["reference"],
}


def check(cfg):
    yield from grpo.check(cfg)
    try:
        plans = plan_groups(cfg)
    except ValueError:  # groups that do not fit together: the runtime's own error says so at start
        return
    for plan in plans:
        if "policy" in plan.names and plan.world > 1 and not engines_apart(cfg, plan.names):
            yield (
                f"runtime.colocation: the policy shares a group of {plan.world} ranks ({', '.join(plan.names)}); "
                "each of its servers needs an engine of one rank: tensor_parallel_size 1, and replicas "
                "(num_replicas) in a group without a trainer"
            )


def episode_tokens(episode: Episode, max_tokens: int | None = None):
    """(prompt, response, turn_of_token, logprobs, versions) of an episode: prompt = the first
    turn's prompt ids; response = every later token; turn_of_token = the model turn that generated
    each response token (-1 where the template or the environment wrote it); the server's
    log-probs (0 where not generated). max_tokens: the response cut there (max_episode_tokens)."""
    if not episode.turns:
        raise ValueError(
            "the episode has no turns; an environment's episode must call the policy at least once"
        )
    seen = list(episode.turns[0]["prompt_token_ids"])
    prompt_len = len(seen)
    response, owner, logprobs, versions = [], [], [], []
    for k, turn in enumerate(episode.turns):
        prompt, generated = list(turn["prompt_token_ids"]), list(turn["generation_token_ids"])
        if prompt[: len(seen)] != seen:
            raise ValueError(
                f"turn {k + 1}'s prompt does not begin with turn {k}'s prompt + generated ids, so the "
                "episode is not one token sequence; send each assistant message back to the server as "
                "it returned it (with prompt_token_ids and generation_token_ids)"
            )
        between = prompt[len(seen) :]  # template and environment tokens: not trained on
        response += between + generated
        owner += [-1] * len(between) + [k] * len(generated)
        logprobs += [0.0] * len(between) + list(turn["generation_log_probs"])
        versions += [-1] * len(between) + list(
            turn.get("generation_weight_versions") or [-1] * len(generated)
        )
        seen = prompt + generated
    cut = slice(None, max_tokens)  # tokens past the episode's budget: never trained on
    return seen[:prompt_len], response[cut], owner[cut], logprobs[cut], versions[cut]


def episode_sample(
    episode: Episode, prompt_index: int = 0, metadata: dict | None = None, max_tokens=None
) -> Sample:
    """One training Sample of an episode (episode_tokens): response_mask 1 on the tokens the model
    generated (every turn) and 0 on those the template or the environment wrote between them;
    finish_reason "length" when the episode was truncated (max_turns, max_episode_tokens, the
    environment), which `mask_truncated` masks and `response/truncated_fraction` counts."""
    prompt, response, owner, logprobs, versions = episode_tokens(episode, max_tokens)
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=logprobs,
        response_mask=[int(k >= 0) for k in owner],
        weight_versions=versions,
        prompt_index=prompt_index,
        text=episode.text,
        finish_reason="length" if episode.truncated else "stop",
        metadata=metadata or {},
    )


def dropped_sample(prompt_index: int, metadata: dict) -> Sample:
    """A dropped episode's row: one token, trained on nothing."""
    return Sample(
        prompt_ids=[0],
        response_ids=[0],
        response_logprobs=[0.0],
        response_mask=[0],
        weight_versions=[-1],
        prompt_index=prompt_index,
        metadata=metadata,
    )


def turn_extras(batch: RolloutBatch) -> dict:
    """What a per-turn advantage estimator (recipe/gigpo.py) sees beside the batch, from each
    sample's TURNS metadata (so it follows the rows through sorting, replay and the staleness
    bound): turn_index (S, L-1) long, the model turn of each response token at its loss position
    (-1 elsewhere); turn_rewards and turn_states, per sample a list per model turn."""
    import torch

    index = torch.full(batch.loss_mask.shape, -1, dtype=torch.long)
    rewards, states = [], []
    for row, meta in enumerate(batch.metadata):
        turns = meta.get(TURNS, {"owner": [], "rewards": [], "states": []})
        start = int(batch.prompt_lengths[row]) - 1  # response token k is predicted at p - 1 + k
        owner = turns["owner"]
        index[row, start : start + len(owner)] = torch.tensor(owner, dtype=torch.long)
        rewards.append(turns["rewards"])
        states.append(turns["states"])
    return {"turn_index": index, "turn_rewards": rewards, "turn_states": states}


def with_turns(record: dict, episode: Episode, max_tokens=None) -> dict:
    """The sample's metadata: the record and its episode's turns (TURNS, read by turn_extras)."""
    owner = episode_tokens(episode, max_tokens)[2]
    turns = {
        "owner": owner,
        "rewards": list(episode.turn_rewards) or [episode.reward],
        "states": list(episode.turn_states),
    }
    return {**record, TURNS: turns}


TURNS = "_turns"  # per-sample metadata key of turn_extras' inputs


def run_episodes(envs, records: list, n: int, temperature: float, max_tokens: int) -> list:
    """n episodes of every record, all at once (one thread each, so the servers batch their
    requests and no episode waits on another's slow tool); episode j of record i at index i * n + j.
    envs: the environment, or one per engine (replica): record i's n episodes play against the
    engine with the fewest sessions in flight when the call starts (counting the calls still
    playing: asynchronous batches overlap, and a batch's long tail holds one engine), every turn of
    a session on that engine (its prefix cache holds the chat)."""
    envs = envs if isinstance(envs, list) else [envs]
    with _PLAYING_LOCK:
        jobs = []
        for record in records:
            env = min(envs, key=lambda e: _PLAYING.get(id(e), 0))  # ties: the first
            _PLAYING[id(env)] = _PLAYING.get(id(env), 0) + n
            jobs += [(env, record)] * n

    def play(job):
        env, record = job
        try:
            return env.episode(record, temperature=temperature, max_tokens=max_tokens)
        finally:
            with _PLAYING_LOCK:
                _PLAYING[id(env)] -= 1
                if not _PLAYING[id(env)]:
                    del _PLAYING[id(env)]

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, len(jobs)), thread_name_prefix="episode"
    ) as pool:
        return list(pool.map(play, jobs))


_PLAYING, _PLAYING_LOCK = {}, threading.Lock()  # id(environment) -> its sessions in flight


def env_metrics(episodes: list, prefix: str) -> dict:
    """The mean of each of the episodes' own `metrics`, as `<prefix><key>` (over the episodes
    that report the key: a failed episode reports fewer)."""
    keys = dict.fromkeys(key for e in episodes for key in e.metrics)
    return {
        f"{prefix}{key}": sum(vals) / len(vals)
        for key in keys
        if (vals := [e.metrics[key] for e in episodes if key in e.metrics])
    }


PHASES = ["generate", "reference", "old_logprobs", "train", "sync", "checkpoint", "eval"]


def _serve(worker, name: str, api_key: str, tool_call_parser=None, gateway=False) -> str:
    """In the policy's actor: serve it over OpenAI HTTP on loopback for the run's life (closed
    with the worker); gateway: record agent sessions (chatgen.serving.gateway)."""
    from chatgen.serving.embedded import EmbeddedServer  # the server's stack, in the actor only

    server = EmbeddedServer(
        worker.models[name],
        api_key=api_key,
        model_name=name,
        tool_call_parser=tool_call_parser,
        gateway=gateway,
    )
    return worker.attach(name, "openai_server", server).url


def train(cfg, resume=False, log=print) -> dict:
    """Run multi-turn GRPO as configured; returns the last episode's metrics. resume: as
    grpo.train. The loop is GRPO's (grpo/loop.py: synchronous, or max_staleness k with weights
    pushed mid-conversation); what it generates is conversations."""
    import torch

    algo, pc = cfg.runtime.algorithm, cfg.models["policy"].config
    n = pc.n
    if algo.agent is None:  # a bad name: before the engines
        environments.factory(algo.environment, algo.environment_args)
    else:
        import_object(algo.agent, "function")
    env = None

    def evaluate(run) -> dict:  # every held-out record, one episode each, at the eval temperature
        episodes = run_episodes(env, run.eval_records, 1, pc.eval_temperature, pc.max_new_tokens)
        rewards = torch.tensor([e.reward for e in episodes])
        metrics = {"eval/reward": rewards.mean().item(), **env_metrics(episodes, "eval/env/")}
        if cfg.runtime.solved_reward is not None:
            metrics["eval/solved"] = (rewards >= cfg.runtime.solved_reward).float().mean().item()
        return metrics

    def play(run):
        nonlocal env
        api_key = secrets.token_urlsafe(16)  # only this run's environments can reach the policy
        gateway = algo.agent is not None
        # one server per engine (replica), one environment (or agent runner) per server
        urls = run.policy.run(_serve, "policy", api_key, algo.tool_call_parser, gateway)
        if gateway:
            env = [
                agent_runner.AgentRunner(algo.agent, url, api_key, algo.agent_timeout_s)
                for url in urls
            ]
            log(f"[chatgen] policy served at {', '.join(urls)} (agent gateway); agent {algo.agent}")
            return rollout_of(run, env, n, pc, algo.agent, algo.max_episode_tokens)
        env = [
            environments.build(
                algo.environment,
                algo.environment_args,
                url,
                api_key,
                "policy",
                max_turns=algo.max_turns,
                step_timeout_s=algo.step_timeout_s,
                parse=algo.tool_call_parser is not None,
                max_episode_tokens=algo.max_episode_tokens,
            )
            for url in urls
        ]
        log(f"[chatgen] policy served at {', '.join(urls)}; environment {algo.environment}")
        return rollout_of(run, env, n, pc, algo.environment, algo.max_episode_tokens)

    return grpo_loop.train(
        cfg, resume, log, PHASES, play=play, evaluate=evaluate, extras=turn_extras
    )


def rollout_of(run, env, n: int, pc, name: str, max_tokens=None):
    """The loop's rollout: n episodes of `env` per record, as a batch (responses cut at
    max_tokens: max_episode_tokens)."""

    def rollout(index):
        records = [run.records[i] for i in index]
        episodes = run_episodes(env, records, n, pc.temperature, pc.max_new_tokens)
        return episodes_batch(episodes, records, n, name, max_tokens)

    return rollout


def episodes_batch(episodes: list, records: list, n: int, name: str, max_tokens=None):
    """(RolloutBatch, (S,) rewards, metrics) of the episodes of `records` (n each, record-major).
    A group's episodes are ordered by their tokens, so that the batch does not depend on which
    thread finished first (seeded requests give a run that repeats exactly)."""
    import torch

    samples, rewards = [], []
    for g, record in enumerate(records):
        played = episodes[g * n : (g + 1) * n]
        group = [
            (episode_sample(e, g, with_turns(record, e, max_tokens), max_tokens), e.reward)
            for e in played
            if not e.dropped
        ]
        group.sort(key=lambda pair: (pair[0].prompt_ids, pair[0].response_ids))
        # a dropped episode: nothing to train on, and the group's mean reward (no signal of its
        # own; the others' advantages keep their signs)
        mean = sum(r for _, r in group) / len(group) if group else 0.0
        group += [(dropped_sample(g, record), mean) for e in played if e.dropped]
        samples += [s for s, _ in group]
        rewards += [r for _, r in group]
    rewards = torch.tensor(rewards, dtype=torch.float32)  # (S,)
    if not torch.isfinite(rewards).all():
        raise RunHealthError(
            f"{name} returned a NaN/inf reward; fix the environment so it returns a finite "
            "number for every episode"
        )
    metrics = {
        **env_metrics(episodes, "env/"),
        "response/turns": sum(len(e.turns) for e in episodes) / len(episodes),
        "env/dropped_episodes": float(sum(e.dropped for e in episodes)),
    }
    # right padding: masked everywhere
    return RolloutBatch.from_samples(samples, pad_token_id=0), rewards, metrics
