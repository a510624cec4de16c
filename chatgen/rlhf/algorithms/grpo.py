"""GRPO (Group Relative Policy Optimization, DeepSeekMath): the algorithm, its config section and its loop.

    chatgen train configs/grpo_tiny.yaml            # runtime.algorithm.name: grpo

Each episode: take sample_per_episode / n prompts; the policy (vLLM) samples n responses to each; the reward
model scores them; each response's advantage is its reward relative to the other responses to the same prompt;
the trainer (Megatron) takes clipped policy-gradient steps (with a KL penalty to the reference when kl_coef > 0);
the new weights are synced into vLLM; then checkpoint, eval and log. docs/rlhf_engine.md has the details.
With overlap_generation the next episode's samples are generated while the trainer trains (one step off-policy).
The recipes of 2025-26 are keys of this section, not algorithms of their own: Dr. GRPO, RLOO and
REINFORCE++ advantages, clip-higher, dual clip, GSPO's sequence ratio, loss aggregation, entropy
bonus, DAPO's dynamic sampling and overlong shaping, rollout correction (docs/algorithms.md).
"""

import concurrent.futures
import dataclasses
import time
from functools import partial
from typing import Literal, Optional

import torch

from chatgen.config import opt
from chatgen.core.metrics import reduce_metrics
from chatgen.core.rollout import RolloutBatch
from chatgen.rlhf import losses as L
from chatgen.rlhf.config import AlgorithmConfig, Role, policy_sampling_problems
from chatgen.rlhf.health import equal_reward_groups, zero_variance_groups
from chatgen.rlhf.metrics import prefixed, sample_metrics
from chatgen.rlhf.run import Run


