"""GRPO's one episode loop, for every schedule: k = the number of weight versions generation may run
ahead of the trainer.

    k = 0   synchronous: generate, score, update, sync                       (no key)
    k = 1   one step off-policy: episode j+1 samples while j trains      (overlap_generation: true)
    k >= 1  fully asynchronous, with partial rollouts                   (max_staleness: k)

    runtime: {algorithm: {name: grpo, max_staleness: 2, importance_sampling_cap: 2.0}}
    chatgen train configs/grpo_tiny_async.yaml

overlap_generation is k = 1 with the weights handed over only once the engine is idle (sync mode
`wait`: no sample spans two versions, and the data position of a checkpoint is its own episode's
while the next batch generates); max_staleness hands them over with requests in flight (mode
`keep`), stamps every token's weight version and holds the bound on the samples themselves.

The asynchronous loop (max_staleness; docs/async_rl.md):
- Batches. Batch j is the j-th episode's prompts (sample_per_episode / n of them, drawn in order on
  the trainer's thread, so the data order is the synchronous run's). Its generation is submitted to
  the engine from a small thread pool as soon as the staleness bound admits it, and several batches
  generate at once (the engine batches their requests continuously).
- Admission (AReaL's max_head_offpolicyness): the trainer holding weight version v takes batch v -
  v0 next (v0: the version it started at), so batch j may start once the weights are at version >=
  v0 + j - k. Every token of it is then at most k versions older than the weights it trains against.
  k = 0 is the synchronous loop (generate, train, sync), k = 1 overlap_generation's schedule, k > 1
  fully asynchronous.
- Weights go to the engine after each episode's update in mode `keep`: requests in flight continue
  under the new weights (partial rollouts); their tokens carry the versions that sampled them.
- Handover (`handover_step: s`, k >= 2, in process): the batches submitted ahead of the episode
  being trained are marked (chatgen.generation.handover): after s engine steps under the weights of
  their submission, while nothing else generates, the engine waits for the next weights rather than
  finishing them under the old ones. When generation outpaces training, the engine would idle at the
  bound anyway; this moves the idle time into the batch, so its remaining tokens come from weights
  one version fresher and every sample longer than s tokens spans two versions: partial rollouts by
  construction, not by timing. The trainer's own batch is never marked (its update is what the
  others wait for).
- The bound is checked on the samples themselves (staleness.py): a group whose oldest token is more
  than k versions behind is dropped from the loss (`stale_samples: drop`) or generated again now
  (`regenerate`), and counted (async/stale_groups). Admission makes this a safety net, not a
  routine.
- Checkpoints: no batch is submitted past the next checkpoint's episode, so at a checkpoint nothing
  is in flight and the saved data position is exact: a resumed run neither replays nor loses a
  sample.
- Correction: the behaviour policy is the engine's per-token log-probs; with old_logprobs: recompute
  the proximal policy is the trainer's pass before the update, and importance_sampling_cap caps the
  weight between them (AReaL's decoupled PPO; step.rollout_correction).

Metrics: async/staleness_mean and async/staleness_max (over trained tokens),
async/samples_spanning_versions, async/buffer_fill (batches generated and waiting when the trainer
took its own, over k + 1), async/engine_idle_fraction and async/trainer_idle_fraction (of the
episode's wall time), async/stale_groups.

The engine takes the weights between two steps while requests run both in process
(runtime.launcher: local) and in Ray actors of its own (a policy of tensor_parallel_size 1 in a
group without a trainer: chatgen.rlhf.runtime.engines_apart, whose actors serve calls
concurrently; the handover mark travels with the call). A policy sharing actors with a trainer, or
of several ranks per engine, serves one call at a time: the sync waits for the batches already
submitted to it (no partial rollouts there), the bound still holds.
"""

import concurrent.futures
import threading
import time
from collections import deque

import torch

from chatgen.config import ConfigError
from chatgen.core.rollout import RolloutBatch
from chatgen.generation import handover
from chatgen.rlhf.algorithms.grpo import replay as rp
from chatgen.rlhf.algorithms.grpo import staleness as st
from chatgen.rlhf.algorithms.grpo.step import sample_full_groups, update
from chatgen.rlhf.placement import launcher, plan_groups
from chatgen.rlhf.run import Run
from chatgen.rlhf.runtime import engines_apart


