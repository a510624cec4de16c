"""What every RLHF episode loop shares: start a run, load the data, generate, score, call the trainers, sync,
checkpoint, evaluate, log. The loops themselves are chatgen/rlhf/algorithms/<name>.py, each top to bottom.

    with Run(cfg, resume=False, phases=["generate", "reward", "train", "sync"], records_per_episode=32) as run:
        index = run.next_prompts()               # record indices of this episode
        batch = run.generate(index)              # a chatgen.rollout.RolloutBatch, S = len(index) x n, prompt-major
        rewards = run.score(batch)               # (S,) from the reward model
        old = run.forward_tokens("policy_trainer", batch.trainer_inputs())      # (S, L-1)
        stats = run.train("policy_trainer", {**batch.trainer_inputs(), "old_logprobs": old, ...}, loss_fn)
        run.sync_policy()                        # each trainer's weights into the model it syncs to
        run.end_episode(episode, metrics, start) # evaluate, checkpoint, log
    # leaving the block stops the actors and writes the plot (run.plot), however the loop ended

Nothing here assumes a particular algorithm: which models exist and which syncs into which comes from the
algorithm's MODELS (chatgen.config.Role); a run without a vLLM policy (offline DPO) never generates.

Health: the run stops with a `RunHealthError` (the message says why and what to change) when more than
runtime.max_cut_prompt_fraction of the training prompts were cut to the prompt budget, when a reward is NaN,
and after runtime.max_bad_train_steps optimizer steps in a row with a zero or non-finite gradient norm.
"""
import math
import time
from pathlib import Path

import torch

from chatgen.config import ConfigError, format_config, save_resolved
from chatgen.module import startup_gc
from chatgen.rlhf import checkpoint as ckpt
from chatgen.rlhf.losses import reduce_metrics
from chatgen.rlhf.metrics import MetricsLogger, PhaseTimer
from chatgen.rlhf.runtime import call_model
from chatgen.rlhf.tasks import read_jsonl
from chatgen.rollout import RolloutBatch


class RunHealthError(RuntimeError):
    """The run is training on nonsense (cut prompts, NaN rewards, collapsed or diverged gradients)."""


def check_config(cfg, algorithm) -> None:
    """Problems a schema cannot see (which models the algorithm needs, how they fit together), all at once,
    before any actor starts. `algorithm` is the algorithm's module (chatgen.rlhf.algorithms.load). Raises
    ConfigError."""
    name, where = cfg.runtime.algorithm.name, cfg.path or "config"
    errors = []
    for model, role in algorithm.MODELS.items():
        entry = cfg.models.get(model)
        if entry is None:
            if not role.optional:
                errors.append(f"{where}: models.{model}: {name} needs a `{model}` model (backend: {role.backend}"
                              f"{', trainable: true' if role.trainable else ''}){': ' + role.doc if role.doc else ''}; "
                              "add it")
            continue
        if entry.backend != role.backend:
            errors.append(f"{where}: models.{model}.backend: {name} needs backend {role.backend}, got {entry.backend}")
        if role.trainable is not None and entry.trainable != role.trainable:
            what = "the model being trained" if role.trainable else "frozen"
            errors.append(f"{where}: models.{model}.trainable: must be {str(role.trainable).lower()} ({what})")
    errors += [f"{where}: {problem}" for problem in getattr(algorithm, "check", lambda cfg: ())(cfg)]
    rt = cfg.runtime
    rows = trainer_rows(cfg, algorithm)  # per episode
    rows_are = f"runtime.sample_per_episode: {rows}" if rows == rt.sample_per_episode else \
        f"runtime.sample_per_episode: {rt.sample_per_episode} gives {rows} trainer rows per episode ({name}), which"
    gbs = rt.train_global_batch_size or rows
    if rows % gbs:
        errors.append(f"{where}: {rows_are} is not a multiple of runtime.train_global_batch_size={gbs}; make it one "
                      "so every episode is whole optimizer steps")
    for model, entry in cfg.models.items():  # each DP rank gets 1/DP of a batch, in whole micro-batches
        if entry.backend != "megatron" or entry.config is None:
            continue
        mc = entry.config
        model_parallel = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
        world = entry.num_gpu or model_parallel * mc.expert_model_parallel_size  # as runtime.plan_groups places it
        if world % model_parallel:
            continue  # init_distributed names this one
        dp, micro = world // model_parallel, mc.micro_batch_size or rt.train_micro_batch_size
        how = (f"models.{model} has DP = {world} ranks / (TP {mc.tensor_model_parallel_size} x PP "
               f"{mc.pipeline_model_parallel_size}) = {dp} and micro batch {micro}")
        if entry.trainable and gbs % (micro * dp):
            errors.append(f"{where}: runtime.train_global_batch_size: {gbs} does not split into whole micro-batches "
                          f"on every data-parallel rank ({how}); make it a multiple of {micro * dp}")
        elif rows % (micro * dp):
            errors.append(f"{where}: {rows_are} does not split into whole micro-batches on every data-parallel rank "
                          f"({how}); make it a multiple of {micro * dp}")
    if not rt.data_path:
        errors.append(f"{where}: runtime.data_path: required (a JSONL file of records, e.g. {{\"prompt\": ..., "
                      "\"answer\": ...}})")
    elif not Path(rt.data_path).is_file():
        errors.append(f"{where}: runtime.data_path: {rt.data_path} does not exist; create it (for the tiny task: "
                      "python -m chatgen.rlhf.tasks --output DIR) or fix the path")
    if rt.eval_data_path and not Path(rt.eval_data_path).is_file():
        errors.append(f"{where}: runtime.eval_data_path: {rt.eval_data_path} does not exist; fix the path")
    if rt.eval_episode_interval and not rt.eval_data_path:
        errors.append(f"{where}: runtime.eval_episode_interval: set, but runtime.eval_data_path is not; set both")
    if errors:
        raise ConfigError(errors)


