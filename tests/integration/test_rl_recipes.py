"""Issue 35's recipe options end to end on CPU (real vLLM, megatron-core, the tiny Llama; no Ray).

    python -m pytest tests/integration/test_rl_recipes.py

DAPO-style GRPO at temperature 0.7: after every sync the trainer's log-probs of the sampled tokens
(logits / T) equal the engine's processed log-probs within 1e-4, and dynamic sampling leaves no
optimizer step without a gradient (its cost in dynamic_sampling/*). REINFORCE++ with the KL in the
reward, GSPO's sequence ratio, geometric sequence IS and token rejection: the per-token advantages
and per-sequence weights reach the trainer and the run trains. On-policy distillation: the teacher
scores the student's samples and the reverse KL falls. Top-k / top-p: at top_p 0.9, top_k 20 the
trainer renormalises over the set vLLM kept (chatgen.core.truncation): GRPO on the Megatron and the
fsdp trainer matches the engine after every sync, and so does `chatgen check-sync` with a TP 1 and
(slow) a TP 2 Megatron trainer, whose vocab shards are gathered to decide the set; the untruncated
log-probs of the same tokens are far from the engine's, so the check could fail.
"""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYNC_TOL = 1e-4  # fp32: vLLM vs Megatron log-probs of the same weights differ by ~1e-6


def run_grpo(config, model_dir, data_dir, out_dir, **extra):
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out_dir),
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 100,
        "runtime.save_episode_interval": None,
        "policy.load": model_dir,
        "policy.n": 4,
        "policy_trainer.load": model_dir,
        **extra,
    }
    grpo.train(
        load_config(REPO / config, [f"{k}={'null' if v is None else v}" for k, v in items.items()]),
        log=lambda *_: None,
    )
    return {
        r["episode"]: r
        for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines())
    }


