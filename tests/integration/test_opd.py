"""On-policy distillation end to end on CPU (real vLLM, megatron-core, no Ray): a tiny Llama after 4
SFT steps (the student) learns from the same model after 20 (the teacher: one tokenizer, it writes
digits); the teacher scores the student's samples, the per-token reverse KL reaches the loss, and it
falls over a few episodes.

    python -m pytest tests/integration/test_opd.py
"""

import pytest
from test_rl_recipes import REPO, run_grpo

pytestmark = pytest.mark.integration


def test_opd_student_moves_towards_the_teacher(tiny_llama_dir, data_dir, tmp_path, monkeypatch):
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