def check_keys(algo):
    """(key, problem) pairs of the async keys of GRPO's Config."""
    k = algo.max_staleness
    if algo.handover_step is not None and algo.handover_step < 1:
        yield "handover_step", f"must be >= 1 or null, got {algo.handover_step}; 4 is usual"
    elif algo.handover_step is not None and (k or 0) < 2:
        yield (
            "handover_step",
            (
                f"holds the batches ahead of the trainer's next one until the next weights; with "
                f"max_staleness {k} there is none ahead of it: set max_staleness >= 2, or "
                "handover_step: null"
            ),
        )
    if k is None:
        return
    if k < 0:
        yield "max_staleness", f"must be >= 0 or null, got {k}; 0 = synchronous, 2 is usual"
    if k > 0 and algo.overlap_generation:
        yield (
            "max_staleness",
            "overlap_generation is max_staleness: 1; set overlap_generation: false",
        )
    if k > 0 and algo.dynamic_sampling:
        yield (
            "max_staleness",
            "dynamic_sampling refills a batch synchronously; set one of them off",
        )
    if k > 0 and algo.old_logprobs == "recompute" and algo.importance_sampling_cap is None:
        yield (
            "max_staleness",
            (
                f"{k} trains on samples up to {k} versions old, and recomputed old log-probs do "
                "not see it; set importance_sampling_cap (e.g. 2.0: decoupled PPO) or "
                "old_logprobs: rollout"
            ),
        )


def in_process(cfg) -> bool:
    """Whether the run's models live in the driver process (runtime.launcher: local, or auto
    resolving to it), where a generation call's handover mark reaches the engine."""
    try:
        return launcher(cfg, plan_groups(cfg)) == "local"
    except (ValueError, ConfigError):  # the layout's own problem, which other checks name
        return True


def check_run(cfg):
    """Run-level problems: a policy sharing GPUs with its trainer sleeps while the trainer
    trains."""
    if cfg.runtime.algorithm.max_staleness and "policy" in cfg.models:
        policy = cfg.models["policy"]
        shared = any(
            "policy" in group and "policy_trainer" in group for group in cfg.runtime.colocation
        )
        if shared and policy.num_gpu:
            yield (
                "runtime.algorithm.max_staleness: the policy shares its GPUs with policy_trainer "
                "(runtime.colocation), and sleeps while it trains: nothing generates ahead; give "
                "the policy devices of its own, or remove max_staleness"
            )
    if cfg.runtime.algorithm.handover_step is not None and not engine_steps_apart(cfg):
        yield (
            "runtime.algorithm.handover_step: the policy shares Ray actors with other models or "
            "spans several ranks per engine, where a batch cannot wait for the next weights "
            "mid-generation (such an actor serves one call at a time); give the policy a group of "
            "its own with tensor_parallel_size 1 (runtime.colocation), use runtime.launcher: local, "
            "or remove handover_step"
        )


def engine_steps_apart(cfg) -> bool:
    """Whether the policy's engine takes weights between its steps while calls run: in the driver
    (runtime.launcher: local), or in Ray actors apart (chatgen.rlhf.runtime.engines_apart)."""
    if in_process(cfg):
        return True
    return any("policy" in p.names and engines_apart(cfg, p.names) for p in plan_groups(cfg))