def test_dapo_at_temperature_0_7_matches_engine_and_leaves_no_zero_gradient_step(
    tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    metrics = run_grpo(
        "configs/dapo_tiny.yaml",
        tiny_llama_dir,
        data_dir,
        tmp_path / "dapo",
        **{
            "runtime.num_episode": 3,
            "runtime.algorithm.old_logprobs": "recompute",  # a trainer pass to compare
            "policy.temperature": 0.7,
            "policy.logprobs_mode": "processed",
        },
    )
    for episode in (1, 2, 3):
        m = metrics[episode]
        # the trainer scored logits / 0.7, as the engine sampled (untempered: a gap of ~0.1 or more)
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL, m
        assert m["policy/zero_grad_steps"] == 0 and m["policy/grad_norm"] > 0
        assert m["dynamic_sampling/unfilled_groups"] == 0
        assert m["dynamic_sampling/extra_generations"] == 32 * m["dynamic_sampling/rounds"]
        assert m["policy/entropy"] > 0 and "reward/overlong_penalty" in m
    # it had work to do
    assert sum(metrics[e]["dynamic_sampling/dropped_groups"] for e in (1, 2, 3)) > 0


def test_reinforce_pp_gspo_and_rollout_correction_train(
    tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    metrics = run_grpo(
        "configs/reinforce_pp_tiny.yaml",
        tiny_llama_dir,
        data_dir,
        tmp_path / "rpp",
        **{
            "runtime.num_episode": 1,
            "reference.load": tiny_llama_dir,
            "runtime.algorithm.ratio_level": "sequence",
            "runtime.algorithm.importance_sampling_cap": 2.0,
            "runtime.algorithm.importance_sampling_level": "geometric",
            "runtime.algorithm.rejection_level": "token",
            "runtime.algorithm.old_logprobs": "recompute",
        },
    )
    m = metrics[1]
    assert m["policy/grad_norm"] > 0 and m["kl/reference"] == pytest.approx(0.0, abs=1e-4)
    assert m["rollout_correction/masked_token_fraction"] == 0.0  # exact sync: no outliers to mask
    assert m["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_opd_student_moves_towards_the_teacher(
    ray_session, tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    """On-policy distillation: a tiny Llama after 4 SFT steps (the student) learns from the same
    model after 20 (the teacher, one tokenizer); the per-token reverse KL falls. Its teacher is a
    group of its own: the run's actors on the session's Ray (tests/integration/conftest.py)."""
    from helpers import quick_warm_start

    from chatgen.core.jsonl import read_prompt_records

    monkeypatch.chdir(REPO)
    sft = read_prompt_records(data_dir / "sft.jsonl")
    teacher = quick_warm_start(tiny_llama_dir, sft, tmp_path / "teacher", steps=20)
    student = quick_warm_start(tiny_llama_dir, sft, tmp_path / "student", steps=4)
    metrics = run_grpo(
        "configs/grpo_tiny.yaml",
        student,
        data_dir,
        tmp_path / "opd",
        **{
            "runtime.num_episode": 6,
            "runtime.algorithm.advantage_estimator": "opd",
            "runtime.algorithm.kl_coef": 0.0,
            "models.teacher.backend": "megatron",
            "models.teacher.trainable": "false",
            "teacher.load": teacher,
            "policy_trainer.lr": 2e-3,
        },
    )
    kl = [metrics[e]["distill/reverse_kl"] for e in range(1, 7)]
    assert kl[0] > 0.1, kl  # the student's tokens are less likely under the teacher
    assert kl[-1] < 0.8 * kl[0], kl
    assert all(metrics[e]["policy/grad_norm"] > 0 for e in range(1, 7))


TRUNCATED = {
    "policy.temperature": 1.0,
    "policy.top_p": 0.9,
    "policy.top_k": 20,
    "policy.logprobs_mode": "processed",
    "runtime.algorithm.old_logprobs": "recompute",  # a trainer pass to compare
}


@pytest.mark.parametrize("config", ["configs/grpo_tiny.yaml", "configs/grpo_tiny_fsdp.yaml"])
def test_grpo_at_top_p_and_top_k_matches_the_engine_after_every_sync(
    config, tiny_llama_dir, data_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    metrics = run_grpo(
        config,
        tiny_llama_dir,
        data_dir,
        tmp_path / "run",
        **TRUNCATED,
        **{"runtime.num_episode": 3},
    )
    for episode in (1, 2, 3):
        m = metrics[episode]
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL, m


def check_sync(model_dir, tmp_path, *flags):
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    lines = [[1, 5, 9, 14], [1, 20, 30, 40, 50, 60], [1, 7]]
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in lines))
    out = tmp_path / "check.json"
    rc = main(
        ["check-sync", "--hf-checkpoint", str(model_dir), "--input", str(prompts)]
        + ["--output", str(out), "--max-new-tokens", "16", "--temperature", "1.0"]
        + ["--top-p", "0.9", "--top-k", "20", *flags]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["max_abs_logprob_diff"] < SYNC_TOL, result
    # the same tokens under the whole distribution: far from what the engine reported
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gap = 0.0
    for s in result["samples"]:
        ids = torch.tensor([s["prompt_ids"] + s["output_ids"]])
        with torch.no_grad():
            whole = model(ids).logits[0, :-1].log_softmax(-1)[len(s["prompt_ids"]) - 1 :]
        whole = whole.gather(1, torch.tensor(s["output_ids"])[:, None])[:, 0]
        gap = max(gap, (whole - torch.tensor(s["engine_logprobs"])).abs().max().item())
    assert gap > 0.1


def test_check_sync_at_top_p_and_top_k(tiny_llama_dir, tmp_path):
    check_sync(tiny_llama_dir, tmp_path)


@pytest.mark.slow  # ~3 min here: two trainer ranks start in processes of their own
def test_check_sync_at_top_p_and_top_k_with_a_tp2_trainer(tiny_llama_dir, tmp_path):
    check_sync(tiny_llama_dir, tmp_path, "--train-tp", "2")
