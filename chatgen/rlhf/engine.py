"""What every RLHF episode loop shares: start a run, turn generations into trainer batches, score, sync,
checkpoint, evaluate, log. The loops themselves live in grpo.py and ppo.py, each readable top to bottom.

    run = Run(cfg, resume=False, phases=["generate", "reward", "train", "sync"])
    records, items = run.next_prompts()
    batch = run.generate(items)                  # tokens, masks, vLLM log-probs, texts   (S = prompts x n)
    rewards = run.score(records, batch)          # (S,)
    batch["old_logprobs"] = run.logprobs("policy_trainer", batch)
    stats = run.train("policy_trainer", batch, loss_fn, keys=("old_logprobs", "advantages", "loss_mask"))
    run.sync_policy()
    run.close()

Trainer batches: input_ids (S, L) right-padded, attention_mask (S, L), and per-token tensors of shape (S, L-1)
aligned with the trainer's log-probs (entry t scores token t+1): loss_mask (1 on response tokens),
infer_logprobs (vLLM's), old_logprobs / ref_logprobs (trainer / reference before the update).
"""
import time
from pathlib import Path

import torch

from chatgen.config import ConfigError, format_config, save_resolved
from chatgen.rlhf import checkpoint as ckpt
from chatgen.rlhf.metrics import MetricsLogger, PhaseTimer
from chatgen.rlhf.tasks import read_jsonl

# Keys the policy's decode_internal must return (examples/policy_inference.py: PolicyInference returns them).
GENERATION_KEYS = ("all_tokens", "loss_mask", "old_logprobs", "prompt_lengths", "response_lengths", "str_outputs")
NEEDS = {  # algorithm -> {model name: backend}
    "grpo": {"policy": "vllm", "policy_trainer": "megatron", "reward": "python"},
    "ppo": {"policy": "vllm", "policy_trainer": "megatron", "value_trainer": "megatron", "reward": "python"},
}
OPTIONAL = {"reference": "megatron"}


def check_config(cfg) -> None:
    """Problems a schema cannot see (which models an algorithm needs, how they fit together), all at once,
    before any actor starts. Raises ConfigError."""
    name = cfg.runtime.algorithm.name
    errors = []
    where = cfg.path or "config"
    for model, backend in NEEDS[name].items():
        entry = cfg.models.get(model)
        if entry is None:
            errors.append(f"{where}: models.{model}: {name} needs a `{model}` model (backend: {backend}); add it")
        elif entry.backend != backend:
            errors.append(f"{where}: models.{model}.backend: {name} needs backend {backend}, got {entry.backend}")
    for model, entry in cfg.models.items():
        if model not in NEEDS[name] and model not in OPTIONAL:
            fix = "values come from value_trainer (same weights); remove it" if model == "value" else "remove it"
            errors.append(f"{where}: models.{model}: not used by {name}; {fix}")
        elif model in OPTIONAL and entry.backend != OPTIONAL[model]:
            errors.append(f"{where}: models.{model}.backend: must be {OPTIONAL[model]}, got {entry.backend}")
    for model in ("policy_trainer", "value_trainer"):
        if model in cfg.models and model in NEEDS[name] and not cfg.models[model].trainable:
            errors.append(f"{where}: models.{model}.trainable: must be true (it is the model being trained)")
    if "reference" in cfg.models and cfg.models["reference"].trainable:
        errors.append(f"{where}: models.reference.trainable: must be false (the reference stays frozen)")
    if cfg.runtime.algorithm.kl_coef > 0 and "reference" not in cfg.models:
        errors.append(f"{where}: runtime.algorithm.kl_coef: {cfg.runtime.algorithm.kl_coef} needs a `reference` "
                      "model (backend: megatron, trainable: false); add one or set kl_coef: 0")
    policy = cfg.models.get("policy")
    if policy is not None and policy.backend == "vllm":
        pc = policy.config
        if pc.temperature != 1.0 or pc.top_p != 1.0 or pc.top_k not in (-1, 0) or pc.min_p != 0.0:
            errors.append(f"{where}: models.policy: sample with temperature 1.0, top_p 1.0, top_k -1, min_p 0 "
                          f"(got {pc.temperature}, {pc.top_p}, {pc.top_k}, {pc.min_p}): the trainer scores tokens "
                          "under the untempered distribution, so other settings would make every update off-policy")
        if cfg.runtime.sample_per_episode % pc.n:
            errors.append(f"{where}: runtime.sample_per_episode: {cfg.runtime.sample_per_episode} is not a multiple "
                          f"of policy n={pc.n} (samples per prompt); make it one")
        if name == "grpo" and pc.n < 2:
            errors.append(f"{where}: models.policy.n: GRPO compares the n samples of a prompt; set n >= 2")
    rt = cfg.runtime
    for model, entry in cfg.models.items():  # each DP rank gets 1/DP of a batch, in whole micro-batches
        if entry.backend != "megatron" or entry.config is None:
            continue
        mc = entry.config
        model_parallel = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
        world = entry.num_gpu or model_parallel  # as runtime.plan_groups places it
        if world % model_parallel:
            continue  # init_distributed names this one
        dp, micro = world // model_parallel, mc.micro_batch_size or rt.train_micro_batch_size
        how = (f"models.{model} has DP = {world} ranks / (TP {mc.tensor_model_parallel_size} x PP "
               f"{mc.pipeline_model_parallel_size}) = {dp} and micro batch {micro}")
        gbs = rt.train_global_batch_size or rt.sample_per_episode
        if entry.trainable and gbs % (micro * dp):
            errors.append(f"{where}: runtime.train_global_batch_size: {gbs} does not split into whole micro-batches "
                          f"on every data-parallel rank ({how}); make it a multiple of {micro * dp}")
        elif rt.sample_per_episode % (micro * dp):
            errors.append(f"{where}: runtime.sample_per_episode: {rt.sample_per_episode} does not split into whole "
                          f"micro-batches on every data-parallel rank ({how}); make it a multiple of {micro * dp}")
    if not cfg.runtime.data_path:
        errors.append(f"{where}: runtime.data_path: required (a JSONL file of {{\"prompt\": ..., \"answer\": ...}})")
    elif not Path(cfg.runtime.data_path).is_file():
        errors.append(f"{where}: runtime.data_path: {cfg.runtime.data_path} does not exist; create it (for the "
                      "tiny task: python -m chatgen.rlhf.tasks --output DIR) or fix the path")
    if cfg.runtime.eval_data_path and not Path(cfg.runtime.eval_data_path).is_file():
        errors.append(f"{where}: runtime.eval_data_path: {cfg.runtime.eval_data_path} does not exist; fix the path")
    if cfg.runtime.eval_episode_interval and not cfg.runtime.eval_data_path:
        errors.append(f"{where}: runtime.eval_episode_interval: set, but runtime.eval_data_path is not; set both")
    if errors:
        raise ConfigError(errors)