class Rollouts:
    """The batches in flight or waiting (see the module docstring): `fill` submits what the bound
    admits, `take` waits for the next one. Also counts the engine's and the trainer's idle time."""

    def __init__(self, run, k: int, rollout, handover_step: int | None = None):
        self.run, self.k, self.rollout, self.handover_step = run, k, rollout, handover_step
        self.pool = concurrent.futures.ThreadPoolExecutor(k + 1, thread_name_prefix="chatgen-async")
        # (episode, record indices, future of the RolloutBatch, data position before its draw), in
        # order
        self.queue = deque()
        self.next_episode = None
        self._lock = threading.Lock()
        self._running, self._idle_since, self.engine_idle = 0, time.perf_counter(), 0.0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        for _, _, future, _ in self.queue:
            future.cancel()
        # what runs ends with the engine's calls; after an error, with their failure when the run
        # stops the engine (a batch held for weights that will not come would wait for good)
        self.pool.shutdown(wait=exc_type is None)
        return False

    def fill(self, episode: int, limit: int, version: int) -> None:
        """Submit the batches of episodes up to min(episode + k, limit) not submitted yet;
        `version`: the engine's weight version now, which `episode`'s update moves on."""
        if self.next_episode is None:
            self.next_episode = episode
        while self.next_episode <= min(episode + self.k, limit):
            position = self.run.sampler.state_dict()
            index = self.run.next_prompts()
            # handover_step: a batch ahead of `episode`'s may wait for that update's weights; the
            # trainer's own batch never does (the update waits on it)
            hold = (self.handover_step, version) if self.next_episode > episode else (None,)
            future = self.pool.submit(self._generate, index, hold)
            self.queue.append((self.next_episode, index, future, position))
            self.next_episode += 1

    def take(self, episode: int):
        """(record indices, `rollout`'s (batch, rewards, metrics)) of `episode`, once generated;
        and how many batches were ready."""
        got, index, future, _ = self.queue.popleft()
        assert got == episode, f"rollout: expected episode {episode}'s batch, got {got}'s"
        ready = 1 + sum(entry[2].done() for entry in self.queue) if future.done() else 0
        return index, future.result(), ready

    def data_position(self) -> dict | None:
        """The data position a checkpoint records now: from before the first batch drawn ahead of
        the trainer (None: nothing is ahead, the sampler's own state is it)."""
        return self.queue[0][3] if self.queue else None

    def _generate(self, index, hold):
        with self._lock:
            if self._running == 0:
                self.engine_idle += time.perf_counter() - self._idle_since
            self._running += 1
        try:
            with handover.hold_after(*hold):
                return self.rollout(index)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._idle_since = time.perf_counter()

    def pop_engine_idle(self) -> float:
        """Seconds without a batch in flight since the last call."""
        with self._lock:
            now, idle = time.perf_counter(), self.engine_idle
            if self._running == 0:
                idle += now - self._idle_since
                self._idle_since = now
            self.engine_idle = 0.0
            return idle


def next_checkpoint(run, episode: int) -> int:
    """The first episode >= `episode` that saves a checkpoint (num_episode when none does)."""
    last = run.cfg.runtime.num_episode
    return next(
        (
            e
            for e in range(episode, last + 1)
            if run.should(run.cfg.runtime.save_episode_interval, e)
        ),
        last,
    )


def enforce_bound(run, rollout, index, batch, rewards, current: int, n: int):
    """The groups whose oldest token is more than k versions behind `current`: dropped from the
    loss (stale_samples: drop) or generated again now with `rollout` (regenerate). Returns (batch,
    rewards, loss_keep or None, metrics)."""
    algo = run.cfg.runtime.algorithm
    stale = st.sample_staleness(batch.weight_versions, current)
    if (stale < 0).any():
        raise RuntimeError(
            f"async rollout: a token newer than the trainer's weights (version {current}): the "
            "weight versions are out of step (a chatgen bug)"
        )
    over = st.groups_over(stale, n, algo.max_staleness)
    metrics = {"async/stale_groups": int(over.sum())}
    if not over.any():
        return batch, rewards, None, metrics
    if algo.stale_samples == "drop":
        return batch, rewards, (~over).repeat_interleave(n).float(), metrics
    redo = [index[g] for g in over.nonzero().flatten().tolist()]
    with run.timer("generate"):
        fresh, fresh_rewards, _ = rollout(redo)
    if fresh_rewards is None:
        with run.timer("reward"):
            fresh_rewards = run.score(fresh)
    parts, scores, redone = [], [], iter(range(len(redo)))
    for g, is_over in enumerate(over.tolist()):  # the batch's group order, stale groups replaced
        source, score, at = (fresh, fresh_rewards, next(redone)) if is_over else (batch, rewards, g)
        rows = torch.arange(at * n, (at + 1) * n)
        parts.append(source.select(rows))
        scores.append(score[rows])
    out = RolloutBatch.concat(parts, run.cfg.models["policy"].config.pad_token_id or 0)
    out.prompt_index = torch.arange(len(over)).repeat_interleave(n)
    return out, torch.cat(scores), None, metrics


def schedule(algo) -> tuple:
    """(k, asynchronous): how many versions generation runs ahead, and whether weights reach the
    engine with requests in flight (max_staleness) or once it is idle (sync, overlap_generation)."""
    if algo.max_staleness is not None:
        return algo.max_staleness, True
    return int(algo.overlap_generation), False