def trainer_rows(cfg, algorithm) -> int:
    """Rows each trainer call of an episode gets: the algorithm's `trainer_rows(cfg)` where it defines one (e.g.
    Online DPO trains on one pair per prompt), else sample_per_episode (one row per sample)."""
    return algorithm.trainer_rows(cfg) if hasattr(algorithm, "trainer_rows") else cfg.runtime.sample_per_episode


def policy_sampling_problems(cfg):
    """For policy-gradient algorithms: the policy must sample from the distribution the trainer scores."""
    pc = cfg.models["policy"].config if "policy" in cfg.models else None
    if pc is not None and (pc.temperature != 1.0 or pc.top_p != 1.0 or pc.top_k not in (-1, 0) or pc.min_p != 0.0
                           or pc.repetition_penalty != 1.0):
        yield (f"models.policy: sample with temperature 1.0, top_p 1.0, top_k -1, min_p 0, repetition_penalty 1.0 "
               f"(got {pc.temperature}, {pc.top_p}, {pc.top_k}, {pc.min_p}, {pc.repetition_penalty}): the trainer scores tokens under the untempered distribution, so "
               "other settings would make every update off-policy")
    for name, entry in cfg.models.items():  # the experts a trainer replays are the ones the engine recorded
        if getattr(entry.config, "moe_routing_replay", False) and pc is not None and not pc.return_routed_experts:
            yield (f"models.{name}.moe_routing_replay: true replays the experts the policy routed each token to; set "
                   "models.policy.return_routed_experts: true (or moe_routing_replay: false)")
    if pc is not None and cfg.runtime.sample_per_episode % pc.n:
        yield (f"runtime.sample_per_episode: {cfg.runtime.sample_per_episode} is not a multiple of policy n={pc.n} "
               "(samples per prompt); make it one")


def select(data: dict, index: torch.Tensor) -> dict:
    """Rows `index` of every per-sample tensor of a batch dict."""
    n = data["input_ids"].shape[0]
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in data.items()}


# Functions run inside the actors (ModelWorker.run): module level, so Ray pickles them by reference.

def _sync_colocated(models, trainer, policy, validate):
    from chatgen.param_sync import sync_weights

    sync_weights(models[trainer], models[policy], validate=validate)


def _open_receiver(models, policy, multi_node):
    from chatgen.param_sync import SyncReceiver
    from chatgen.rlhf.runtime import rendezvous_host

    models[policy]._chatgen_receiver = SyncReceiver(host=rendezvous_host(multi_node))
    return models[policy]._chatgen_receiver.host, models[policy]._chatgen_receiver.port


def _receive(models, policy):
    models[policy]._chatgen_receiver.receive_into(models[policy])


def _connect_sender(models, trainer, host, port):
    from chatgen.param_sync import SyncSender

    models[trainer]._chatgen_sender = SyncSender(host, port)


def _send(models, trainer, validate):
    from chatgen.param_sync import sync_weights

    sync_weights(models[trainer], models[trainer]._chatgen_sender, validate=validate)


