"""Unit tests of the RLHF engine's pure parts: config checks, batch building, actor-group planning, and the
`chatgen train` failure path for a bad YAML (no Ray, vLLM or Megatron starts). pytest tests/unit/test_rlhf_engine.py"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chatgen.config import ConfigError, load_config
from chatgen.rlhf import tasks
from chatgen.rlhf.engine import check_config, sample_metrics, select, trainer_batch
from chatgen.rlhf.runtime import plan_groups

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path):
    tasks.main(["--output", str(tmp_path), "--n-train", "64", "--n-eval", "8"])
    return [f"runtime.data_path={tmp_path}/train.jsonl", f"runtime.eval_data_path={tmp_path}/eval.jsonl"]


def load(name, *overrides):
    return load_config(REPO / "configs" / name, list(overrides))


def errors_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    return str(e.value)


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml"])
def test_shipped_tiny_configs_pass(name, data):
    check_config(load(name, *data))


def test_check_config_collects_every_problem(data):
    cfg = load("grpo_tiny.yaml", *data, "policy.temperature=0.7", "runtime.sample_per_episode=12",
               "runtime.train_micro_batch_size=4", "runtime.train_global_batch_size=4",
               "models.reference.trainable=true")
    msg = errors_of(cfg)
    assert "temperature" in msg and "sample_per_episode: 12 is not a multiple of policy n=8" in msg
    assert "models.reference.trainable: must be false" in msg


def test_check_config_needs_models_for_the_algorithm(tmp_path, data):
    main = tmp_path / "main.yaml"
    main.write_text(f"""
runtime: {{algorithm: {{name: ppo, kl_coef: 0.1}}}}
models:
  policy: {{backend: vllm, model_config_file: {REPO}/configs/grpo_tiny/policy.yaml}}
  policy_trainer: {{backend: megatron, trainable: true, model_config_file: {REPO}/configs/grpo_tiny/trainer.yaml}}
  value: {{backend: megatron, model_config_file: {REPO}/configs/grpo_tiny/trainer.yaml}}
