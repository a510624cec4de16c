"""GRPO's step once a batch is sampled and scored, shared by the loops that sample it (loop.py,
grpo_multiturn.py): shaped rewards, the loss's options, rollout correction, the update itself
(reference and old log-probs, advantages, train, sync) and DAPO's dynamic sampling. The knobs it
calls (advantage estimator, ratio, aggregation, importance weights) are chatgen.rlhf.recipe's
registered functions, found by the keys that name them.

The algorithm's keys are chatgen.rlhf.algorithms.grpo's Config (the `algo` argument below);
docs/algorithms.md has each recipe.
"""

from functools import partial

import torch

from chatgen.core.metrics import reduce_metrics
from chatgen.core.rollout import RolloutBatch
from chatgen.core.train_batch import TrainBatch
from chatgen.rlhf import losses as L
from chatgen.rlhf import recipe
from chatgen.rlhf.algorithms.grpo.staleness import MISMATCH_KEYS, on_policy_mismatch
from chatgen.rlhf.health import equal_reward_groups, zero_variance_groups
from chatgen.rlhf.metrics import prefixed, sample_metrics
from chatgen.rlhf.recipe import distill, gdpo, shaping


def lora_reference(cfg) -> bool:
    """Whether the KL reference is the LoRA policy trainer's own base (adapters off): kl_coef >
    0, no `reference` model, and a policy trainer with `lora.rank` > 0 (docs/lora.md)."""
    trainer = cfg.models.get("policy_trainer")
    lora = getattr(getattr(trainer, "config", None), "lora", None)
    return (
        cfg.runtime.algorithm.kl_coef > 0
        and "reference" not in cfg.models
        and bool(lora and lora.rank)
    )


def shaped_rewards(cfg, batch, rewards):
    """(S,) rewards the advantages see, and each shaping's mean change (reward/<shaping>): the
    scores plus DAPO's overlong penalty, Kimi's group length penalty and ProRL's stop-properly
    penalty, each when its key is on (docs/algorithms.md). rewards: (S,) of a RolloutBatch."""
    algo, pc = cfg.runtime.algorithm, cfg.models["policy"].config
    shaped, metrics = rewards, {}
    if algo.overlong_buffer_length is not None:
        penalty = L.overlong_penalty(
            batch.response_lengths,
            pc.max_new_tokens,
            algo.overlong_buffer_length,
            algo.overlong_penalty_factor,
        )
        shaped, metrics["reward/overlong_penalty"] = shaped + penalty, penalty.mean().item()
    if algo.length_penalty_coef:
        correct = rewards >= cfg.runtime.solved_reward
        bonus = algo.length_penalty_coef * shaping.group_length_penalty(
            batch.response_lengths, correct, pc.n
        )
        shaped, metrics["reward/length_penalty"] = shaped + bonus, bonus.mean().item()
    if algo.stop_properly_penalty_coef is not None:
        cut = torch.tensor([r == "length" for r in batch.finish_reasons])
        after = shaping.stop_properly_penalty(shaped, cut, algo.stop_properly_penalty_coef)
        metrics["reward/stop_properly_penalty"] = (after - shaped).mean().item()
        shaped = after
    return shaped, metrics


def advantages(algo, rewards, n: int, data: TrainBatch, mask, extras=None):
    """The advantage estimator runtime.algorithm.advantage_estimator names: (S,) per sample or
    (S, L-1) per token. rewards: (S,); data: old_logprobs and (with kl_in_reward) ref_logprobs,
    (S, L-1); mask: (S, L-1), the response tokens; extras: what the estimator sees beside them
    (the reward terms: gdpo.with_terms), not sent to the trainer."""
    estimator = recipe.advantage.get(algo.advantage_estimator)
    view = data.replace(loss_mask=mask, extras={**data.extras, **(extras or {})})
    return estimator(rewards, n, view, algo)


def loss_options(cfg) -> L.PolicyLossOptions:
    """policy_loss's options for this run's algorithm section."""
    algo, pc = cfg.runtime.algorithm, cfg.models["policy"].config
    norm = algo.loss_aggregation == "seq_mean_token_sum_norm"
    return L.PolicyLossOptions(
        clip_eps=algo.clip_eps if algo.clip_eps_low is None else algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
        kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
        kl_kind=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        log_ratio=recipe.ratio.get(algo.ratio_level),
        aggregation=recipe.aggregation.get(algo.loss_aggregation),
        norm_length=(algo.loss_norm_length or pc.max_new_tokens) if norm else None,
        surrogate=recipe.policy_loss.get(algo.policy_loss),
        sapo_temperature_pos=algo.sapo_temperature_pos,
        sapo_temperature_neg=algo.sapo_temperature_neg,
    )