def trainer_batch(gen: dict) -> dict:
    """The policy's generation output (S samples) -> a trainer batch (see the module docstring)."""
    missing = [k for k in GENERATION_KEYS if k not in gen]
    if missing:
        raise KeyError(f"the policy's decode_internal returned no {missing}; return {list(GENERATION_KEYS)} as "
                       "examples/policy_inference.py (PolicyInference.decode_internal) does")
    tokens = gen["all_tokens"].long()
    lengths = gen["prompt_lengths"] + gen["response_lengths"]
    positions = torch.arange(tokens.shape[1])
    return {
        "input_ids": tokens,
        "attention_mask": (positions[None, :] < lengths[:, None]).long(),
        "loss_mask": gen["loss_mask"][:, 1:].float(),
        "infer_logprobs": gen["old_logprobs"][:, 1:].float(),
        "response_lengths": gen["response_lengths"],
    }


def select(batch: dict, index: torch.Tensor) -> dict:
    """Rows `index` of every per-sample tensor of a batch."""
    n = batch["input_ids"].shape[0]
    return {k: v[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v for k, v in batch.items()}


# Functions run inside the actors (ModelWorker.run): module level, so Ray pickles them by reference.

def _sync_colocated(models, trainer, policy, validate):
    models[trainer].sync_to(models[policy], validate=validate)


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
    models[trainer].sync_to(models[trainer]._chatgen_sender, validate=validate)


class Run:
    """One training run: config checked, outputs prepared, actors started, data loaded, resume applied.

    Attributes: cfg, runtime (chatgen.rlhf.runtime.Runtime), policy (ModelHandle), records / eval_records
    (JSONL dicts), sampler (PromptSampler), timer (PhaseTimer), logger (MetricsLogger), start_episode.
    """

    def __init__(self, cfg, resume: bool, phases: list, log=print):
        from chatgen.rlhf.runtime import Runtime

        check_config(cfg)
        self.cfg, self.log = cfg, log
        rt = cfg.runtime
        self.out_dir = Path(rt.output_dir)
        self.save_dir = self.out_dir / "checkpoints"
        last = ckpt.latest_checkpoint(self.save_dir)
        if last is not None and not resume:
            raise FileExistsError(f"{self.save_dir} holds checkpoints ({last.name}); pass --resume to continue "
                                  "from the latest, or choose another runtime.output_dir")
        self.records = read_jsonl(rt.data_path)
        self.eval_records = read_jsonl(rt.eval_data_path) if rt.eval_data_path else []
        self.n = cfg.models["policy"].config.n
        self.sampler = ckpt.PromptSampler(len(self.records), rt.sample_per_episode // self.n, rt.seed)
        torch.manual_seed(rt.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, self.out_dir)
        log(f"[chatgen] {rt.algorithm.name} config:\n{format_config(cfg)}")

        self.runtime = Runtime.start(cfg, log=log)
        try:
            self.policy = self.runtime["policy"]
            self.trainers = [n for n in ("policy_trainer", "value_trainer") if n in self.runtime]
            self.items = self.policy.first("build_dataset", [r["prompt"] for r in self.records])
            self.eval_items = self.policy.first("build_dataset", [r["prompt"] for r in self.eval_records], True)
            self._setup_sync()
            self.start_episode = 1
            if last is not None:
                self._resume(last)
            self.timer = PhaseTimer()
            self.logger = MetricsLogger(self.out_dir, phases, rt.num_episode, self.start_episode)
        except BaseException:
            self.runtime.shutdown()
            raise

    # ---- data and generation ------------------------------------------------------------------------

    def next_prompts(self):
        """The next batch of prompts: (records, policy dataset items), sample_per_episode / n of each."""
        index = self.sampler.next_batch()
        return [self.records[i] for i in index], [self.items[i] for i in index]

    def generate(self, items: list, is_eval: bool = False) -> dict:
        """Sample n responses per item with the policy -> trainer batch plus "str_outputs" (S texts)."""
        self._wake_policy()
        gen = self.policy.first("run_generation", items, is_eval)
        batch = trainer_batch(gen)
        batch["str_outputs"] = list(gen["str_outputs"])
        if self._policy_sleeps:  # colocated on GPUs: free the engine's memory for the trainers
            self.policy.call("sleep")
            self._asleep = True
        return batch

    def score(self, records: list, batch: dict, n: int = None) -> torch.Tensor:
        """(S,) rewards of the responses; each record's fields (e.g. "answer") go to the reward model as lists."""
        n = self.n if n is None else n
        repeated = [r for r in records for _ in range(n)]
        data = {key: [r.get(key) for r in repeated] for key in repeated[0]}
        data["str_outputs"] = batch["str_outputs"]
        rewards = torch.as_tensor(self.runtime["reward"].first("forward_step", data), dtype=torch.float32)
        if rewards.shape != (len(repeated),):
            raise ValueError(f"reward.forward_step returned shape {tuple(rewards.shape)}; it must return one "
                             f"float per response, shape ({len(repeated)},)")
        return rewards

    # ---- Megatron models (data parallel over their DP ranks) ------------------------------------------

    def _split_call(self, name: str, method: str, batch: dict, *args) -> list:
        """`method(shard, *args)` on every rank, the batch's rows split over the model's DP ranks; returns
        one result per DP rank, in DP order."""
        handle = self.runtime[name]
        dp = max(handle.dp_ranks) + 1
        n = batch["input_ids"].shape[0]
        if n % dp:
            raise ValueError(f"{name}: a batch of {n} samples does not split over {dp} data-parallel ranks")
        shards = [select(batch, torch.arange(d * n // dp, (d + 1) * n // dp)) for d in range(dp)]
        refs = [a.call.remote(name, method, shards[d], *args) for a, d in zip(handle.group.actors, handle.dp_ranks)]
        results = handle.get(refs, method)
        first = {}
        for d, result in zip(handle.dp_ranks, results):
            first.setdefault(d, result)
        return [first[d] for d in range(dp)]

    def logprobs(self, name: str, batch: dict) -> torch.Tensor:
        """(S, L-1) per-token outputs of a Megatron model (log-probs; values for a value model), no grad."""
        data = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return torch.cat([out["logprobs"] for out in self._split_call(name, "forward_step", data)])

    def train(self, name: str, batch: dict, loss_fn, keys: tuple) -> dict:
        """num_training_epoch passes over the batch in shuffled global batches, one optimizer step each.
        Only `keys` of the batch travel to the trainer. Returns the steps' mean metrics."""
        rt = self.cfg.runtime
        data = {k: batch[k] for k in ("input_ids", "attention_mask", *keys)}
        n = data["input_ids"].shape[0]
        steps = []
        for _ in range(rt.num_training_epoch):
            order = torch.randperm(n)
            for start in range(0, n, rt.train_global_batch_size):
                shard = select(data, order[start:start + rt.train_global_batch_size])
                steps.append(self._split_call(name, "train_step", shard, loss_fn)[0])
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    # ---- weight sync ---------------------------------------------------------------------------------

    def _setup_sync(self) -> None:
        trainer, policy = self.runtime["policy_trainer"], self.policy
        self._colocated = trainer.group is policy.group
        self._policy_sleeps = self._colocated and policy.entry.num_gpu > 0  # CPU: sleep frees nothing
        self._asleep = False
        self._syncs = 0
        if not self._colocated:
            host, port = policy.get(policy.group.run_async(_open_receiver, policy.name, policy.group.multi_node),
                                    "open sync")[0]
            trainer.get(trainer.group.run_async(_connect_sender, trainer.name, host, port), "connect sync")

    def _wake_policy(self) -> None:
        if self._asleep:
            self.policy.call("wake_up")
            self._asleep = False

    def sync_policy(self) -> None:
        """policy_trainer's weights -> the policy's vLLM engine. The first sync of a run validates every tensor."""
        trainer, policy = self.runtime["policy_trainer"], self.policy
        validate = self._syncs == 0
        self._wake_policy()
        if self._colocated:
            trainer.get(trainer.group.run_async(_sync_colocated, trainer.name, policy.name, validate), "sync")
        else:
            refs = policy.group.run_async(_receive, policy.name) + trainer.group.run_async(_send, trainer.name, validate)
            trainer.get(refs, "sync")
        self._syncs += 1

    # ---- checkpoint, resume, eval, log ---------------------------------------------------------------

    def should(self, interval, episode: int) -> bool:
        return bool(interval) and (episode % interval == 0 or episode == self.cfg.runtime.num_episode)

    def save(self, episode: int) -> Path:
        """Checkpoint every trainer and the driver state atomically (chatgen.rlhf.checkpoint)."""
        tmp = ckpt.begin_checkpoint(self.save_dir, episode)
        for name in self.trainers:
            self.runtime[name].call("save_checkpoint", str(tmp / name))
        state = {"episode": episode, "sampler": self.sampler.state_dict(), "rng": ckpt.rng_state()}
        return ckpt.commit_checkpoint(tmp, state)

    def _resume(self, path: Path) -> None:
        state = ckpt.load_state(path)
        for name in self.trainers:
            self.runtime[name].call("load_checkpoint", str(path / name))
        self.sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        self.start_episode = state["episode"] + 1
        self.sync_policy()
        self.log(f"[chatgen] resumed from {path} (episode {state['episode']}); next episode {self.start_episode}")

    def evaluate(self) -> dict:
        """Responses to every held-out prompt with the eval sampling keys (greedy when eval_temperature is 0),
        scored: eval/reward, eval/solved."""
        batch = self.generate(self.eval_items, is_eval=True)
        n = len(batch["str_outputs"]) // len(self.eval_records)  # 1 when greedy, else the policy's n
        rewards = self.score(self.eval_records, batch, n=n)
        return {"eval/reward": rewards.mean().item(), "eval/solved": (rewards >= 1.0).float().mean().item()}

    def evaluate_start(self) -> None:
        """On a fresh run with evaluation on, log the held-out reward before any training as episode 0."""
        if self.start_episode == 1 and self.eval_records and self.cfg.runtime.eval_episode_interval:
            with self.timer("eval"):
                self.logger.log(0, self.evaluate())
            self.timer.pop()

    def end_episode(self, episode: int, metrics: dict, start: float) -> dict:
        """Every algorithm's episode tail: checkpoint, evaluate, add the phase times, log one line."""
        rt, timer = self.cfg.runtime, self.timer
        if self.should(rt.save_episode_interval, episode):
            with timer("checkpoint"):
                self.save(episode)
        if self.eval_records and self.should(rt.eval_episode_interval, episode):
            with timer("eval"):
                metrics.update(self.evaluate())
        metrics.update(timer.pop(), **{"time/episode": time.perf_counter() - start})  # phases + overhead
        self.logger.log(episode, metrics)
        return metrics

    def close(self) -> Path | None:
        """Stop the actors, close the logs, write the plot; returns the plot's path."""
        self.runtime.shutdown()
        return self.logger.close()


def sample_metrics(rewards: torch.Tensor, batch: dict) -> dict:
    """Reward, length and train/inference mismatch figures of one episode's samples."""
    mask = batch["loss_mask"]
    diff = (batch["old_logprobs"] - batch["infer_logprobs"]).abs() * mask
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "reward/solved": (rewards >= 1.0).float().mean().item(),
        "response/length": batch["response_lengths"].float().mean().item(),
        "mismatch/logprob_max_abs": diff.max().item(),
        "mismatch/logprob_mean_abs": (diff.sum() / mask.sum().clamp(min=1)).item(),
    }
    if "is_weights" in batch:  # truncated importance sampling on: how far from 1 the weights are
        metrics["mismatch/is_weight_mean"] = (batch["is_weights"] * mask).sum().item() / max(mask.sum().item(), 1)
        metrics["mismatch/is_weight_min"] = batch["is_weights"][mask > 0].min().item()
    return metrics


def prefixed(prefix: str, stats: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in stats.items()}