""")
    msg = errors_of(load_config(main, data))
    assert "models.value_trainer: ppo needs a `value_trainer` model" in msg
    assert "models.reward: ppo needs a `reward` model" in msg
    assert "models.value: not used by ppo; values come from value_trainer" in msg
    assert "kl_coef: 0.1 needs a `reference` model" in msg


def test_check_config_data_paths(tmp_path):
    msg = errors_of(load("grpo_tiny.yaml", f"runtime.data_path={tmp_path}/missing.jsonl"))
    assert "runtime.data_path:" in msg and "missing.jsonl does not exist" in msg


def test_train_cli_bad_yaml_fails_before_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/grpo_tiny.yaml").read_text().replace("num_episode:", "num_episodes:")
                   .replace("model_config_file: grpo_tiny/", f"model_config_file: {REPO}/configs/grpo_tiny/"))
    # A fresh interpreter: nothing heavy may have been imported, and Ray must not have started.
    code = ("import sys; from chatgen.cli import main; rc = main(['train', sys.argv[1]]); "
            "heavy = [m for m in ('ray', 'vllm', 'megatron.core') if m in sys.modules]; "
            "import ray; print('RESULT', rc, ray.is_initialized(), heavy)")
    out = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=120)
    assert "RESULT 2 False []" in out.stdout, out.stdout + out.stderr
    assert "runtime.num_episodes: unknown key; did you mean 'num_episode'?" in out.stderr


def fake_generation():
    # Two samples: prompt [1, 5, 6] + response [7, 2]; prompt [1, 5] + response [8, 9, 2]; pad 0.
    return {
        "all_tokens": torch.tensor([[1, 5, 6, 7, 2, 0], [1, 5, 8, 9, 2, 0]]),
        "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.float),
        "old_logprobs": torch.tensor([[0, 0, 0, -0.5, -0.1, 0], [0, 0, -1.0, -2.0, -0.3, 0]]),
        "prompt_lengths": torch.tensor([3, 2]),
        "response_lengths": torch.tensor([2, 3]),
        "str_outputs": ["a", "b"],
    }


def test_trainer_batch_shifts_masks_to_logprob_positions():
    batch = trainer_batch(fake_generation())
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]]
    # Entry t of a (S, L-1) tensor scores token t+1: the response tokens of row 0 are tokens 3 and 4.
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    assert batch["infer_logprobs"][0, 2:4].tolist() == pytest.approx([-0.5, -0.1])
    assert batch["infer_logprobs"].shape == (2, 5)
    sub = select(batch, torch.tensor([1]))
    assert sub["input_ids"].tolist() == [[1, 5, 8, 9, 2, 0]] and sub["loss_mask"].shape == (1, 5)


def test_trainer_batch_names_missing_keys():
    gen = fake_generation()
    del gen["loss_mask"]
    with pytest.raises(KeyError, match="decode_internal returned no \\['loss_mask'\\]"):
        trainer_batch(gen)


def test_sample_metrics_mismatch_only_on_response_tokens():
    batch = trainer_batch(fake_generation())
    batch["old_logprobs"] = batch["infer_logprobs"].clone()
    batch["old_logprobs"][0, 0] = 99.0  # a prompt position: not a sampled token, ignored
    batch["old_logprobs"][1, 3] += 0.25
    m = sample_metrics(torch.tensor([1.0, 0.5]), batch)
    assert m["mismatch/logprob_max_abs"] == pytest.approx(0.25)
    assert m["mismatch/logprob_mean_abs"] == pytest.approx(0.25 / 5)
    assert m["reward/mean"] == 0.75 and m["reward/solved"] == 0.5 and m["response/length"] == 2.5


def test_plan_groups(data):
    grpo = plan_groups(load("grpo_tiny.yaml", *data))
    assert grpo == [(["policy", "policy_trainer", "reference", "reward"], 1, 0, 2.0)]
    ppo = plan_groups(load("ppo_tiny.yaml", *data))
    assert [(names, world) for names, world, _, _ in ppo] == [
        (["policy", "reward"], 1), (["policy_trainer", "reference", "value_trainer"], 1)]


def test_plan_groups_rejects_mismatched_colocation(data):
    with pytest.raises(ValueError, match="need different numbers of ranks"):
        plan_groups(load("grpo_tiny.yaml", *data, "policy_trainer.tensor_model_parallel_size=2"))
    with pytest.raises(ValueError, match="set tensor_parallel_size: 2"):
        plan_groups(load("grpo_tiny.yaml", *data, "policy_trainer.tensor_model_parallel_size=2",
                         "reference.tensor_model_parallel_size=2"))


def test_batch_sizes_must_split_over_data_parallel_ranks(data):
    # 2 GPUs with TP=PP=1: DP=2, so a global batch of 128 is 64 per rank, less than the micro batch of 128
    dp2 = [*data, "models.policy_trainer.num_gpu=2", "models.reference.num_gpu=2"]
    msg = errors_of(load("grpo_tiny.yaml", *dp2))
    assert ("runtime.train_global_batch_size: 128 does not split into whole micro-batches on every data-parallel "
            "rank (models.policy_trainer has DP = 2 ranks / (TP 1 x PP 1) = 2 and micro batch 128); make it a "
            "multiple of 256") in msg
    check_config(load("grpo_tiny.yaml", *dp2, "runtime.train_micro_batch_size=64"))
    # a frozen model only runs forward passes: the episode's samples must split
    msg = errors_of(load("grpo_tiny.yaml", *dp2, "runtime.train_micro_batch_size=64", "reference.micro_batch_size=48"))
    assert "runtime.sample_per_episode: 256 does not split into whole micro-batches" in msg
    assert "models.reference has DP = 2" in msg and "make it a multiple of 96" in msg