@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    kl_coef: float = opt(
        0.0,
        "weight of the KL(policy, reference) penalty in the loss; 0 = none (a reference model, "
        "if configured, then only reports kl/reference)",
    )
    clip_eps: float = opt(
        0.2, "PPO ratio clip: ratios outside [1 - clip_eps, 1 + clip_eps] are clipped"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k3", "KL estimator (Schulman's k1/k2/k3) of the penalty"
    )
    importance_sampling_cap: Optional[float] = opt(
        None,
        "truncated importance weight cap for the train/inference mismatch (e.g. 2.0); null = off",
    )
    old_logprobs: Literal["recompute", "rollout"] = opt(
        "recompute",
        "where the ratio's old log-probs come from: recompute = a no-grad trainer pass before training "
        "(mismatch/* metrics compare it with the engine's); rollout = the engine's own log-probs of the "
        "sampled tokens, saving that pass (exact here: the sync is exact, so they equal the trainer's to "
        "float noise; mismatch/* is then measured in the first optimizer step)",
    )
    overlap_generation: bool = opt(
        False,
        "one-step off-policy: sample episode k+1 (with the weights before episode k's update) while the "
        "trainer trains on episode k; the new weights reach the engine when both are done. Needs "
        "importance_sampling_cap or old_logprobs: rollout to correct for the stale samples",
    )
    # --- recipes (docs/algorithms.md: each key's formula, paper, and verl's / TRL's name for it)
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = opt(
        "grpo",
        "grpo: reward minus its group's mean (over the group's std when "
        "normalize_advantage_std); rloo: minus the mean of the group's other samples; "
        "reinforce_pp: REINFORCE++, each token's return (with the KL penalty in it when "
        "kl_in_reward) whitened over the batch",
    )
    normalize_advantage_std: bool = opt(
        True, "grpo: divide by the group's reward std; false = Dr. GRPO (no difficulty bias)"
    )
    kl_in_reward: bool = opt(
        False,
        "reinforce_pp: put the kl_coef * KL penalty into the token rewards (REINFORCE++) "
        "instead of the loss",
    )
    clip_eps_low: Optional[float] = opt(None, "lower ratio clip 1 - clip_eps_low; null = clip_eps")
    clip_eps_high: Optional[float] = opt(
        None,
        "upper ratio clip 1 + clip_eps_high; null = clip_eps; above clip_eps_low: DAPO's "
        "clip-higher",
    )
    dual_clip: Optional[float] = opt(
        None,
        "dual clip c > 1: a token with a negative advantage A loses at most -c * A; null = off",
    )
    ratio_level: Literal["token", "sequence"] = opt(
        "token",
        "token: one importance ratio per token (PPO/GRPO); sequence: GSPO's "
        "length-normalised sequence ratio, clipped per sequence (clip_eps_low/high "
        "around 3e-4/4e-4)",
    )
    loss_aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = opt(
        "token_mean",
        "token losses -> the loss: token_mean (all tokens of the batch; DAPO), "
        "seq_mean_token_mean (GRPO paper, GSPO), seq_mean_token_sum, "
        "seq_mean_token_sum_norm (token sums / loss_norm_length: Dr. GRPO)",
    )
    loss_norm_length: Optional[int] = opt(
        None, "the constant of seq_mean_token_sum_norm; null = the policy's max_new_tokens"
    )
    entropy_coef: float = opt(
        0.0,
        "entropy bonus: the loss subtracts entropy_coef times the policy's entropy "
        "(sampled-token estimate); 0 = off. policy/entropy is logged either way",
    )
    dynamic_sampling: bool = opt(
        False,
        "DAPO's dynamic sampling: drop the groups whose rewards are all equal (no "
        "gradient) and sample more prompts until the batch is full again",
    )
    dynamic_sampling_max_rounds: int = opt(
        4,
        "extra generation rounds per episode at most (dynamic_sampling); a batch still short "
        "is filled with dropped groups (dynamic_sampling/unfilled_groups)",
    )
    overlong_buffer_length: Optional[int] = opt(
        None,
        "DAPO's soft overlong punishment: a response within this many tokens of "
        "max_new_tokens loses up to overlong_penalty_factor of reward, linearly; null = off",
    )
    overlong_penalty_factor: float = opt(1.0, "the largest overlong penalty (at max_new_tokens)")
    mask_truncated: bool = opt(
        False,
        "leave responses cut at the token limit (finish_reason length) out of the loss "
        "(DAPO's overlong filtering)",
    )
    importance_sampling_level: Literal["token", "sequence", "geometric"] = opt(
        "token",
        "importance_sampling_cap's weights: per token; per sequence (the product of its "
        "token ratios); or per sequence as their geometric mean",
    )
    rejection_level: Optional[Literal["token", "sequence"]] = opt(
        None,
        "mask train/inference outliers out of the loss: tokens (token) or whole sequences "
        "(sequence, by the geometric-mean ratio) whose ratio pi_train / pi_infer is outside "
        "[rejection_low, rejection_high]; null = off",
    )
    rejection_low: float = opt(0.5, "lower ratio bound of rejection_level")
    rejection_high: float = opt(2.0, "upper ratio bound of rejection_level")

    def check(self):
        if self.kl_coef < 0:
            yield "kl_coef", f"must be >= 0, got {self.kl_coef}; use 0 to disable the KL penalty"
        if self.clip_eps <= 0:
            yield "clip_eps", f"must be > 0, got {self.clip_eps}; 0.2 is the usual value"
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1:
            yield (
                "importance_sampling_cap",
                (
                    f"must be >= 1 or null, got {self.importance_sampling_cap}; "
                    "2.0 is usual, null turns the correction off"
                ),
            )
        if (
            self.overlap_generation
            and self.old_logprobs == "recompute"
            and self.importance_sampling_cap is None
        ):
            yield (
                "overlap_generation",
                (
                    "samples one step off-policy, and recomputed old log-probs do not see it; "
                    "set importance_sampling_cap (e.g. 2.0) or old_logprobs: rollout"
                ),
            )
        yield from self.check_recipe()

    def check_recipe(self):
        """The recipe keys' ranges and combinations (docs/algorithms.md)."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        for key in ("clip_eps_low", "clip_eps_high"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                yield key, f"must be > 0 or null, got {getattr(self, key)}; null takes clip_eps"
        if low > 0 and high > 0 and high < low:
            yield (
                "clip_eps_high",
                (
                    f"{high} is below clip_eps_low={low}: clip-higher widens the "
                    "upper bound; set clip_eps_high >= clip_eps_low"
                ),
            )
        if low >= 1:
            yield "clip_eps_low", f"{low} clips ratios below {1 - low} <= 0; use (0, 1), e.g. 0.2"
        if self.dual_clip is not None and self.dual_clip <= 1:
            yield "dual_clip", f"must be > 1 or null, got {self.dual_clip}; 3.0 is usual"
        if (
            self.ratio_level == "sequence"
            and self.importance_sampling_cap is not None
            and self.importance_sampling_level == "token"
        ):
            yield (
                "ratio_level",
                (
                    "sequence (GSPO) with token-level importance_sampling_cap "
                    "weights mixes a sequence ratio with per-token corrections; set "
                    "importance_sampling_level: sequence or geometric (or "
                    "importance_sampling_cap: null)"
                ),
            )
        if self.loss_norm_length is not None and self.loss_norm_length < 1:
            yield "loss_norm_length", f"must be >= 1 or null, got {self.loss_norm_length}"
        if self.entropy_coef < 0:
            yield "entropy_coef", f"must be >= 0, got {self.entropy_coef}; 0 turns the bonus off"
        if self.kl_in_reward and self.advantage_estimator != "reinforce_pp":
            yield (
                "kl_in_reward",
                (
                    f"only reinforce_pp has token rewards to put the KL in "
                    f"(advantage_estimator is {self.advantage_estimator}); set "
                    "kl_in_reward: false or advantage_estimator: reinforce_pp"
                ),
            )
        if not self.normalize_advantage_std and self.advantage_estimator != "grpo":
            yield (
                "normalize_advantage_std",
                (
                    f"is a grpo option; {self.advantage_estimator} never "
                    "divides by the group std: remove the key"
                ),
            )
        if self.dynamic_sampling_max_rounds < 0:
            yield (
                "dynamic_sampling_max_rounds",
                (f"must be >= 0, got {self.dynamic_sampling_max_rounds}"),
            )
        if self.overlong_buffer_length is not None and self.overlong_buffer_length < 1:
            yield (
                "overlong_buffer_length",
                (f"must be >= 1 or null, got {self.overlong_buffer_length}"),
            )
        if (
            self.rejection_level is not None
            and not 0 < self.rejection_low < 1 < self.rejection_high
        ):
            yield (
                "rejection_low",
                (
                    f"[{self.rejection_low}, {self.rejection_high}] must hold 1 "
                    "with rejection_low > 0; e.g. 0.5 and 2.0"
                ),
            )


MODELS = {
    "policy": Role("generation", doc="samples n responses per prompt"),
    "policy_trainer": Role(
        "megatron", trainable=True, syncs_to="policy", doc="the policy's trainable copy"
    ),
    "reward": Role("python", doc="scores the responses (e.g. chatgen.rlhf.rewards:RuleReward)"),
    "reference": Role(
        "megatron",
        trainable=False,
        optional=True,
        doc="frozen initial policy for the KL penalty (needed when kl_coef > 0)",
    ),
}


def lora_reference(cfg) -> bool:
    """Whether the KL reference is the LoRA policy trainer's own base (adapters off): kl_coef > 0, no
    `reference` model, and a policy trainer with `lora.rank` > 0 (docs/lora.md)."""
    trainer = cfg.models.get("policy_trainer")
    lora = getattr(getattr(trainer, "config", None), "lora", None)
    return (
        cfg.runtime.algorithm.kl_coef > 0
        and "reference" not in cfg.models
        and bool(lora and lora.rank)
    )


def check(cfg):
    yield from policy_sampling_problems(cfg)
    pc = cfg.models["policy"].config if "policy" in cfg.models else None
    if pc is not None and pc.n < 2:
        yield "models.policy.n: GRPO compares the n samples of a prompt; set n >= 2"
    algo = cfg.runtime.algorithm
    if algo.kl_coef > 0 and "reference" not in cfg.models and not lora_reference(cfg):
        yield (
            f"runtime.algorithm.kl_coef: {algo.kl_coef} needs a `reference` model (backend: megatron, trainable: "
            "false), or a policy trainer with LoRA (its base is the reference); add one or set kl_coef: 0"
        )
    if algo.kl_in_reward and algo.kl_coef == 0:
        yield (
            "runtime.algorithm.kl_in_reward: true with kl_coef 0 puts no KL in the reward; set "
            "kl_coef > 0"
        )
    if pc is None:
        return
    if algo.dynamic_sampling and pc.n < 2:
        yield (
            "runtime.algorithm.dynamic_sampling: drops groups whose n samples all got the same "
            f"reward, and with models.policy.n = {pc.n} every group is one sample; set n >= 2 "
            "or dynamic_sampling: false"
        )
    if algo.dynamic_sampling and algo.overlap_generation:
        yield (
            "runtime.algorithm.dynamic_sampling: samples until the batch is full, which "
            "overlap_generation cannot hide behind training; set one of them false"
        )
    if algo.dynamic_sampling and getattr(pc, "return_routed_experts", False):
        yield (
            "runtime.algorithm.dynamic_sampling: refilled batches do not carry the recorded "
            "experts (models.policy.return_routed_experts); set one of them false"
        )
    budget = f"models.policy.max_new_tokens ({pc.max_new_tokens})" if pc.new_token_limit else None
    if algo.overlong_buffer_length is not None:
        if budget is None:
            yield (
                "runtime.algorithm.overlong_buffer_length: the penalty counts back from the "
                "token limit; set models.policy.new_token_limit: true and max_new_tokens"
            )
        elif algo.overlong_buffer_length >= pc.max_new_tokens:
            yield (
                f"runtime.algorithm.overlong_buffer_length: {algo.overlong_buffer_length} is "
                f"not below {budget}; make the buffer a part of the budget (DAPO: 4096 of "
                "20480)"
            )
    if (
        algo.loss_aggregation == "seq_mean_token_sum_norm"
        and algo.loss_norm_length is None
        and budget is None
    ):
        yield (
            "runtime.algorithm.loss_norm_length: seq_mean_token_sum_norm divides by a "
            "constant: set it, or models.policy.new_token_limit: true (it then takes "
            "max_new_tokens)"
        )


PHASES = ["generate", "reward", "reference", "old_logprobs", "train", "sync", "checkpoint", "eval"]


def score_at_sampling_temperature(run) -> None:
    """Make the policy's trainer and the reference score logits / T, T the policy's sampling
    temperature: the distribution the engine sampled from and reports log-probs of (logprobs_mode
    processed; rlhf.config's policy_sampling_problems refuses what cannot be matched). Nothing to
    do at T = 1."""
    temperature = run.cfg.models["policy"].config.temperature
    if temperature != 1.0:
        for name in ("policy_trainer", "reference"):
            if name in run.cfg.models:
                run.runtime[name].call("set_logits_temperature", temperature)


def shaped_rewards(algo, batch, rewards, max_new_tokens: int):
    """(S,) rewards the advantages see: the scores plus DAPO's overlong penalty when it is on."""
    if algo.overlong_buffer_length is None:
        return rewards
    return rewards + L.overlong_penalty(
        batch.response_lengths,
        max_new_tokens,
        algo.overlong_buffer_length,
        algo.overlong_penalty_factor,
    )


def advantages(algo, rewards, n: int, data: dict, mask):
    """The advantage estimator: (S,) per sample (grpo, rloo) or (S, L-1) per token (reinforce_pp).
    rewards: (S,); data: old_logprobs and (with kl_in_reward) ref_logprobs, (S, L-1); mask:
    (S, L-1), the response tokens."""
    if algo.advantage_estimator == "rloo":
        return L.rloo_advantages(rewards, n)
    if algo.advantage_estimator == "reinforce_pp":
        kl_coef = algo.kl_coef if algo.kl_in_reward else 0.0
        old = data["old_logprobs"]
        token_rewards = L.kl_shaped_rewards(
            rewards, old, data.get("ref_logprobs", old), mask, kl_coef, algo.kl_estimator
        )
        return L.reinforce_pp_advantages(token_rewards, mask)
    return L.group_advantages(rewards, n, normalize_std=algo.normalize_advantage_std)


def loss_options(cfg) -> dict:
    """policy_loss_fn's keywords for this run's algorithm section."""
    algo, pc = cfg.runtime.algorithm, cfg.models["policy"].config
    options = dict(
        clip_eps=algo.clip_eps,
        kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
        kl_kind=algo.kl_estimator,
    )
    # only what differs from policy_loss's defaults: today's runs call it exactly as before
    token_mean = algo.loss_aggregation == "token_mean"
    recipe = dict(
        clip_eps=algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
        ratio_level=None if algo.ratio_level == "token" else algo.ratio_level,
        loss_aggregation=None if token_mean else algo.loss_aggregation,
        entropy_coef=algo.entropy_coef or None,
    )
    options.update({k: v for k, v in recipe.items() if v is not None})
    if algo.loss_aggregation == "seq_mean_token_sum_norm":
        options["norm_length"] = algo.loss_norm_length or pc.max_new_tokens
    return options


def rollout_correction(algo, data: dict, infer_logprobs) -> dict:
    """Importance weights (data["is_weights"]) and outlier masking (data["loss_mask"]) for the
    train/inference mismatch, from old (data) vs inference log-probs; returns their metrics
    (rollout_correction/*)."""
    old, mask, metrics = data["old_logprobs"], data["loss_mask"], {}
    cap, level = algo.importance_sampling_cap, algo.importance_sampling_level
    if cap and level == "token":
        data["is_weights"] = L.truncated_importance_weights(old, infer_logprobs, cap)
    elif cap:
        data["is_weights"] = L.sequence_importance_weights(
            old, infer_logprobs, mask, cap, geometric=level == "geometric"
        )
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
        data["loss_mask"] = keep
    return metrics


def update(run, batch, rewards, n: int, sync: bool = True) -> dict:
    """GRPO's step once a batch is sampled and scored: reference and old log-probs, rollout
    correction, advantages (runtime.algorithm.advantage_estimator), clipped policy-gradient steps,
    sync into the policy (unless sync=False: the caller syncs later). batch: a RolloutBatch of
    S = prompts x n samples (prompt-major); rewards: (S,). Returns the episode's metrics (rewards,
    mismatch, trainer, KL). Shared by grpo_multiturn."""
    cfg, timer = run.cfg, run.timer
    algo, pc = cfg.runtime.algorithm, cfg.models["policy"].config
    use_reference = "reference" in cfg.models or lora_reference(
        cfg
    )  # (kl_coef 0: kl/reference only)
    loss_fn = partial(L.policy_loss_fn, **loss_options(cfg))
    data, recipe_metrics = batch.trainer_inputs(), {}
    if algo.mask_truncated:  # DAPO's overlong filtering: a cut response says nothing of its end
        cut = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.float32)
        data["loss_mask"] = data["loss_mask"] * (1 - cut).unsqueeze(1)
        recipe_metrics["response/truncated_fraction"] = cut.mean().item()
    if use_reference:
        with timer("reference"):
            data["ref_logprobs"] = (  # (S, L-1)
                run.forward_tokens("reference", data)
                if "reference" in cfg.models
                else run.forward_tokens("policy_trainer", data, base=True)  # LoRA: adapters off
            )
    if algo.old_logprobs == "rollout":
        data["old_logprobs"] = (
            batch.infer_logprobs
        )  # the sampling weights' log-probs, as the engine computed them
    else:
        with timer("old_logprobs"):
            data["old_logprobs"] = run.forward_tokens(
                "policy_trainer", data
            )  # the weights the engine sampled with
    recipe_metrics.update(rollout_correction(algo, data, batch.infer_logprobs))
    shaped = shaped_rewards(algo, batch, rewards, pc.max_new_tokens)
    if shaped is not rewards:
        recipe_metrics["reward/overlong_penalty"] = (shaped - rewards).mean().item()
    data["advantages"] = advantages(algo, shaped, n, data, batch.loss_mask)  # (S,) or (S, L-1)
    with timer("train"):
        # whole groups per step (when they fit): a micro-batch then holds a prompt's samples together, and the
        # trainer runs that prompt once for all of them (shared-prefix packing, MegatronConfig.pack_shared_prefix)
        group = n if cfg.runtime.train_global_batch_size % n == 0 else 1
        steps = run.train("policy_trainer", data, loss_fn, group_size=group, per_step=True)
    stats = reduce_metrics(steps)
    if sync:
        with timer("sync"):
            run.sync_policy()
    weights = data.get("is_weights")
    if weights is not None and weights.dim() == 1:  # per sequence: on each of its tokens
        weights = weights.unsqueeze(1).expand_as(batch.loss_mask)
    metrics = {
        **sample_metrics(rewards, batch, data["old_logprobs"], cfg.runtime.solved_reward, weights),
        **prefixed("policy", stats),
        **recipe_metrics,
        # steps without any signal (every group of the step all-equal)
        "policy/zero_grad_steps": sum(step.get("grad_norm") == 0.0 for step in steps),
    }
    metrics["reward/zero_variance_groups"] = zero_variance_groups(rewards, n, run.log)
    if (
        algo.old_logprobs == "rollout"
    ):  # old == infer: the mismatch is what the first step saw before updating
        del metrics["mismatch/logprob_max_abs"], metrics["mismatch/logprob_mean_abs"]
        if not algo.overlap_generation:  # (one step off-policy, the first step sees the update too)
            metrics["mismatch/logprob_max_abs"] = steps[0]["old_logprob_diff_max"]
    if use_reference:
        metrics["kl/reference"] = L.masked_mean(
            L.kl_estimate(data["old_logprobs"], data["ref_logprobs"], algo.kl_estimator),
            batch.loss_mask,
        ).item()
    return metrics


def sample_full_groups(run, batch, rewards, n: int):
    """DAPO's dynamic sampling: drop the groups of `batch` whose (shaped) rewards are all equal and
    generate more prompts' groups until the batch has its P groups again, for at most
    dynamic_sampling_max_rounds extra rounds; a batch still short is filled with dropped groups.
    Returns (batch, rewards, metrics)."""
    algo, pc = run.cfg.runtime.algorithm, run.cfg.models["policy"].config
    wanted = len(batch) // n
    kept, dropped, rounds = [], [], 0
    while True:
        flat = equal_reward_groups(shaped_rewards(algo, batch, rewards, pc.max_new_tokens), n)
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


def train(cfg, resume=False, log=print) -> dict:
    """Run GRPO as configured; returns the last episode's metrics. Actors are stopped however it ends. resume:
    False, True (the latest checkpoint) or a checkpoint (path or episode directory name)."""
    rt = cfg.runtime
    n = cfg.models["policy"].config.n
    overlap = rt.algorithm.overlap_generation  # one-step off-policy: sample k+1 while training on k
    with (
        Run(cfg, resume, PHASES, log, records_per_episode=rt.sample_per_episode // n) as run,
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chatgen-prefetch") as prefetch,
    ):
        timer, metrics, batch = run.timer, {}, None
        score_at_sampling_temperature(run)
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            if batch is None:
                with timer("generate"):
                    batch = run.generate(
                        run.next_prompts()
                    )  # S = prompts * n samples, prompt-major
            with timer("reward"):
                rewards = run.score(batch)  # (S,)
            sampling = {}
            if rt.algorithm.dynamic_sampling:  # groups with no gradient out, fresh ones in
                batch, rewards, sampling = sample_full_groups(run, batch, rewards, n)
            sampler_state, upcoming = (
                run.sampler.state_dict(),
                None,
            )  # a checkpoint's data position: before k+1
            if (
                overlap and episode < rt.num_episode
            ):  # the engine still holds the weights that sampled `batch`
                upcoming = prefetch.submit(run.generate, run.next_prompts())
            # advantages, old log-probs, train
            metrics = {**update(run, batch, rewards, n, sync=upcoming is None), **sampling}
            batch = None
            if upcoming is not None:
                with timer("generate"):  # what training did not hide
                    batch = upcoming.result()
                with timer("sync"):  # only once the engine is idle
                    run.sync_policy()
            run.end_episode(episode, metrics, start, sampler_state)  # eval, checkpoint, log
    return metrics
