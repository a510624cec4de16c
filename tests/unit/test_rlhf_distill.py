"""On-policy distillation (advantage_estimator: opd, chatgen.rlhf.recipe.distill) against hand-computed
values: per-token advantages -(log pi_old - log pi_teacher), mixed with the task reward's group
advantage; the loss's gradient is the reverse KL's; a teacher with another tokenizer, or none, or an
opd run without a teacher is refused naming the key and the fix.

    pytest tests/unit/test_rlhf_distill.py
"""

import json
import textwrap

import pytest
import torch
from helpers import policy_loss

from chatgen.core.train_batch import TrainBatch
from chatgen.rlhf.algorithms.grpo import Config, check
from chatgen.rlhf.recipe import advantage, distill

OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
TEACHER = torch.tensor([[-0.5, -2.5, 9.0], [-0.5, -1.5, -0.1]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def _batch():
    return TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        loss_mask=MASK,
        old_logprobs=OLD,
        extras={"teacher_logprobs": TEACHER},
    )


def test_opd_advantages_by_hand():
    algo = Config(name="grpo", advantage_estimator="opd")
    adv = advantage.get("opd")(torch.tensor([1.0, 0.0]), 2, _batch(), algo)
    # -(old - teacher) on response tokens: [0.5, -0.5, 0], [0, -1.0, 0.4]
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, 0.0], [0.0, -1.0, 0.4]]))
    mixed = Config(
        name="grpo", advantage_estimator="opd", teacher_kl_coef=2.0, task_reward_coef=0.5
    )
    adv = advantage.get("opd")(torch.tensor([1.0, 0.0]), 2, _batch(), mixed)
    # task: group [1, 0] -> +-1/sqrt(2) (unbiased std), times 0.5, on every response token
    h = 0.5 / 2**0.5
    expected = torch.tensor([[1.0 + h, -1.0 + h, 0.0], [0.0 - h, -2.0 - h, 0.8 - h]])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert distill.reverse_kl(OLD, TEACHER, MASK) == pytest.approx((-0.5 + 0.5 + 0 + 1.0 - 0.4) / 5)


def test_the_loss_descends_the_reverse_kl():
    """On policy (ratio 1) the loss's gradient is (log pi - log pi_teacher) / N per token: a token the
    student likes more than the teacher loses probability."""
    algo = Config(name="grpo", advantage_estimator="opd")
    adv = advantage.get("opd")(torch.zeros(2), 2, _batch(), algo)
    logp = OLD.clone().requires_grad_()
    loss, _ = policy_loss(logp, OLD, adv, MASK)
    loss.backward()
    assert torch.allclose(logp.grad, (OLD - TEACHER) * MASK / 5)


def test_opd_without_teacher_logprobs_names_the_fix():
    algo = Config(name="grpo", advantage_estimator="opd")
    with pytest.raises(ValueError, match="`teacher` model"):
        advantage.get("opd")(torch.zeros(2), 2, _batch().replace(extras={}), algo)


def _tokenizer(path, vocab, truncation=None):
    path.mkdir(parents=True, exist_ok=True)
    data = {"truncation": truncation, "added_tokens": [], "model": {"type": "BPE", "vocab": vocab}}
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


def test_tokenizers_compare_by_vocabulary(tmp_path):
    student = _tokenizer(tmp_path / "s", {"a": 0, "b": 1})
    same = _tokenizer(tmp_path / "t1", {"a": 0, "b": 1}, truncation={"max_length": 8})
    other = _tokenizer(tmp_path / "t2", {"a": 0, "c": 1})
    assert distill.tokenizer_problem(student, same) is None  # settings differ, ids do not
    assert "is not the policy's" in distill.tokenizer_problem(student, other)
    (tmp_path / "bare").mkdir()
    assert "holds no tokenizer" in distill.tokenizer_problem(student, tmp_path / "bare")


@pytest.fixture
def main_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    _tokenizer(tmp_path / "student", {"a": 0, "b": 1})
    _tokenizer(tmp_path / "teacher_same", {"a": 0, "b": 1})
    _tokenizer(tmp_path / "teacher_other", {"x": 0, "b": 1})
    (tmp_path / "policy.yaml").write_text("load: student\nn: 4\n")
    (tmp_path / "trainer.yaml").write_text("load: student\n")
    main = tmp_path / "main.yaml"
    main.write_text(
        textwrap.dedent(
            """
            runtime:
              sample_per_episode: 16
              data_path: train.jsonl
              algorithm: {name: grpo}
            models:
              policy: {backend: vllm, model_config_file: policy.yaml}
              policy_trainer: {backend: megatron, trainable: true, model_config_file: trainer.yaml}
              reward: {backend: python, model_class: "chatgen.rlhf.rewards:RuleReward"}
            """
        )
    )
    return main


def _problems(main_yaml, teacher=None, estimator="opd"):
    from chatgen.rlhf.config import load_config

    items = [f"runtime.algorithm.advantage_estimator={estimator}"]
    if teacher:
        items += [
            "models.teacher.backend=megatron",
            "models.teacher.trainable=false",
            f"teacher.load={teacher}",
        ]
    return [p for p in check(load_config(main_yaml, items)) if "teacher" in p]


def test_the_run_checks_name_the_key_and_the_fix(main_yaml):
    assert _problems(main_yaml, "teacher_same") == []
    (problem,) = _problems(main_yaml, "teacher_other")
    assert problem.startswith("models.teacher:") and "tokenizer" in problem
    (problem,) = _problems(main_yaml)
    assert problem.startswith("runtime.algorithm.advantage_estimator: opd needs a `teacher`")
    (problem,) = _problems(main_yaml, "teacher_same", estimator="grpo")
    assert problem.startswith("models.teacher: only advantage_estimator: opd")
