"""The PPO episode loop (Ouyang et al. 2022 style RLHF), top to bottom.

    chatgen train configs/ppo_tiny.yaml            # or: from chatgen.rlhf import ppo; ppo.train(cfg)

Each episode: the policy (vLLM) samples one or more responses per prompt; the reward model scores them; the
sequence score lands on the last response token and a per-token KL penalty to the reference is subtracted;
the critic (value_trainer) gives per-token values; GAE turns rewards and values into advantages and returns;
the policy trainer takes clipped policy-gradient steps and the critic clipped value steps; the policy's
new weights are synced into vLLM; then checkpoint, eval and log. docs/rlhf_engine.md has the details.
"""
import time
from functools import partial

from chatgen.rlhf import algorithms as A
from chatgen.rlhf.engine import Run, prefixed, sample_metrics

PHASES = ["generate", "reward", "reference", "old_logprobs", "values", "train", "sync", "checkpoint", "eval"]


def train(cfg, resume: bool = False, log=print) -> dict:
    """Run PPO as configured; returns the last episode's metrics. Actors are stopped however it ends."""
    algo = cfg.runtime.algorithm
    gamma, lam = algo.gamma, algo.lam
    kl_kind = algo.kl_estimator or "k1"  # k1 in the reward: the classic RLHF penalty
    tis_cap = algo.importance_sampling_cap
    policy_loss_fn = partial(A.policy_loss_fn, clip_eps=algo.clip_eps)  # the KL is in the rewards
    value_loss_fn = partial(A.value_loss_fn, clip_eps=algo.value_clip_eps)
    policy_keys = ("old_logprobs", "advantages", "loss_mask") + (("is_weights",) if tis_cap else ())

    run = Run(cfg, resume, PHASES, log)
    timer, metrics = run.timer, {}
    try:
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, cfg.runtime.num_episode + 1):
            start = time.perf_counter()
            records, items = run.next_prompts()
            with timer("generate"):
                batch = run.generate(items)
            with timer("reward"):
                scores = run.score(records, batch)  # (S,) one score per response
            with timer("old_logprobs"):
                batch["old_logprobs"] = run.logprobs("policy_trainer", batch)  # (S, L-1)
            ref_logprobs = batch["old_logprobs"]
            if "reference" in run.runtime:
                with timer("reference"):
                    ref_logprobs = batch["ref_logprobs"] = run.logprobs("reference", batch)
            with timer("values"):
                batch["old_values"] = run.logprobs("value_trainer", batch)  # (S, L-1): V before each token
            mask = batch["loss_mask"]
            rewards = A.kl_shaped_rewards(scores, batch["old_logprobs"], ref_logprobs, mask, algo.kl_coef, kl_kind)
            advantages, batch["returns"] = A.gae(rewards, batch["old_values"], mask, gamma, lam)
            batch["advantages"] = A.masked_whiten(advantages, mask) * mask
            if tis_cap:
                batch["is_weights"] = A.truncated_importance_weights(batch["old_logprobs"], batch["infer_logprobs"],
                                                                     tis_cap)
            with timer("train"):
                policy_stats = run.train("policy_trainer", batch, policy_loss_fn, policy_keys)
                value_stats = run.train("value_trainer", batch, value_loss_fn, ("old_values", "returns", "loss_mask"))
            with timer("sync"):
                run.sync_policy()
            metrics = {**sample_metrics(scores, batch), **prefixed("policy", policy_stats),
                       **prefixed("value", value_stats),
                       "value/mean": A.masked_mean(batch["old_values"], mask).item(),
                       "returns/mean": A.masked_mean(batch["returns"], mask).item()}
            if "ref_logprobs" in batch:
                metrics["kl/reference"] = A.masked_mean(
                    A.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], kl_kind), mask).item()
            run.end_episode(episode, metrics, start)  # checkpoint, eval, log
    finally:
        plot = run.close()
    if plot:
        log(f"[chatgen] metrics: {run.out_dir / 'metrics.jsonl'}; plot: {plot}")
    return metrics