def rollout_correction(algo, data: TrainBatch, infer_logprobs):
    """Importance weights (is_weights) and outlier masking (loss_mask) for the train/inference
    mismatch, from old (data) vs inference log-probs; returns (data with them, their metrics
    rollout_correction/*)."""
    old, mask, metrics = data.old_logprobs, data.loss_mask, {}
    cap = algo.importance_sampling_cap
    if cap:
        weigh = recipe.correction.get(algo.importance_sampling_level)
        data = data.replace(is_weights=weigh(old, infer_logprobs, mask, cap))
    if algo.rejection_level is not None:
        keep = L.outlier_mask(
            old, infer_logprobs, mask, algo.rejection_low, algo.rejection_high, algo.rejection_level
        )
        answered = mask.sum(dim=1) > 0
        dropped = answered & (keep.sum(dim=1) == 0)
        metrics["rollout_correction/masked_token_fraction"] = (
            (mask - keep).sum() / mask.sum().clamp(min=1)
        ).item()
        metrics["rollout_correction/masked_sequence_fraction"] = (
            dropped.sum() / answered.sum().clamp(min=1)
        ).item()
        data = data.replace(loss_mask=keep)
    return data, metrics


def update(
    run, batch, rewards, n: int, sync: bool = True, current_version=None, extras=None
) -> dict:
    """GRPO's step once a batch is sampled and scored: reference and old log-probs, rollout
    correction, advantages (runtime.algorithm.advantage_estimator), clipped policy-gradient
    steps, sync into the policy (unless sync=False: the caller syncs later). batch: a
    RolloutBatch of S = prompts x n samples (prompt-major); rewards: (S,). Returns the episode's
    metrics (rewards, mismatch, trainer, KL). Shared by grpo_multiturn. current_version
    (asynchronous runs): the engine version of the trainer's weights; the mismatch is then
    measured on the tokens it sampled only. extras: more for the advantage estimator to see
    (grpo_multiturn's turns: recipe/gigpo.py)."""
    cfg, timer = run.cfg, run.timer
    algo = cfg.runtime.algorithm
    # the penalty, or (kl_coef 0) kl/reference only; a LoRA trainer's base (adapters off) when
    # there is no reference model
    use_reference = "reference" in cfg.models or lora_reference(cfg)
    loss_fn = partial(L.policy_loss, options=loss_options(cfg))
    data, recipe_metrics = batch.trainer_inputs(), {}
    if algo.mask_truncated:  # DAPO's overlong filtering: a cut response says nothing of its end
        cut = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
        data = data.replace(loss_mask=data.loss_mask * (1 - cut).unsqueeze(1))
        recipe_metrics["response/truncated_fraction"] = cut.mean().item()
    if use_reference:
        with timer("reference"):
            ref = (  # (S, L-1)
                run.forward_tokens("reference", data, scored_only=True)
                if "reference" in cfg.models
                # LoRA: adapters off
                else run.forward_tokens("policy_trainer", data, base=True, scored_only=True)
            )
            data = data.replace(ref_logprobs=ref)
    teacher = None
    if "teacher" in cfg.models:  # on-policy distillation (recipe/distill.py)
        with timer("teacher"):
            teacher = run.forward_tokens("teacher", data, scored_only=True)
    if algo.old_logprobs == "rollout":
        # the sampling weights' log-probs, as the engine computed them
        data = data.replace(old_logprobs=batch.infer_logprobs)
    else:
        with timer("old_logprobs"):
            # the weights the engine sampled with
            old = run.forward_tokens("policy_trainer", data, scored_only=True)
            data = data.replace(old_logprobs=old)
    data, correction_metrics = rollout_correction(algo, data, batch.infer_logprobs)
    recipe_metrics.update(correction_metrics)
    shaped, shaping_metrics = shaped_rewards(cfg, batch, rewards)
    recipe_metrics.update(shaping_metrics)
    # what the estimator sees beside the batch
    extras = {**gdpo.with_terms(batch, rewards, shaped), **(extras or {})}
    if teacher is not None:
        extras["teacher_logprobs"] = teacher
        recipe_metrics["distill/reverse_kl"] = distill.reverse_kl(
            data.old_logprobs, teacher, batch.loss_mask
        )
    if "reward_terms" in extras and algo.advantage_estimator == "gdpo":  # each term's signal
        recipe_metrics.update(
            gdpo.term_metrics(
                extras["reward_terms"],
                n,
                algo.normalize_advantage_std,
                extras.get("reward_shaping"),
            )
        )
    # (S,) or (S, L-1)
    adv = advantages(algo, shaped, n, data, batch.loss_mask, extras)
    data = data.replace(advantages=adv).check()
    with timer("train"):
        # whole groups per step (when they fit): a micro-batch then holds a prompt's samples
        # together, and the trainer runs that prompt once for all of them (shared-prefix packing,
        # MegatronConfig.pack_shared_prefix)
        group = n if cfg.runtime.train_global_batch_size % n == 0 else 1
        steps = run.train("policy_trainer", data, loss_fn, group_size=group, per_step=True)
    stats = reduce_metrics(steps)
    if sync:
        with timer("sync"):
            run.sync_policy()
    weights = data.is_weights
    if weights is not None and weights.dim() == 1:  # per sequence: on each of its tokens
        weights = weights.unsqueeze(1).expand_as(batch.loss_mask)
    metrics = {
        **sample_metrics(rewards, batch, data.old_logprobs, cfg.runtime.solved_reward, weights),
        **prefixed("policy", stats),
        **recipe_metrics,
        # steps without any signal (every group of the step all-equal)
        "policy/zero_grad_steps": sum(step.get("grad_norm") == 0.0 for step in steps),
    }
    if current_version is not None and algo.old_logprobs == "recompute":  # not the staleness
        for key in MISMATCH_KEYS:
            del metrics[key]
        metrics.update(
            on_policy_mismatch(
                data.old_logprobs,
                batch.infer_logprobs,
                batch.loss_mask,
                batch.weight_versions,
                current_version,
            )
        )
    metrics["reward/zero_variance_groups"] = zero_variance_groups(rewards, n, run.log)
    # old == infer: the mismatch is what the first step saw before updating
    if algo.old_logprobs == "rollout":
        del metrics["mismatch/logprob_max_abs"], metrics["mismatch/logprob_mean_abs"]
        # (off-policy: and updates)
        if not (algo.overlap_generation or current_version is not None):
            metrics["mismatch/logprob_max_abs"] = steps[0]["old_logprob_diff_max"]
    if use_reference:
        metrics["kl/reference"] = L.masked_mean(
            L.kl_estimate(data.old_logprobs, data.ref_logprobs, algo.kl_estimator),
            batch.loss_mask,
        ).item()
    return metrics


