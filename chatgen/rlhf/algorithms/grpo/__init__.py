"""GRPO (Group Relative Policy Optimization, DeepSeekMath): the algorithm, its config section and
its loop.

    chatgen train configs/grpo_tiny.yaml            # runtime.algorithm.name: grpo

Each episode: take sample_per_episode / n prompts; the policy (vLLM) samples n responses to each;
the reward model scores them; each response's advantage is its reward relative to the other
responses to the same prompt; the trainer (Megatron) takes clipped policy-gradient steps (with a KL
penalty to the reference when kl_coef > 0); the new weights are synced into vLLM; then checkpoint,
eval and log. docs/rlhf_engine.md has the details. The step after sampling (advantages, old
log-probs, train, sync) is step.py's; the loop, loop.py's. With overlap_generation the next
episode's samples are generated while the trainer trains (one step off-policy). The recipes of
2025-26 are keys of this section, not algorithms of their own: Dr. GRPO, RLOO and REINFORCE++
advantages, clip-higher, dual clip, GSPO's sequence ratio, loss aggregation, entropy bonus, DAPO's
dynamic sampling and overlong shaping, rollout correction (docs/algorithms.md).
"""

import dataclasses
from typing import Literal, Optional

from chatgen.config import opt
from chatgen.rlhf import recipe
from chatgen.rlhf.algorithms.grpo import loop, replay
from chatgen.rlhf.algorithms.grpo.step import lora_reference
from chatgen.rlhf.checks import policy_sampling_problems
from chatgen.rlhf.recipe import distill
from chatgen.rlhf.schema import POLICY_TRAINER, AlgorithmConfig, Role


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
    advantage_estimator: str = opt(
        "grpo",
        "a registered estimator (chatgen.rlhf.recipe.advantage) or 'module:function'; "
        "grpo: reward minus its group's mean (over the group's std when "
        "normalize_advantage_std); rloo: minus the mean of the group's other samples; "
        "reinforce_pp: REINFORCE++, each token's return (with the KL penalty in it when "
        "kl_in_reward) whitened over the batch; gdpo: each reward term (Rewards' terms:) "
        "normalised in its group, then the weighted sum whitened over the batch",
    )
    teacher_kl_coef: float = opt(
        1.0,
        "opd: weight of the per-token reverse KL to the `teacher` in the advantage, "
        "A_t -= coef * (log pi(y_t) - log pi_teacher(y_t))",
    )
    task_reward_coef: float = opt(
        0.0,
        "opd: weight of the task reward's group advantage (grpo's) added to every token; "
        "0 = distillation only",
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
    ratio_level: str = opt(
        "token",
        "a registered ratio (chatgen.rlhf.recipe.ratio) or 'module:function'; token: one importance ratio per token (PPO/GRPO); sequence: GSPO's "
        "length-normalised sequence ratio, clipped per sequence (clip_eps_low/high "
        "around 3e-4/4e-4)",
    )
    policy_loss: str = opt(
        "ppo_clip",
        "the per-token loss, a registered policy loss (chatgen.rlhf.recipe.policy_loss) or "
        "'module:function': ppo_clip (PPO's clipped surrogate); cispo (clipped, detached IS "
        "weight on the REINFORCE term); sapo (a soft sigmoid gate, no hard clip); gmpo (the "
        "geometric mean of the token ratios, clipped in log space). TRL: loss_type; verl: "
        "policy_loss.loss_mode",
    )
    sapo_temperature_pos: float = opt(1.0, "sapo: the gate's temperature where A > 0")
    sapo_temperature_neg: float = opt(1.05, "sapo: the gate's temperature where A <= 0")
    loss_aggregation: str = opt(
        "token_mean",
        "token losses -> the loss, a registered aggregation (chatgen.rlhf.recipe.aggregation) "
        "or 'module:function': token_mean (all tokens of the batch; DAPO), "
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
    length_penalty_coef: Optional[float] = opt(
        None,
        "Kimi k1.5's group length penalty: reward += coef * (0.5 - (len - min) / (max - min)) "
        "over the response's group for a correct response (reward >= runtime.solved_reward), "
        "and coef * min(0, that) for a wrong one; null = off",
    )
    stop_properly_penalty_coef: Optional[float] = opt(
        None,
        "ProRL's stop-properly penalty: a response cut at the token limit (finish_reason "
        "length) keeps this share of a positive reward (0 = none of it); null = off",
    )
    mask_truncated: bool = opt(
        False,
        "leave responses cut at the token limit (finish_reason length) out of the loss "
        "(DAPO's overlong filtering)",
    )
    importance_sampling_level: str = opt(
        "token",
        "importance_sampling_cap's weights, a registered correction (chatgen.rlhf.recipe."
        "correction) or 'module:function': per token; per sequence (the product of its "
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
    # --- a replay of informative groups (replay.py)
    replay_buffer_size: int = opt(
        0,
        "replace each zero-variance group (all n rewards equal) by a stored group of a recent "
        "episode with the highest reward std; this many groups are kept; 0 = off (TRL: "
        "GRPOWithReplayBufferTrainer, replay_buffer_size)",
    )
    replay_max_age: int = opt(
        4, "replay_buffer_size: a stored group older than this many episodes is forgotten"
    )
    # --- fully asynchronous RL (loop.py, docs/async_rl.md)
    max_staleness: Optional[int] = opt(
        None,
        "generate ahead of the trainer: no trained token comes from weights more than this many "
        "versions older than the trainer's (0 = synchronous, 1 = one step off-policy, 2 is usual); "
        "weights reach the engine after each update with requests in flight (partial rollouts); "
        "null = the loop of overlap_generation (AReaL: max_head_offpolicyness)",
    )
    stale_samples: Literal["drop", "regenerate"] = opt(
        "drop",
        "max_staleness: a group past the bound is left out of the loss (drop) or generated "
        "again with the current weights (regenerate); counted as async/stale_groups",
    )
    handover_step: Optional[int] = opt(
        None,
        "max_staleness >= 2, in process: a batch generating ahead of the trainer's next one takes "
        "this many engine steps under the weights it started with, then waits for the next "
        "weights when nothing else generates (partial rollouts by construction: the rest of its "
        "tokens is a version fresher); null = it runs on under the old weights",
    )

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
        yield from loop.check_keys(self)
        yield from replay.check_keys(self)

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
        for registry in (
            recipe.advantage,
            recipe.ratio,
            recipe.aggregation,
            recipe.correction,
            recipe.policy_loss,
        ):
            value = getattr(self, registry.key)
            problem = registry.problem(value)
            if problem:
                yield registry.key, problem
            else:
                yield from registry.rules(value, self)
        if self.loss_norm_length is not None and self.loss_norm_length < 1:
            yield "loss_norm_length", f"must be >= 1 or null, got {self.loss_norm_length}"
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, key) <= 0:
                yield key, f"must be > 0, got {getattr(self, key)}; SAPO uses 1.0 and 1.05"
        if self.entropy_coef < 0:
            yield "entropy_coef", f"must be >= 0, got {self.entropy_coef}; 0 turns the bonus off"
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
        if self.length_penalty_coef is not None and self.length_penalty_coef < 0:
            yield (
                "length_penalty_coef",
                f"must be >= 0 or null, got {self.length_penalty_coef}; Kimi k1.5 uses 1 "
                "with 0/1 rewards",
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and not 0 <= coef <= 1:
            yield (
                "stop_properly_penalty_coef",
                f"is the share of the reward a cut response keeps: in [0, 1] or null, got {coef}",
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
    "policy_trainer": POLICY_TRAINER,
    "reward": Role("python", doc="scores the responses (e.g. chatgen.rlhf.rewards:RuleReward)"),
    "reference": Role(
        "megatron",
        trainable=False,
        optional=True,
        scores_samples=True,
        doc="frozen initial policy for the KL penalty (needed when kl_coef > 0)",
    ),
    "teacher": Role(
        "megatron",
        trainable=False,
        optional=True,
        scores_samples=True,
        doc="on-policy distillation's teacher: scores the student's tokens (advantage_estimator: "
        "opd); the student's tokenizer",
    ),
}


def check(cfg):
    yield from policy_sampling_problems(cfg)
    pc = cfg.models["policy"].config if "policy" in cfg.models else None
    if pc is not None and pc.n < 2:
        yield "models.policy.n: GRPO compares the n samples of a prompt; set n >= 2"
    algo = cfg.runtime.algorithm
    yield from loop.check_run(cfg)
    yield from distill.run_problems(cfg)
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
    if algo.length_penalty_coef and cfg.runtime.solved_reward is None:
        yield (
            "runtime.algorithm.length_penalty_coef: tells correct from wrong responses by "
            "runtime.solved_reward, which is null; set it (e.g. 1.0) or length_penalty_coef: null"
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


PHASES = [
    "generate",
    "reward",
    "reference",
    "teacher",
    "old_logprobs",
    "train",
    "sync",
    "checkpoint",
    "eval",
]


def train(cfg, resume=False, log=print) -> dict:
    """Run GRPO as configured; returns the last episode's metrics. Actors are stopped however it
    ends. resume: False, True (the latest checkpoint) or a checkpoint (path or episode directory
    name). One loop for every schedule: synchronous, overlap_generation (one step ahead) and
    max_staleness k (chatgen.rlhf.algorithms.grpo.loop)."""
    return loop.train(cfg, resume, log, PHASES)
