"""PPO (Ouyang et al. 2022 style RLHF): the algorithm, its config section and its loop.

    chatgen train configs/ppo_tiny.yaml            # runtime.algorithm.name: ppo

Each episode: the policy (vLLM) samples one or more responses per prompt; the reward model scores
them; the sequence score lands on the last response token and a per-token KL penalty to the
reference is subtracted; the critic (value_trainer) gives per-token values; GAE turns rewards and
values into advantages and returns; the policy trainer takes clipped policy-gradient steps and the
critic clipped value steps; the policy's new weights are synced into vLLM; then checkpoint, eval and
log. docs/rlhf_engine.md has the details.
"""

import dataclasses
import time
from functools import partial
from typing import Literal, Optional

from chatgen.config import opt
from chatgen.core.metrics import reduce_metrics
from chatgen.rlhf import losses as L
from chatgen.rlhf.checks import policy_sampling_problems
from chatgen.rlhf.metrics import prefixed, sample_metrics
from chatgen.rlhf.run import Run
from chatgen.rlhf.schema import POLICY_TRAINER, AlgorithmConfig, Role


@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    kl_coef: float = opt(0.0, "weight of the per-token KL(policy, reference) penalty in the reward")
    kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "KL estimator of the reward penalty (k1: the classic RLHF one)"
    )
    clip_eps: float = opt(
        0.2, "PPO ratio clip: ratios outside [1 - clip_eps, 1 + clip_eps] are clipped"
    )
    gamma: float = opt(1.0, "discount factor of GAE")
    lam: float = opt(0.95, "GAE lambda")
    value_clip_eps: float = opt(0.2, "value-function clip around the old values")
    importance_sampling_cap: Optional[float] = opt(
        None,
        "truncated importance weight cap for the train/inference mismatch (e.g. 2.0); null = off",
    )
    old_logprobs: Literal["recompute", "rollout"] = opt(
        "recompute",
        "where the old log-probs (ratio and KL reward) come from: recompute = a no-grad trainer pass; "
        "rollout = the engine's log-probs of the sampled tokens, saving that pass (mismatch/* is then "
        "measured in the first optimizer step); as in grpo",
    )

    def check(self):
        if self.kl_coef < 0:
            yield "kl_coef", f"must be >= 0, got {self.kl_coef}; use 0 to disable the KL penalty"
        for key in ("clip_eps", "value_clip_eps"):
            if getattr(self, key) <= 0:
                yield key, f"must be > 0, got {getattr(self, key)}; 0.2 is the usual value"
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                yield (
                    key,
                    f"must be in [0, 1], got {getattr(self, key)}; 1.0 and 0.95 are the usual values",
                )
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1:
            yield (
                "importance_sampling_cap",
                (
                    f"must be >= 1 or null, got {self.importance_sampling_cap}; "
                    "2.0 is usual, null turns the correction off"
                ),
            )


MODELS = {
    "policy": Role("generation", doc="samples responses"),
    "policy_trainer": POLICY_TRAINER,
    "value_trainer": Role(
        "megatron",
        trainable=True,
        doc="the critic, e.g. model_class: chatgen.training.critic:CriticModule",
    ),
    "reward": Role("python", doc="scores the responses (e.g. chatgen.rlhf.rewards:RuleReward)"),
    "reference": Role(
        "megatron",
        trainable=False,
        optional=True,
        scores_samples=True,
        doc="frozen initial policy for the KL penalty; without one the penalty is 0",
    ),
}


def check(cfg):
    yield from policy_sampling_problems(cfg)


PHASES = [
    "generate",
    "reward",
    "reference",
    "old_logprobs",
    "values",
    "train",
    "sync",
    "checkpoint",
    "eval",
]


def train(cfg, resume=False, log=print) -> dict:
    """Run PPO as configured; returns the last episode's metrics. Actors are stopped however it
    ends. resume: False, True (the latest checkpoint) or a checkpoint (path or episode directory
    name)."""
    algo, rt = cfg.runtime.algorithm, cfg.runtime
    n = cfg.models["policy"].config.n
    # the KL is in the rewards, not the loss
    policy_loss_fn = partial(L.policy_loss, options=L.PolicyLossOptions(clip_eps=algo.clip_eps))
    value_loss_fn = partial(L.value_loss_fn, clip_eps=algo.value_clip_eps)

    with Run(cfg, resume, PHASES, log, records_per_episode=rt.sample_per_episode // n) as run:
        timer, metrics = run.timer, {}
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            with timer("generate"):
                batch = run.generate(run.next_prompts())
            with timer("reward"):
                scores = run.score(batch)  # (S,) one score per response
            inputs, mask = batch.trainer_inputs(), batch.loss_mask
            if algo.old_logprobs == "rollout":
                # (S, L-1) the sampling weights' log-probs, as the engine computed them
                old = batch.infer_logprobs
            else:
                with timer("old_logprobs"):
                    old = run.forward_tokens("policy_trainer", inputs, scored_only=True)  # (S, L-1)
            ref = old
            if "reference" in cfg.models:
                with timer("reference"):
                    ref = run.forward_tokens("reference", inputs, scored_only=True)
            with timer("values"):
                # (S, L-1): V before each token
                old_values = run.forward_tokens("value_trainer", inputs)
            rewards = L.kl_shaped_rewards(scores, old, ref, mask, algo.kl_coef, algo.kl_estimator)
            advantages, returns = L.gae(rewards, old_values, mask, algo.gamma, algo.lam)
            policy_data = inputs.replace(
                old_logprobs=old, advantages=L.masked_whiten(advantages, mask) * mask
            )
            if algo.importance_sampling_cap:
                policy_data = policy_data.replace(
                    is_weights=L.truncated_importance_weights(
                        old, batch.infer_logprobs, algo.importance_sampling_cap
                    )
                )
            with timer("train"):
                policy_steps = run.train(
                    "policy_trainer", policy_data, policy_loss_fn, per_step=True
                )
                value_stats = run.train(
                    "value_trainer",
                    inputs.replace(old_values=old_values, returns=returns),
                    value_loss_fn,
                )
            with timer("sync"):
                run.sync_policy()
            metrics = {
                **sample_metrics(scores, batch, old, rt.solved_reward, policy_data.is_weights),
                **prefixed("policy", reduce_metrics(policy_steps)),
                **prefixed("value", value_stats),
                "value/mean": L.masked_mean(old_values, mask).item(),
                "returns/mean": L.masked_mean(returns, mask).item(),
            }
            # the first step's log-probs, before any update, against the engine's
            if algo.old_logprobs == "rollout":
                metrics["mismatch/logprob_max_abs"] = policy_steps[0]["old_logprob_diff_max"]
                del metrics["mismatch/logprob_mean_abs"]
            if "reference" in cfg.models:
                metrics["kl/reference"] = L.masked_mean(
                    L.kl_estimate(old, ref, algo.kl_estimator), mask
                ).item()
            run.end_episode(episode, metrics, start)  # eval, checkpoint, log
    return metrics
