"""GRPO (Group Relative Policy Optimization, DeepSeekMath): the algorithm, its config section and its loop.

    chatgen train configs/grpo_tiny.yaml            # runtime.algorithm.name: grpo

Each episode: take sample_per_episode / n prompts; the policy (vLLM) samples n responses to each; the reward
model scores them; each response's advantage is its reward relative to the other responses to the same prompt;
the trainer (Megatron) takes clipped policy-gradient steps (with a KL penalty to the reference when kl_coef > 0);
the new weights are synced into vLLM; then checkpoint, eval and log. docs/rlhf_engine.md has the details.
With overlap_generation the next episode's samples are generated while the trainer trains (one step off-policy).
"""
import concurrent.futures
import dataclasses
import time
from functools import partial
from typing import Literal, Optional

from chatgen.config import opt
from chatgen.core.metrics import reduce_metrics
from chatgen.rlhf import losses as L
from chatgen.rlhf.config import AlgorithmConfig, Role, policy_sampling_problems
from chatgen.rlhf.health import zero_variance_groups
from chatgen.rlhf.metrics import prefixed, sample_metrics
from chatgen.rlhf.run import Run


@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    kl_coef: float = opt(0.0, "weight of the KL(policy, reference) penalty in the loss; 0 = none (a reference model, "
                              "if configured, then only reports kl/reference)")
    clip_eps: float = opt(0.2, "PPO ratio clip: ratios outside [1 - clip_eps, 1 + clip_eps] are clipped")
    kl_estimator: Literal["k1", "k2", "k3"] = opt("k3", "KL estimator (Schulman's k1/k2/k3) of the penalty")
    importance_sampling_cap: Optional[float] = opt(
        None, "truncated importance weight cap for the train/inference mismatch (e.g. 2.0); null = off")
    old_logprobs: Literal["recompute", "rollout"] = opt(
        "recompute", "where the ratio's old log-probs come from: recompute = a no-grad trainer pass before training "
                     "(mismatch/* metrics compare it with the engine's); rollout = the engine's own log-probs of the "
                     "sampled tokens, saving that pass (exact here: the sync is exact, so they equal the trainer's to "
                     "float noise; mismatch/* is then measured in the first optimizer step)")
    overlap_generation: bool = opt(
        False, "one-step off-policy: sample episode k+1 (with the weights before episode k's update) while the "
               "trainer trains on episode k; the new weights reach the engine when both are done. Needs "
               "importance_sampling_cap or old_logprobs: rollout to correct for the stale samples")

    def check(self):
        if self.kl_coef < 0:
            yield "kl_coef", f"must be >= 0, got {self.kl_coef}; use 0 to disable the KL penalty"
        if self.clip_eps <= 0:
            yield "clip_eps", f"must be > 0, got {self.clip_eps}; 0.2 is the usual value"
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1:
            yield "importance_sampling_cap", (f"must be >= 1 or null, got {self.importance_sampling_cap}; "
                                              "2.0 is usual, null turns the correction off")
        if self.overlap_generation and self.old_logprobs == "recompute" and self.importance_sampling_cap is None:
            yield "overlap_generation", ("samples one step off-policy, and recomputed old log-probs do not see it; "
                                         "set importance_sampling_cap (e.g. 2.0) or old_logprobs: rollout")


MODELS = {
    "policy": Role("generation", doc="samples n responses per prompt"),
    "policy_trainer": Role("megatron", trainable=True, syncs_to="policy", doc="the policy's trainable copy"),
    "reward": Role("python", doc="scores the responses (e.g. chatgen.rlhf.rewards:RuleReward)"),
    "reference": Role("megatron", trainable=False, optional=True,
                      doc="frozen initial policy for the KL penalty (needed when kl_coef > 0)"),
}


def check(cfg):
    yield from policy_sampling_problems(cfg)
    if "policy" in cfg.models and cfg.models["policy"].config.n < 2:
        yield "models.policy.n: GRPO compares the n samples of a prompt; set n >= 2"
    algo = cfg.runtime.algorithm
    if algo.kl_coef > 0 and "reference" not in cfg.models:
        yield (f"runtime.algorithm.kl_coef: {algo.kl_coef} needs a `reference` model (backend: megatron, trainable: "
               "false); add one or set kl_coef: 0")


PHASES = ["generate", "reward", "reference", "old_logprobs", "train", "sync", "checkpoint", "eval"]