def sample_full_groups(run, batch, rewards, n: int):
    """DAPO's dynamic sampling: drop the groups of `batch` whose (shaped) rewards are all equal
    and generate more prompts' groups until the batch has its P groups again, for at most
    dynamic_sampling_max_rounds extra rounds; a batch still short is filled with dropped groups.
    Returns (batch, rewards, metrics)."""
    algo, pc = run.cfg.runtime.algorithm, run.cfg.models["policy"].config
    wanted = len(batch) // n
    kept, dropped, rounds = [], [], 0
    while True:
        flat = equal_reward_groups(shaped_rewards(run.cfg, batch, rewards)[0], n)
        for g, flat_group in enumerate(flat.tolist()):
            (dropped if flat_group else kept).append((batch, rewards, g))
        if len(kept) >= wanted or rounds == algo.dynamic_sampling_max_rounds:
            break
        rounds += 1
        with run.timer("generate"):
            batch = run.generate(run.next_prompts())
        with run.timer("reward"):
            rewards = run.score(batch)
    chosen = (kept + dropped)[:wanted]  # kept groups first; dropped ones when the rounds ran out
    parts = [
        (b.select(torch.arange(g * n, (g + 1) * n)), r[g * n : (g + 1) * n]) for b, r, g in chosen
    ]
    out_batch = RolloutBatch.concat([b for b, _ in parts], pc.pad_token_id or 0)
    out_batch.prompt_index = torch.arange(wanted).repeat_interleave(n)  # unique again, in order
    out_rewards = torch.cat([r for _, r in parts])
    metrics = {
        "dynamic_sampling/dropped_groups": len(dropped),
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/extra_generations": rounds * wanted * n,
        "dynamic_sampling/unfilled_groups": max(0, wanted - len(kept)),
    }
    return out_batch, out_rewards, metrics
