"""The GRPO episode loop (Group Relative Policy Optimization, DeepSeekMath), top to bottom.

    chatgen train configs/grpo_tiny.yaml            # or: from chatgen.rlhf import grpo; grpo.train(cfg)

Each episode: take sample_per_episode / n prompts; the policy (vLLM) samples n responses to each; the reward
model scores them; each response's advantage is its reward relative to the other responses to the same prompt;
the trainer (Megatron) takes clipped policy-gradient steps with a KL penalty to the reference; the new weights
are synced into vLLM; then checkpoint, eval and log. Models and their roles: docs/rlhf_engine.md.
"""
import time
from functools import partial

from chatgen.rlhf import algorithms as A
from chatgen.rlhf.engine import Run, prefixed, sample_metrics

PHASES = ["generate", "reward", "reference", "old_logprobs", "train", "sync", "checkpoint", "eval"]


def train(cfg, resume: bool = False, log=print) -> dict:
    """Run GRPO as configured; returns the last episode's metrics. Actors are stopped however it ends."""
    algo = cfg.runtime.algorithm
    kl_kind = algo.kl_estimator or "k3"
    tis_cap = algo.importance_sampling_cap  # None: no train/inference correction
    loss_fn = partial(A.policy_loss_fn, clip_eps=algo.clip_eps, kl_coef=algo.kl_coef, kl_kind=kl_kind)
    train_keys = ("old_logprobs", "advantages", "loss_mask") + (("ref_logprobs",) if algo.kl_coef else ()) \
        + (("is_weights",) if tis_cap else ())

    run = Run(cfg, resume, PHASES, log)
    timer, metrics = run.timer, {}
    try:
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, cfg.runtime.num_episode + 1):
            start = time.perf_counter()
            records, items = run.next_prompts()
            with timer("generate"):
                batch = run.generate(items)  # S = len(items) * n samples, prompt-major
            with timer("reward"):
                rewards = run.score(records, batch)  # (S,)
            if "reference" in run.runtime:
                with timer("reference"):
                    batch["ref_logprobs"] = run.logprobs("reference", batch)  # (S, L-1)
            with timer("old_logprobs"):
                batch["old_logprobs"] = run.logprobs("policy_trainer", batch)  # the weights vLLM sampled with
            batch["advantages"] = A.group_advantages(rewards, run.n)  # (S,), broadcast over tokens
            if tis_cap:
                batch["is_weights"] = A.truncated_importance_weights(batch["old_logprobs"], batch["infer_logprobs"],
                                                                     tis_cap)
            with timer("train"):
                stats = run.train("policy_trainer", batch, loss_fn, train_keys)
            with timer("sync"):
                run.sync_policy()
            metrics = {**sample_metrics(rewards, batch), **prefixed("policy", stats)}
            if "ref_logprobs" in batch:
                metrics["kl/reference"] = A.masked_mean(
                    A.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], kl_kind), batch["loss_mask"]).item()
            run.end_episode(episode, metrics, start)  # checkpoint, eval, log
    finally:
        plot = run.close()
    if plot:
        log(f"[chatgen] metrics: {run.out_dir / 'metrics.jsonl'}; plot: {plot}")
    return metrics