class Run:
    """One training run: config checked, outputs prepared, actors started, data loaded, resume applied.

    cfg: the loaded main config (its runtime.algorithm names the algorithm); records_per_episode: how many records of
    `runtime.data_path` an episode takes (e.g. sample_per_episode / n for GRPO); evaluate: the held-out
    evaluation, a function of the run returning metrics (default: `evaluate_policy`, the policy's reward on
    `eval_data_path`).

    Attributes: cfg, runtime (chatgen.rlhf.runtime.Runtime), policy (the `policy` model's handle, or None),
    records / eval_records (JSONL dicts), sampler (PromptSampler), timer (PhaseTimer), logger (MetricsLogger),
    start_episode.
    """

    def __init__(self, cfg, resume=False, phases: list = (), log=print, records_per_episode: int = None,
                 evaluate=None):
        from chatgen.rlhf import algorithms

        algorithm = algorithms.load(cfg.runtime.algorithm.name)
        check_config(cfg, algorithm)
        self.cfg, self.log = cfg, log
        self.out_dir = Path(cfg.runtime.output_dir)
        self.save_dir = self.out_dir / "checkpoints"
        self._lock = ckpt.lock_output_dir(self.out_dir)  # before anything is written into it
        try:
            self._start(cfg, algorithm, resume, phases, log, records_per_episode, evaluate)
        except BaseException:
            self._lock.close()
            raise
        self.plot = None

    def _start(self, cfg, algorithm, resume, phases, log, records_per_episode, evaluate) -> None:
        from chatgen.rlhf.runtime import Runtime

        rt = cfg.runtime
        if resume:  # True: the latest checkpoint; a path or episode directory name: that one
            last = ckpt.resume_point(self.save_dir, None if resume is True else resume)
        elif ckpt.latest_checkpoint(self.save_dir) is not None:
            raise FileExistsError(f"{self.save_dir} holds checkpoints ({', '.join(ckpt.available(self.save_dir))}); "
                                  "pass --resume to continue from the latest, or choose another runtime.output_dir")
        else:
            last = None
        self.records = read_jsonl(rt.data_path)
        self.eval_records = read_jsonl(rt.eval_data_path) if rt.eval_data_path else []
        per_episode = records_per_episode or rt.sample_per_episode
        self.sampler = ckpt.PromptSampler(len(self.records), per_episode, rt.seed)
        # what the order of the training data depends on: a resume with other values is refused (see _resume)
        self.data_order = {"seed": rt.seed, "records_per_episode": per_episode, "records": len(self.records),
                           "data_sha256": ckpt.file_digest(rt.data_path)}
        if last is not None:
            self._check_data_order(last)
        self._bad_steps = {}
        self._evaluate = evaluate or Run.evaluate_policy
        # trainer -> the model its weights go to after each update (the algorithm's Role.syncs_to)
        self.sync_pairs = {m: role.syncs_to for m, role in algorithm.MODELS.items()
                           if role.syncs_to and m in cfg.models and role.syncs_to in cfg.models}
        torch.manual_seed(rt.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, self.out_dir)
        log(f"[chatgen] {rt.algorithm.name} config:\n{format_config(cfg)}")

        with startup_gc():  # models, datasets (20k-odd token lists): built with collection paused, then frozen
            self.runtime = Runtime.start(cfg, log=log)
            try:
                self.trainers = [n for n, entry in cfg.models.items() if entry.trainable]
                self.policy = self.runtime["policy"] if cfg.models.get("policy", None) is not None \
                    and cfg.models["policy"].backend == "vllm" else None
                if self.policy is not None:
                    self.items = self.policy.first("prepare_dataset", [r["prompt"] for r in self.records])
                    self.eval_items = self.policy.first("prepare_dataset", [r["prompt"] for r in self.eval_records],
                                                       True)
                    self._check_cut_prompts()
                self._setup_sync()
                self.start_episode = 1
                if last is not None:
                    self._resume(last)
                self.timer = PhaseTimer()
                self.logger = MetricsLogger(self.out_dir, phases, rt.num_episode, self.start_episode)
            except BaseException:
                self.runtime.shutdown()
                raise

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Close however the loop ended; a failure while closing never hides the error that ended the loop."""
        try:
            self.close()
        except Exception as close_error:  # noqa: BLE001
            if exc is None:
                raise
            self.log(f"[chatgen] (closing the run after the error below also failed: {type(close_error).__name__}: "
                     f"{close_error})")
        return False

    def _check_cut_prompts(self) -> None:
        cut = sum(1 for item in self.items if item.get("prompt_cut"))
        limit = self.cfg.runtime.max_cut_prompt_fraction
        if cut and cut / len(self.items) > limit:
            raise RunHealthError(
                f"{cut} of {len(self.items)} training prompts ({cut / len(self.items):.0%}) are longer than the prompt "
                f"budget seq_length - max_new_tokens and were cut, more than runtime.max_cut_prompt_fraction={limit}: "
                "the policy would learn from truncated prompts; raise models.policy seq_length, lower max_new_tokens, "
                "or shorten the prompts")
        if cut:
            self.log(f"[chatgen] WARNING: {cut} of {len(self.items)} training prompts were cut to the prompt budget")
    # ---- data, generation, reward ---------------------------------------------------------------------

    def next_prompts(self) -> list:
        """Indices (into `records`) of this episode's records: `records_per_episode` of them."""
        return self.sampler.next_batch()

    def generate(self, index: list, is_eval: bool = False):
        """The policy's samples for records `index` (of eval_records when is_eval): a RolloutBatch whose
        `metadata` holds each sample's record."""
        records, items = (self.eval_records, self.eval_items) if is_eval else (self.records, self.items)
        self._wake_policy()
        batch = self.policy.first("run_generation", [items[i] for i in index], is_eval)
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"policy.decode_internal returned a {type(batch).__name__}; chatgen's algorithms take a "
                            "chatgen.rollout.RolloutBatch: return super().decode_internal(batched_outputs) (adjusted "
                            "as needed) instead of a dict of your own (docs/migrating_from_chatlearn.md)")
        batch.metadata = [records[index[k]] for k in batch.prompt_index.tolist()]
        if self._policy_sleeps:  # colocated on GPUs: free the engine's memory for the trainers
            self.policy.call("sleep")
            self._asleep = True
        return batch

    def score(self, batch) -> torch.Tensor:
        """(S,) rewards of a RolloutBatch's responses: the reward model's `score` gets {"texts": S texts, plus each
        field of the samples' records as a list of length S}."""
        data = {key: [m.get(key) for m in batch.metadata] for key in batch.metadata[0]}
        data["texts"] = list(batch.texts)
        rewards = torch.as_tensor(self.runtime["reward"].first("score", data), dtype=torch.float32)
        if rewards.shape != (len(batch),):
            raise ValueError(f"reward.score returned shape {tuple(rewards.shape)}; it must return one float per "
                             f"response, shape ({len(batch)},)")
        if not torch.isfinite(rewards).all():
            bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
            raise RunHealthError(f"reward.score returned NaN/inf for samples {bad[:10]} (e.g. response "
                                 f"{batch.texts[bad[0]]!r}); fix the reward so it returns a finite number for every "
                                 "response")
        return rewards

    # ---- Megatron models (data parallel over their DP ranks) ------------------------------------------

    def _split_call(self, name: str, method: str, data: dict, *args) -> list:
        """`method(shard, *args)` on every rank, the batch's rows split over the model's DP ranks; returns
        one result per DP rank, in DP order."""
        handle = self.runtime[name]
        dp = max(handle.dp_ranks) + 1
        n = data["input_ids"].shape[0]
        if n % dp:
            raise ValueError(f"{name}: a batch of {n} samples does not split over {dp} data-parallel ranks")
        shards = [select(data, torch.arange(d * n // dp, (d + 1) * n // dp)) for d in range(dp)]
        results = handle.get(handle.group.run_each(call_model, [(name, method, shards[d], *args)
                                                                 for d in handle.dp_ranks]), method)
        first = {}
        for d, result in zip(handle.dp_ranks, results):
            first.setdefault(d, result)
        return [first[d] for d in range(dp)]

    def forward_tokens(self, name: str, data: dict) -> torch.Tensor:
        """(S, L-1) per-token outputs of a Megatron model, no grad: log-probs for a policy or a reference, values
        for a critic. data: input_ids (S, L), attention_mask (S, L)."""
        data = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
        return torch.cat(self._split_call(name, "forward_tokens", data))

    def train(self, name: str, data: dict, loss_fn, group_size: int = 1, per_step: bool = False):
        """num_training_epoch passes over `data` (a dict of (S, ...) tensors, all of which travel to the trainer),
        in shuffled global batches of train_global_batch_size rows, one optimizer step each. Rows are shuffled in
        whole groups of `group_size` consecutive rows (e.g. 2 for DPO's chosen/rejected pairs), so a group
        never splits across steps. Returns the steps' metrics reduced by `reduce_metrics` (per_step: the list of
        each step's metrics, in order)."""
        rt = self.cfg.runtime
        n = data["input_ids"].shape[0]
        if n % group_size or rt.train_global_batch_size % group_size:
            raise ValueError(f"{name}: {n} rows and train_global_batch_size={rt.train_global_batch_size} must be "
                             f"multiples of the group size {group_size}")
        steps = []
        for _ in range(rt.num_training_epoch):
            order = (torch.randperm(n // group_size)[:, None] * group_size + torch.arange(group_size)).reshape(-1)
            for start in range(0, n, rt.train_global_batch_size):
                shard = select(data, order[start:start + rt.train_global_batch_size])
                steps.append(self._split_call(name, "train_step", shard, loss_fn)[0])
                self._check_step(name, steps[-1])
        return steps if per_step else reduce_metrics(steps)

    def _check_step(self, name: str, step: dict) -> None:
        """Count optimizer steps in a row whose gradient norm is zero (nothing learns) or not finite (skipped)."""
        bad = step.get("skipped_step", 0.0) > 0 or not math.isfinite(step["grad_norm"]) or step["grad_norm"] == 0
        self._bad_steps[name] = self._bad_steps.get(name, 0) + 1 if bad else 0
        if not bad:
            return
        what = ", ".join(f"{k}={v:.4g}" for k, v in step.items())
        limit = self.cfg.runtime.max_bad_train_steps
        if self._bad_steps[name] >= limit:
            raise RunHealthError(f"{name}: {self._bad_steps[name]} optimizer steps in a row with a zero or non-finite "
                                 f"gradient norm (last: {what}), runtime.max_bad_train_steps={limit}: training has "
                                 f"collapsed or diverged; lower models.{name} lr or check the loss and the data")
        self.log(f"[chatgen] WARNING: {name} step with a zero or non-finite gradient norm ({what})")

    # ---- weight sync ---------------------------------------------------------------------------------

    def _setup_sync(self) -> None:
        self._colocated, self._syncs, self._asleep = {}, 0, False
        self._policy_sleeps = False
        for trainer_name, target_name in self.sync_pairs.items():
            trainer, target = self.runtime[trainer_name], self.runtime[target_name]
            colocated = self._colocated[trainer_name] = trainer.group is target.group
            if colocated:
                self._policy_sleeps = self._policy_sleeps or target.entry.num_gpu > 0  # CPU: sleep frees nothing
                continue
            host, port = target.get(target.group.run_async(_open_receiver, target.name, target.group.multi_node),
                                    "open sync")[0]
            trainer.get(trainer.group.run_async(_connect_sender, trainer.name, host, port), "connect sync")

    def _wake_policy(self) -> None:
        if self._asleep:
            self.policy.call("wake_up")
            self._asleep = False

    def sync_policy(self) -> None:
        """Each trainer's weights -> the model it syncs to (policy_trainer -> policy). The first sync of a run
        validates every tensor."""
        validate = self._syncs == 0
        self._wake_policy()
        for trainer_name, target_name in self.sync_pairs.items():
            trainer, target = self.runtime[trainer_name], self.runtime[target_name]
            if self._colocated[trainer_name]:
                trainer.get(trainer.group.run_async(_sync_colocated, trainer.name, target.name, validate), "sync")
            else:
                refs = target.group.run_async(_receive, target.name) + \
                    trainer.group.run_async(_send, trainer.name, validate)
                trainer.get(refs, "sync")
        self._syncs += 1

    # ---- checkpoint, resume, eval, log ---------------------------------------------------------------

    def should(self, interval, episode: int) -> bool:
        return bool(interval) and (episode % interval == 0 or episode == self.cfg.runtime.num_episode)

    def save(self, episode: int, sampler_state: dict | None = None) -> Path:
        """Checkpoint every trainer and the driver state atomically (chatgen.rlhf.checkpoint)."""
        tmp = ckpt.begin_checkpoint(self.save_dir, episode)
        for name in self.trainers:
            self.runtime[name].call("save_checkpoint", str(tmp / name))
        state = {"episode": episode, "sampler": sampler_state or self.sampler.state_dict(),
                 "data_order": self.data_order,
                 "rng": ckpt.rng_state(), "actor_rng": self.runtime.rng_states()}
        return ckpt.commit_checkpoint(tmp, state)

    def _check_data_order(self, path: Path) -> None:
        saved = ckpt.load_state(path).get("data_order", {})
        changed = {k: (saved.get(k), v) for k, v in self.data_order.items() if saved.get(k) != v}
        if changed and not self.cfg.runtime.allow_data_order_change:
            raise ckpt.CheckpointError(
                f"{path} was saved with another data order ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}"
                "); its data position would apply to a different order of the prompts. Resume with the checkpoint's "
                "settings, or set runtime.allow_data_order_change=true to accept that")

    def _resume(self, path: Path) -> None:
        state = ckpt.load_state(path)
        for name in self.trainers:
            self.runtime[name].call("load_checkpoint", str(path / name))
        self.sampler.load_state_dict(state["sampler"])
        self.start_episode = state["episode"] + 1
        if self.sync_pairs:
            self.sync_policy()
        # every process continues its random streams (vLLM's sampling included) where the checkpoint left them
        ckpt.set_rng_state(state["rng"])
        self.runtime.set_rng_states(state["actor_rng"])
        self.log(f"[chatgen] resumed from {path} (episode {state['episode']}); next episode {self.start_episode}")

    def evaluate_policy(self) -> dict:
        """Responses to every held-out prompt with the eval sampling keys (greedy when eval_temperature is 0),
        scored: eval/reward, and eval/solved (share of samples with reward >= runtime.solved_reward)."""
        batch = self.generate(list(range(len(self.eval_records))), is_eval=True)
        rewards = self.score(batch)
        metrics = {"eval/reward": rewards.mean().item()}
        if self.cfg.runtime.solved_reward is not None:
            metrics["eval/solved"] = (rewards >= self.cfg.runtime.solved_reward).float().mean().item()
        return metrics

    def evaluate(self) -> dict:
        return self._evaluate(self)

    def evaluate_start(self) -> None:
        """On a fresh run with evaluation on, log the held-out metrics before any training as episode 0."""
        if self.start_episode == 1 and self.eval_records and self.cfg.runtime.eval_episode_interval:
            with self.timer("eval"):
                self.logger.log(0, self.evaluate())
            self.timer.pop()

    def end_episode(self, episode: int, metrics: dict, start: float, sampler_state: dict | None = None) -> dict:
        """Every algorithm's episode tail: evaluate, checkpoint (after the evaluation, so that a resumed run
        continues every random stream exactly where this one is), add the phase times, log one line.
        sampler_state: the data position a checkpoint records when the loop already drew the next episode's
        prompts (`sampler.state_dict()` from before that draw); default: the sampler's current state."""
        rt, timer = self.cfg.runtime, self.timer
        if self.eval_records and self.should(rt.eval_episode_interval, episode):
            with timer("eval"):
                metrics.update(self.evaluate())
        if self.should(rt.save_episode_interval, episode):
            with timer("checkpoint"):
                self.save(episode, sampler_state)
        metrics.update(timer.pop(), **{"time/episode": time.perf_counter() - start})  # phases + overhead
        self.logger.log(episode, metrics)
        return metrics

    def close(self) -> Path | None:
        """Stop the actors, close the logs, write the plot (`self.plot`, also returned); release the output dir."""
        try:
            self.runtime.shutdown()
            self.plot = self.logger.close()
        finally:
            self._lock.close()
        return self.plot


def sample_metrics(rewards: torch.Tensor, batch, old_logprobs: torch.Tensor, solved_reward: float | None = 1.0,
                   is_weights: torch.Tensor | None = None) -> dict:
    """Reward, length and train/inference mismatch figures of one episode's samples (a RolloutBatch)."""
    mask = batch.loss_mask
    diff = (old_logprobs - batch.infer_logprobs).abs() * mask
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "response/length": batch.response_lengths.float().mean().item(),
        "mismatch/logprob_max_abs": diff.max().item(),
        "mismatch/logprob_mean_abs": (diff.sum() / mask.sum().clamp(min=1)).item(),
    }
    if solved_reward is not None:
        metrics["reward/solved"] = (rewards >= solved_reward).float().mean().item()
    if is_weights is not None:  # truncated importance sampling on: how far from 1 the weights are
        metrics["mismatch/is_weight_mean"] = (is_weights * mask).sum().item() / max(mask.sum().item(), 1)
        metrics["mismatch/is_weight_min"] = is_weights[mask > 0].min().item()
    return metrics


def prefixed(prefix: str, stats: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in stats.items()}
