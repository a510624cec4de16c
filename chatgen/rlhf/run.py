"""What every RLHF episode loop shares: start a run, generate, score, call the trainers, sync,
checkpoint, evaluate, log. The loops themselves are chatgen/rlhf/algorithms/<name>.py, each top to
bottom.

    with Run(cfg, resume=False, phases=["generate", "reward", "train", "sync"], records_per_episode=32) as run:
        index = run.next_prompts()               # record indices of this episode
        batch = run.generate(index)              # a chatgen.core.rollout.RolloutBatch, S = len(index) x n
        rewards = run.score(batch)               # (S,) from the reward model
        old = run.forward_tokens("policy_trainer", batch.trainer_inputs())      # (S, L-1)
        stats = run.train("policy_trainer", {**batch.trainer_inputs(), "old_logprobs": old, ...}, loss_fn)
        run.sync_policy()                        # each trainer's weights into the model it syncs to
        run.end_episode(episode, metrics, start) # evaluate, checkpoint, log
    # leaving the block stops the actors and writes the plot (run.plot), however the loop ended

Nothing here assumes a particular algorithm or backend: which models exist and which syncs into
which comes from the algorithm's MODELS (chatgen.rlhf.schema.Role); a run without a generation
policy (offline DPO) never generates. A Run holds the pieces it is made of: the data
(chatgen.rlhf.data), the runtime's model groups (chatgen.rlhf.runtime), the weight links between
trainers and engines (chatgen.rlhf.weight_links), the health checks (chatgen.rlhf.health), the
checkpoints (chatgen.rlhf.checkpoint) and the metrics (chatgen.rlhf.metrics).
"""

import dataclasses
import time
from pathlib import Path

import torch
from tqdm import tqdm

from chatgen.config import ConfigError
from chatgen.config.loader import mask_secrets, show
from chatgen.core import quiet
from chatgen.core.metrics import reduce_metrics
from chatgen.core.process_tuning import HeapBound
from chatgen.core.rollout import RolloutBatch
from chatgen.core.tensors import select
from chatgen.module import startup_gc
from chatgen.rlhf import checkpoint as ckpt
from chatgen.rlhf import registry
from chatgen.rlhf.checks import backend_kind, check_run
from chatgen.rlhf.config import format_config, save_resolved, to_dict
from chatgen.rlhf.data import RunData
from chatgen.rlhf.health import StepHealth, checked_rewards
from chatgen.rlhf.metrics import (
    MetricsLogger,
    PhaseTimer,
    eval_metrics,
    read_jsonl_metrics,
    summary,
)
from chatgen.rlhf.runtime import Runtime
from chatgen.rlhf.schema import model_class
from chatgen.rlhf.trackers import start_trackers
from chatgen.rlhf.weight_links import WeightLinks