def update(run, batch, rewards, n: int, sync: bool = True) -> dict:
    """GRPO's step once a batch is sampled and scored: group advantages, reference and old log-probs, clipped
    policy-gradient steps, sync into the policy (unless sync=False: the caller syncs later). batch: a RolloutBatch
    of S = prompts x n samples (prompt-major); rewards: (S,). Returns the episode's metrics (rewards, mismatch,
    trainer, KL). Shared by grpo_multiturn."""
    algo, timer = run.cfg.runtime.algorithm, run.timer
    use_reference = "reference" in run.cfg.models  # for the penalty, or (kl_coef 0) the kl/reference metric only
    loss_fn = partial(L.policy_loss_fn, clip_eps=algo.clip_eps, kl_coef=algo.kl_coef, kl_kind=algo.kl_estimator)
    data = {**batch.trainer_inputs(), "advantages": L.group_advantages(rewards, n)}  # (S,) per sample
    if use_reference:
        with timer("reference"):
            data["ref_logprobs"] = run.forward_tokens("reference", data)  # (S, L-1)
    if algo.old_logprobs == "rollout":
        data["old_logprobs"] = batch.infer_logprobs  # the sampling weights' log-probs, as the engine computed them
    else:
        with timer("old_logprobs"):
            data["old_logprobs"] = run.forward_tokens("policy_trainer", data)  # the weights the engine sampled with
    if algo.importance_sampling_cap:
        data["is_weights"] = L.truncated_importance_weights(data["old_logprobs"], batch.infer_logprobs,
                                                            algo.importance_sampling_cap)
    with timer("train"):
        # whole groups per step (when they fit): a micro-batch then holds a prompt's samples together, and the
        # trainer runs that prompt once for all of them (shared-prefix packing, MegatronConfig.pack_shared_prefix)
        group = n if run.cfg.runtime.train_global_batch_size % n == 0 else 1
        steps = run.train("policy_trainer", data, loss_fn, group_size=group, per_step=True)
    stats = reduce_metrics(steps)
    if sync:
        with timer("sync"):
            run.sync_policy()
    metrics = {**sample_metrics(rewards, batch, data["old_logprobs"], run.cfg.runtime.solved_reward,
                                data.get("is_weights")), **prefixed("policy", stats)}
    metrics["reward/zero_variance_groups"] = zero_variance_groups(rewards, n, run.log)
    if algo.old_logprobs == "rollout":  # old == infer: the mismatch is what the first step saw before updating
        del metrics["mismatch/logprob_max_abs"], metrics["mismatch/logprob_mean_abs"]
        if not algo.overlap_generation:  # (one step off-policy, the first step sees the update too)
            metrics["mismatch/logprob_max_abs"] = steps[0]["old_logprob_diff_max"]
    if use_reference:
        metrics["kl/reference"] = L.masked_mean(L.kl_estimate(data["old_logprobs"], data["ref_logprobs"],
                                                              algo.kl_estimator), batch.loss_mask).item()
    return metrics


def train(cfg, resume=False, log=print) -> dict:
    """Run GRPO as configured; returns the last episode's metrics. Actors are stopped however it ends. resume:
    False, True (the latest checkpoint) or a checkpoint (path or episode directory name)."""
    rt = cfg.runtime
    n = cfg.models["policy"].config.n
    overlap = rt.algorithm.overlap_generation  # one-step off-policy: sample k+1 while training on k
    with Run(cfg, resume, PHASES, log, records_per_episode=rt.sample_per_episode // n) as run, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chatgen-prefetch") as prefetch:
        timer, metrics, batch = run.timer, {}, None
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            if batch is None:
                with timer("generate"):
                    batch = run.generate(run.next_prompts())  # S = prompts * n samples, prompt-major
            with timer("reward"):
                rewards = run.score(batch)  # (S,)
            sampler_state, upcoming = run.sampler.state_dict(), None  # a checkpoint's data position: before k+1
            if overlap and episode < rt.num_episode:  # the engine still holds the weights that sampled `batch`
                upcoming = prefetch.submit(run.generate, run.next_prompts())
            metrics = update(run, batch, rewards, n, sync=upcoming is None)  # advantages, old log-probs, train
            batch = None
            if upcoming is not None:
                with timer("generate"):  # what training did not hide
                    batch = upcoming.result()
                with timer("sync"):  # only once the engine is idle
                    run.sync_policy()
            run.end_episode(episode, metrics, start, sampler_state)  # eval, checkpoint, log
    return metrics