def generated(run):
    """Single-turn GRPO's rollout: the policy's batch for the record indices, scored later on the
    trainer's thread (rewards None)."""
    return lambda index: (run.generate(index), None, {})


def train(cfg, resume, log, phases: list, play=generated, evaluate=None, extras=None) -> dict:
    """GRPO's episodes, k versions ahead (the module docstring). Returns the last episode's
    metrics. play(run) -> rollout, made once the run's models are up: rollout(record indices) ->
    (RolloutBatch, (S,) rewards or None to score it with run.score, metrics to log); multi-turn
    GRPO's plays conversations (grpo_multiturn.py). evaluate: Run's held-out evaluation (None:
    the policy's own). extras(batch) -> dict: more for the advantage estimator to see (the
    turns of multi-turn GRPO's conversations, for recipe/gigpo.py)."""
    rt, algo = cfg.runtime, cfg.runtime.algorithm
    n = cfg.models["policy"].config.n
    k, asynchronous = schedule(algo)
    mode = "keep" if asynchronous else "wait"  # keep: requests in flight go on under new weights
    with (
        Run(
            cfg,
            resume,
            phases,
            log,
            records_per_episode=rt.sample_per_episode // n,
            evaluate=evaluate,
        ) as run,
        Rollouts(run, k, rollout := play(run), algo.handover_step) as rollouts,
    ):
        timer, metrics = run.timer, {}
        buffer = rp.ReplayBuffer(algo.replay_buffer_size, algo.replay_max_age)
        run.evaluate_start()
        current = run.policy.weight_versions()[0] if asynchronous else None
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            # asynchronous: nothing in flight at a checkpoint (its resume is exact)
            limit = next_checkpoint(run, episode) if asynchronous else rt.num_episode
            rollouts.fill(episode, limit, current)
            waited = time.perf_counter()
            with timer("generate"):  # what the trainer waits for: its idle time
                index, (batch, rewards, played), ready = rollouts.take(episode)
            waited = time.perf_counter() - waited
            if rewards is None:
                with timer("reward"):
                    rewards = run.score(batch)  # (S,)
            extra, replayed = {}, {}
            if algo.dynamic_sampling:  # k = 0: groups with no gradient out, fresh ones in
                batch, rewards, extra = sample_full_groups(run, batch, rewards, n)
            if algo.replay_buffer_size:  # groups with no gradient out, stored varied ones in
                batch, rewards, replayed = rp.refill(buffer, cfg, batch, rewards, n, episode)
            if asynchronous:  # after the replay: the bound holds for replayed groups too
                batch, rewards, extra = bounded(run, rollout, index, batch, rewards, current, n)
            metrics = update(
                run,
                batch,
                rewards,
                n,
                sync=False,
                current_version=current if k else None,
                extras=extras(batch) if extras else None,
            )
            metrics.update(played)
            metrics.update(extra)
            metrics.update(replayed)
            with timer("sync"):  # wait: the batch generating ahead (k = 1) finishes first
                run.sync_policy(mode=mode)
            if asynchronous:
                current = run.policy.weight_versions()[0]
                elapsed = time.perf_counter() - start
                metrics.update(
                    {
                        "async/buffer_fill": ready / (k + 1),
                        "async/trainer_idle_fraction": waited / elapsed,
                        "async/engine_idle_fraction": min(
                            1.0, rollouts.pop_engine_idle() / elapsed
                        ),
                    }
                )
            run.end_episode(episode, metrics, start, rollouts.data_position())
    return metrics


def bounded(run, rollout, index, batch, rewards, current: int, n: int):
    """The staleness bound on a batch of an asynchronous run: (batch, rewards, metrics) with the
    groups past it dropped from the loss or regenerated (enforce_bound) and the staleness
    observed."""
    if batch.weight_versions is None:
        raise RuntimeError(
            "runtime.algorithm.max_staleness: the policy's batches carry no per-token "
            "weight_versions (RolloutBatch.weight_versions); use the vllm backend, or "
            "a decode_internal that keeps them"
        )
    batch, rewards, keep, metrics = enforce_bound(run, rollout, index, batch, rewards, current, n)
    if keep is not None:
        batch.loss_mask = batch.loss_mask * keep.unsqueeze(1)
    metrics.update(st.staleness_metrics(batch.weight_versions, batch.loss_mask, current))
    return batch, rewards, metrics