class Run:
    """One training run: config checked, outputs prepared, actors started, data loaded, resume
    applied.

    cfg: the loaded main config (its runtime.algorithm names the algorithm); records_per_episode: how many records of
    `runtime.data_path` an episode takes (e.g. sample_per_episode / n for GRPO); evaluate: the held-out
    evaluation, a function of the run returning metrics (default: `evaluate_policy`, the policy's reward on
    `eval_data_path`).

    Attributes: cfg, runtime (chatgen.rlhf.runtime.Runtime), policy (the `policy` model's handle, a
    chatgen.rlhf.generation_group.GenerationGroup, or None), data
    (RunData: records, eval_records, sampler), links (WeightLinks), timer (PhaseTimer), logger (MetricsLogger),
    start_episode.
    """

    def __init__(
        self,
        cfg,
        resume=False,
        phases: list = (),
        log=print,
        records_per_episode: int = None,
        evaluate=None,
    ):
        algorithm = registry.load(cfg.runtime.algorithm.name)
        check_run(cfg, algorithm)
        self.cfg, self.log, self.plot, self.started = cfg, log, None, time.perf_counter()
        rt = cfg.runtime
        self.out_dir = Path(rt.output_dir)
        self.save_dir = self.out_dir / "checkpoints"
        # everything that can refuse the inputs (the checkpoint, the data, a changed setting) before
        # the lock: a refused run writes nothing
        if resume:  # True: the latest checkpoint; a path or episode directory name: that one
            last = ckpt.resume_point(self.save_dir, None if resume is True else resume)
        elif ckpt.latest_checkpoint(self.save_dir) is not None:
            raise FileExistsError(
                f"{self.save_dir} holds checkpoints ({', '.join(ckpt.available(self.save_dir))}); "
                "pass --resume to continue from the latest, or choose another runtime.output_dir"
            )
        else:
            last = None
        self.data = RunData(rt, records_per_episode or rt.sample_per_episode)
        if last is not None:
            state = ckpt.load_state(last)
            self.data.check_order(state.get("data_order", {}), last, rt.allow_data_order_change)
            self._check_restored_keys(state.get("config"), last)
        self._lock = ckpt.lock_output_dir(self.out_dir)  # before anything is written into it
        try:
            self._start(algorithm, last, phases)
        except BaseException:
            self._lock.close()
            raise
        self._evaluate = evaluate or evaluate_policy
        # what `score` measured since the last log
        self.pending_metrics, self._evaluating = (
            {},
            False,
        )

    def _check_restored_keys(self, saved: dict | None, path: Path) -> None:
        """Refuse (ConfigError) a resume that changes a key whose effect the checkpoint carries
        (a trainer's optimizer, LR schedule, RNG, weights: its config's RESTORED_BY_CHECKPOINT):
        the resumed run would go on with the saved value. Every other key is read from this run's
        config, so a change applies (and resolved_config.yaml records it). `saved`: the config
        the checkpoint was written with (None: a checkpoint from before chatgen recorded it,
        nothing to compare)."""
        if saved is None:
            return
        problems = []
        for name, entry in self.cfg.models.items():
            before = ((saved.get("models") or {}).get(name) or {}).get("config") or {}
            for key in (
                getattr(entry.config, "RESTORED_BY_CHECKPOINT", ()) if entry.trainable else ()
            ):
                now = getattr(entry.config, key)
                now = dataclasses.asdict(now) if dataclasses.is_dataclass(now) else now  # a section
                # the checkpoint keeps its config masked: text read through ${VAR} reads `${VAR}`
                if key in before and before[key] not in (now, mask_secrets({key: now})[key]):
                    problems.append(
                        f"--resume from {path}: models.{name}.config.{key}: {before[key]!r} -> {now!r}: the "
                        f"checkpoint carries this setting (a trainer's weights, optimizer, LR schedule and RNG come "
                        f"from it), so the resumed run would keep {before[key]!r}; set it back to resume, or start a "
                        f"new run (another runtime.output_dir) from the checkpoint's weights: chatgen convert --to "
                        f"hf --input {path / name} --output DIR, then {name}.load=DIR"
                    )
        if problems:
            raise ConfigError(problems)

    def _start(self, algorithm, last, phases) -> None:
        cfg, rt = self.cfg, self.cfg.runtime
        self.health = StepHealth(rt.max_bad_train_steps, self.log)
        self.heap = HeapBound()  # this process's (every model's, with runtime.launcher: local)
        torch.manual_seed(rt.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        resolved = save_resolved(cfg, self.out_dir)
        if quiet.verbose():
            self.log(f"[chatgen] {rt.algorithm.name} config:\n{format_config(cfg)}")
        self.log(
            f"[chatgen] {rt.algorithm.name}: {rt.num_episode} episode{'s' * (rt.num_episode != 1)} into "
            f"{show(self.out_dir)} (config: {show(resolved)})"
        )

        # models, datasets (20k-odd token lists): built with collection paused, then frozen
        with startup_gc():
            self.runtime = Runtime.start(cfg, log=self.log)
            try:
                self.trainers = [n for n, entry in cfg.models.items() if entry.trainable]
                policy = cfg.models.get("policy")
                self.policy = (
                    self.runtime["policy"]
                    if policy is not None and backend_kind(policy.backend) == "generation"
                    else None
                )
                if self.policy is not None:
                    self.data.prepare(self.policy, rt.max_cut_prompt_fraction, self.log)
                # trainer -> the model its weights go to after each update (the algorithm's
                # Role.syncs_to)
                self.links = WeightLinks(
                    self.runtime,
                    {
                        m: role.syncs_to
                        for m, role in algorithm.MODELS.items()
                        if role.syncs_to and {m, role.syncs_to} <= set(cfg.models)
                    },
                )
                self.start_episode = 1
                if last is not None:
                    self._resume(last)
                trackers = start_trackers(cfg, self.out_dir, resume=last is not None)
                self.logger = MetricsLogger(
                    self.out_dir,
                    phases,
                    rt.num_episode,
                    self.start_episode,
                    "tensorboard" in rt.loggers,
                    trackers,
                )
                self.timer = PhaseTimer(on_start=self.logger.show_phase)
            except BaseException:
                self.runtime.shutdown()
                raise

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Close however the loop ended; a failure while closing never hides the error that ended
        the loop. A run that ended well prints its summary."""
        try:
            self.close()
        except Exception as close_error:  # noqa: BLE001
            if exc is None:
                raise
            self.log(
                f"[chatgen] (closing the run after the error below also failed: {type(close_error).__name__}: "
                f"{close_error})"
            )
        if exc is None:
            self.log(self.summary())
        return False

    def summary(self) -> str:
        """The end-of-run table (chatgen.rlhf.metrics.summary): the curve, time per phase, where
        the files are."""
        board = (
            f"  (tensorboard --logdir {show(self.out_dir / 'tensorboard')})"
            if self.logger.writer
            else ""
        )
        places = {"metrics": f"{show(self.logger.jsonl)}{board}"}
        if self.plot:
            places["plot"] = show(self.plot)
        saved = ckpt.available(self.save_dir)
        if saved:
            places["checkpoints"] = show(self.save_dir / saved[-1]) + (
                f" (and {len(saved) - 1} earlier)" if len(saved) > 1 else ""
            )
        last = self.cfg.runtime.num_episode
        done = last - self.start_episode + 1
        title = (
            f"[chatgen] {self.cfg.runtime.algorithm.name}: {done} episode{'s' * (done != 1)}"
            f"{f' ({self.start_episode}-{last}, resumed)' if self.start_episode > 1 else ''} done in "
            f"{tqdm.format_interval(time.perf_counter() - self.started)}"
        )
        return summary(read_jsonl_metrics(self.logger.jsonl), self.logger.phases, places, title)

    @property
    def records(self) -> list:
        return self.data.records

    @property
    def eval_records(self) -> list:
        return self.data.eval_records

    @property
    def sampler(self):
        return self.data.sampler

    # ---- data, generation, reward
    # ---------------------------------------------------------------------

    def next_prompts(self) -> list:
        """Indices (into `records`) of this episode's records: `records_per_episode` of them."""
        return self.data.sampler.next_batch()

    def generate(
        self, index: list, is_eval: bool = False, greedy: bool = False, logprobs: bool = True
    ):
        """The policy's samples for records `index` (of eval_records when is_eval; greedy: one
        greedy response each): a RolloutBatch whose `metadata` holds each sample's record (every
        column of its data row). logprobs=False: the caller reads none (the items say so, and a
        backend may then skip computing them: the batch's are zeros)."""
        data = self.data
        records, items = (
            (data.eval_records, data.eval_items) if is_eval else (data.records, data.items)
        )
        marks = {
            **({"greedy": True} if greedy else {}),
            **({} if logprobs else {"logprobs": False}),
        }
        items = [{**items[i], **marks} if marks else items[i] for i in index]
        self.links.wake()
        batch = self.policy.run_generation(items, is_eval)  # over its replicas, by load
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"policy.decode_internal returned a {type(batch).__name__}; chatgen's algorithms take a "
                "chatgen.core.rollout.RolloutBatch: return super().decode_internal(batched_outputs) "
                "(adjusted as needed) instead of a dict of your own (docs/migrating_from_chatlearn.md)"
            )
        batch.metadata = [records[index[k]] for k in batch.prompt_index.tolist()]
        self.links.release()  # colocated on GPUs: the engine's memory to the trainers
        return batch

    def score(self, batch, prefix: str | None = None) -> torch.Tensor:
        """(S,) rewards of a RolloutBatch's responses: the reward model's `score` gets {"texts":
        S texts, plus each field of the samples' records as a list of length S} and returns S
        numbers, or {"rewards": S numbers, "terms": {name: S numbers}, "metrics": {key: number}}
        (chatgen.rlhf.rewards:Rewards), whose term means and metrics the next log shows as
        reward/<name> (eval/reward/<name> when scored by `evaluate`; `prefix` instead of either
        when given, e.g. eval/greedy/reward/). With "weights": {name: weight} too, the batch
        keeps the terms and their weights (RolloutBatch.reward_terms, reward_weights)."""
        data = {key: [m.get(key) for m in batch.metadata] for key in batch.metadata[0]}
        data["texts"] = list(batch.texts)
        entry = self.cfg.models["reward"]
        out = self.runtime["reward"].first("score", data)
        who = f"models.reward ({model_class(entry)}).score"
        prefix = prefix or ("eval/reward/" if self._evaluating else "reward/")
        if isinstance(out, dict) and "rewards" in out:  # a weighted sum of terms, each logged
            terms = {
                name: checked_rewards(values, batch.texts, who)
                for name, values in out.get("terms", {}).items()
            }
            for name, values in terms.items():
                self.pending_metrics[f"{prefix}{name}"] = values.mean().item()
            if terms and "weights" in out:  # kept with the batch (GDPO normalises each term)
                batch.reward_terms, batch.reward_weights = terms, dict(out["weights"])
            self.pending_metrics.update(
                {f"{prefix}{k}": v for k, v in out.get("metrics", {}).items()}
            )
            out = out["rewards"]
        return checked_rewards(out, batch.texts, who)

    # ---- Megatron models (split over their DP ranks: ModelHandle.split_call)
    # -------------------------

    def forward_tokens(
        self, name: str, data: dict, base: bool = False, scored_only: bool = False
    ) -> torch.Tensor:
        """(S, L-1) per-token outputs of a Megatron model, no grad: log-probs for a policy or a
        reference, values for a critic. data: input_ids (S, L), attention_mask (S, L), loss_mask
        (S, L-1). base: of a LoRA trainer's base (adapters off). scored_only: the entries
        loss_mask marks, each prompt run once for its samples (MegatronModule.forward_tokens; an
        entry outside the mask may be 0): for log-probs that only masked sums read."""
        keys = (
            ("input_ids", "attention_mask", "loss_mask")
            if scored_only
            else ("input_ids", "attention_mask")
        )
        data = {k: data[k] for k in keys}
        model = self.runtime[name]
        return torch.cat((model.base_forward_tokens if base else model.forward_tokens)(data))

    def train(self, name: str, data: dict, loss_fn, group_size: int = 1, per_step: bool = False):
        """num_training_epoch passes over `data` (a dict of (S, ...) tensors, all of which travel
        to the trainer), in shuffled global batches of train_global_batch_size rows, one
        optimizer step each. Rows are shuffled in whole groups of `group_size` consecutive rows
        (e.g. 2 for DPO's chosen/rejected pairs), so a group never splits across steps. Returns
        the steps' metrics reduced by `reduce_metrics` (per_step: the list of each step's
        metrics, in order)."""
        self.links.before_training()  # release_during_training: the engine's memory to the trainer
        rt = self.cfg.runtime
        n = data["input_ids"].shape[0]
        if n % group_size or rt.train_global_batch_size % group_size:
            raise ValueError(
                f"{name}: {n} rows and train_global_batch_size={rt.train_global_batch_size} must be "
                f"multiples of the group size {group_size}"
            )
        steps = []
        for _ in range(rt.num_training_epoch):
            order = (
                torch.randperm(n // group_size)[:, None] * group_size + torch.arange(group_size)
            ).reshape(-1)
            for start in range(0, n, rt.train_global_batch_size):
                shard = select(data, order[start : start + rt.train_global_batch_size])
                steps.append(self.runtime[name].train_step(shard, loss_fn)[0])
                self.health.check(name, steps[-1])
        return steps if per_step else reduce_metrics(steps)

    def sync_policy(self, mode: str = "wait") -> None:
        """Each trainer's weights -> the model it syncs to (policy_trainer -> policy). The first
        sync of a run validates every tensor. mode: what the engine does with requests in flight
        (wait, keep, recompute, abort: GenerationModule.load_weights)."""
        self.links.sync(mode)

    # ---- checkpoint, resume, eval, log
    # ---------------------------------------------------------------

    def should(self, interval, episode: int) -> bool:
        return bool(interval) and (
            episode % interval == 0 or episode == self.cfg.runtime.num_episode
        )

    def save(self, episode: int, sampler_state: dict | None = None) -> Path:
        """Checkpoint every trainer and the driver state atomically (chatgen.rlhf.checkpoint)."""
        tmp = ckpt.begin_checkpoint(self.save_dir, episode)
        for name in self.trainers:
            self.runtime[name].save_checkpoint(str(tmp / name))
        # what a resume compares its config with (_check_restored_keys)
        state = {
            "episode": episode,
            "sampler": sampler_state or self.data.sampler.state_dict(),
            "data_order": self.data.order,
            "rng": ckpt.rng_state(),
            "actor_rng": self.runtime.rng_states(),
            "config": to_dict(self.cfg),
        }
        return ckpt.commit_checkpoint(tmp, state)

    def _resume(self, path: Path) -> None:
        state = ckpt.load_state(path)
        for name in self.trainers:
            self.runtime[name].load_checkpoint(str(path / name))
        self.data.sampler.load_state_dict(state["sampler"])
        self.start_episode = state["episode"] + 1
        if self.links.pairs:
            self.links.sync()
        # every process continues its random streams (vLLM's sampling included) where the checkpoint
        # left them
        ckpt.set_rng_state(state["rng"])
        self.runtime.set_rng_states(state["actor_rng"])
        self.log(
            f"[chatgen] resumed from {path} (episode {state['episode']}); next episode {self.start_episode}"
        )

    def evaluate(self) -> dict:
        self._evaluating = True  # the reward terms it scores are logged as eval/reward/<name>
        try:
            return self._evaluate(self)
        finally:
            self._evaluating = False

    def evaluate_start(self) -> None:
        """On a fresh run with evaluation on, log the held-out metrics before any training as
        episode 0."""
        if (
            self.start_episode == 1
            and self.data.eval_records
            and self.cfg.runtime.eval_episode_interval
        ):
            with self.timer("eval"):
                metrics = self.evaluate()
            self.timer.pop()
            self.logger.log(0, {**metrics, **self._generation_metrics(), **self.pending_metrics})
            self.pending_metrics = {}

    def _generation_metrics(self) -> dict:
        """What each replica of the policy generated since the last log (`replica/<i>/*`; {} for
        one replica)."""
        return self.policy.pop_metrics() if self.policy is not None else {}

    def end_episode(
        self, episode: int, metrics: dict, start: float, sampler_state: dict | None = None
    ) -> dict:
        """Every algorithm's episode tail: evaluate, checkpoint (after the evaluation, so that a
        resumed run continues every random stream exactly where this one is), add the phase
        times, log one line. sampler_state: the data position a checkpoint records when the loop
        already drew the next episode's prompts (`sampler.state_dict()` from before that draw);
        default: the sampler's current state."""
        rt, timer = self.cfg.runtime, self.timer
        if self.data.eval_records and self.should(rt.eval_episode_interval, episode):
            with timer("eval"):
                metrics.update(self.evaluate())
        if self.should(rt.save_episode_interval, episode):
            with timer("checkpoint"):
                self.save(episode, sampler_state)
        # phases + overhead
        metrics.update(timer.pop(), **{"time/episode": time.perf_counter() - start})
        for name in [
            n for n in self.trainers if backend_kind(self.cfg.models[n].backend) == "megatron"
        ][:1]:
            # memory/*: peaks of the trainer's process
            metrics.update(self.runtime[name].memory_stats())
        metrics.update(self._generation_metrics(), **self.pending_metrics)
        self.pending_metrics = {}
        self.logger.log(episode, metrics)
        self.health.check_mismatch(metrics)  # after the log: what stops a run is on record
        self.heap.check()
        return metrics

    def close(self) -> Path | None:
        """Stop the actors, close the logs, write the plot (`self.plot`, also returned); release
        the output dir."""
        try:
            self.runtime.shutdown()
            self.plot = self.logger.close()
        finally:
            self._lock.close()
        return self.plot


def evaluate_policy(run) -> dict:
    """eval_n responses to every held-out prompt with the policy's eval sampling keys (one when
    eval_temperature is 0), scored: eval/reward, eval/solved (share of samples with reward >=
    runtime.solved_reward), and with eval_n > 1 eval/mean@k and eval/pass@k
    (chatgen.rlhf.metrics.eval_metrics). runtime.eval_greedy adds the same figures of one greedy
    response per prompt as eval/greedy/*."""
    rt, index, metrics = run.cfg.runtime, list(range(len(run.eval_records))), {}
    for greedy, prefix in [(False, "eval"), (True, "eval/greedy")][: 1 + rt.eval_greedy]:
        # scored by their texts: no log-probs (vLLM's sampler, one gather a step, 256 lists)
        batch = run.generate(index, is_eval=True, greedy=greedy, logprobs=False)
        samples = len(batch) // len(index)
        rewards = run.score(batch, f"{prefix}/reward/")  # greedy terms apart from the sampled ones
        metrics.update(eval_metrics(rewards, samples, rt.solved_reward, prefix))
    return metrics
