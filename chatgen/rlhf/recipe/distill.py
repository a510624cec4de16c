"""On-policy distillation, the advantage estimator `runtime.algorithm.advantage_estimator: opd`: the
student (the policy) samples, a frozen `teacher` model (backend: megatron, trainable: false) scores
each sampled token, and every token's advantage is its negative reverse-KL estimate, mixed with the
task reward's group advantage when task_reward_coef > 0:

    A_t = -teacher_kl_coef * (log pi_old(y_t) - log pi_teacher(y_t)) + task_reward_coef * A_grpo

The policy loss (ppo_clip by default) then minimises the per-token reverse KL(student || teacher) on
the student's own samples (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025, "On-Policy
Distillation"; verl, NeMo RL, TRL's GKD / GOLD, slime, prime-rl). The teacher's log-probs reach the
estimator as the batch's extra `teacher_logprobs` (grpo's step.update runs the teacher); the mean
of log pi_old - log pi_teacher over the response tokens is logged as distill/reverse_kl. Both models
must share one tokenizer (the log-probs are of the same token ids): run_problems refuses another.
"""

import json
from pathlib import Path

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.advantages import no_kl_in_reward
from chatgen.rlhf.recipe.registry import advantage


def _rules(algo):
    yield from no_kl_in_reward(algo)
    if algo.teacher_kl_coef <= 0:
        yield "teacher_kl_coef", f"must be > 0 with opd, got {algo.teacher_kl_coef}; 1.0 is usual"
    if algo.task_reward_coef < 0:
        yield "task_reward_coef", f"must be >= 0, got {algo.task_reward_coef}; 0 = distill only"


@advantage("opd", check=_rules)
def opd(rewards, n, batch, algo):
    """(S, L-1) per-token advantages of on-policy distillation (module docstring)."""
    teacher, mask = batch.extras.get("teacher_logprobs"), batch.loss_mask
    if teacher is None:
        raise ValueError(
            "runtime.algorithm.advantage_estimator: opd needs the teacher's log-probs: add a "
            "`teacher` model (backend: megatron, trainable: false)"
        )
    adv = -algo.teacher_kl_coef * (batch.old_logprobs - teacher)
    if algo.task_reward_coef:
        task = L.group_advantages(rewards, n, normalize_std=algo.normalize_advantage_std)
        adv = adv + algo.task_reward_coef * task.unsqueeze(1)
    return adv * mask


def reverse_kl(old_logprobs, teacher_logprobs, mask) -> float:
    """distill/reverse_kl: mean log pi_old - log pi_teacher over the response tokens (k1)."""
    return L.masked_mean(old_logprobs - teacher_logprobs, mask).item()


def _vocabulary(directory):
    """What identifies a tokenizer's token ids in an HF directory: tokenizer.json's model and
    added tokens, else tokenizer.model's bytes; None when it holds neither."""
    d = Path(directory)
    if (d / "tokenizer.json").exists():
        data = json.loads((d / "tokenizer.json").read_text())
        return json.dumps([data.get("model"), data.get("added_tokens")], sort_keys=True)
    if (d / "tokenizer.model").exists():
        return (d / "tokenizer.model").read_bytes()
    return None


def tokenizer_problem(student_dir, teacher_dir) -> str | None:
    """Why the teacher at `teacher_dir` cannot score the student's tokens (None: same tokenizer)."""
    student, teacher = _vocabulary(student_dir), _vocabulary(teacher_dir)
    if teacher is None:
        return (
            f"models.teacher: {teacher_dir} holds no tokenizer (tokenizer.json or "
            "tokenizer.model) to compare with the student's; load the teacher from an HF "
            "directory with its tokenizer (a Megatron checkpoint: `chatgen convert` it to HF)"
        )
    if student is not None and student != teacher:
        return (
            f"models.teacher: its tokenizer ({teacher_dir}) is not the policy's ({student_dir}): "
            "on-policy distillation compares the two models' log-probs of the same token ids; "
            "use a teacher with the student's tokenizer (same vocabulary and added tokens)"
        )
    return None


def run_problems(cfg):
    """The teacher and the estimator need each other; the teacher shares the student's tokenizer."""
    algo = cfg.runtime.algorithm
    wants, has = algo.advantage_estimator == "opd", "teacher" in cfg.models
    if wants and not has:
        yield (
            "runtime.algorithm.advantage_estimator: opd needs a `teacher` model (backend: "
            "megatron, trainable: false, its config's load: the teacher checkpoint); add one"
        )
    if has and not wants:
        yield (
            "models.teacher: only advantage_estimator: opd reads the teacher; set it, or "
            "remove the teacher"
        )
    if not (wants and has and "policy" in cfg.models):
        return
    pc, tc = cfg.models["policy"].config, cfg.models["teacher"].config
    student, teacher = pc.tokenizer or pc.load, getattr(tc, "load", None)
    if student and teacher and Path(teacher).is_dir():
        problem = tokenizer_problem(student, teacher)
        if problem:
            yield problem
