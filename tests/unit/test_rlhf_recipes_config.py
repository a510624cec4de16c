"""Issue 35's config keys: `chatgen config` refuses bad combinations naming the keys and the fix,
accepts a temperature it can honour, and the recipe helpers of grpo_step.py (advantages, loss options,
dynamic sampling) do what the keys say. pytest tests/unit/test_rlhf_recipes_config.py"""

import textwrap

import pytest
import torch

from chatgen import cli
from chatgen.core.rollout import RolloutBatch
from chatgen.core.train_batch import TrainBatch
from chatgen.rlhf import losses as L
from chatgen.rlhf.algorithms.grpo import step as grpo_step
from chatgen.rlhf.config import load_config


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def main_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "train.jsonl", '{"prompt": "p", "answer": "a"}\n')
    write(
        tmp_path / "policy.yaml",
        "load: /models/tiny\nn: 4\nnew_token_limit: true\nmax_new_tokens: 32\n",
    )
    write(tmp_path / "trainer.yaml", "load: /models/tiny\n")
    return write(
        tmp_path / "main.yaml",
        """
        runtime:
          sample_per_episode: 16
          data_path: train.jsonl
          colocation: [[policy, policy_trainer]]
          algorithm: {name: grpo}
        models:
          policy: {backend: vllm, model_config_file: policy.yaml}
          policy_trainer: {backend: megatron, trainable: true, model_config_file: trainer.yaml}
          reward: {backend: python, model_class: chatgen.module:Module}
    """,
    )


def config_errors(main_yaml, capsys, *overrides) -> str:
    code = cli.main(["config", str(main_yaml), *overrides])
    err = capsys.readouterr().err
    assert code == (2 if err.strip() else 0), err
    return err


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["runtime.algorithm.clip_eps_low=0.3", "runtime.algorithm.clip_eps_high=0.2"],
            ["clip_eps_high", "set clip_eps_high >= clip_eps_low"],
        ),
        (
            [
                "runtime.algorithm.ratio_level=sequence",
                "runtime.algorithm.importance_sampling_cap=2.0",
            ],
            ["ratio_level", "importance_sampling_level: sequence or geometric"],
        ),
        (
            [
                "runtime.algorithm.dynamic_sampling=true",
                "policy.n=1",
                "runtime.sample_per_episode=4",
            ],
            ["runtime.algorithm.dynamic_sampling", "set n >= 2 or dynamic_sampling: false"],
        ),
        (
            [
                "runtime.algorithm.dynamic_sampling=true",
                "runtime.algorithm.overlap_generation=true",
                "runtime.algorithm.old_logprobs=rollout",
            ],
            ["dynamic_sampling", "overlap_generation"],
        ),
        (
            ["runtime.algorithm.kl_in_reward=true", "runtime.algorithm.kl_coef=0.1"],
            ["kl_in_reward", "reinforce_pp"],
        ),
        (
            [
                "runtime.algorithm.advantage_estimator=rloo",
                "runtime.algorithm.normalize_advantage_std=false",
            ],
            ["normalize_advantage_std", "remove the key"],
        ),
        (["runtime.algorithm.dual_clip=0.5"], ["dual_clip", "must be > 1"]),
        (["runtime.algorithm.overlong_buffer_length=32"], ["overlong_buffer_length", "not below"]),
        (
            ["runtime.algorithm.overlong_buffer_length=8", "policy.new_token_limit=false"],
            ["overlong_buffer_length", "new_token_limit: true"],
        ),
        (
            [
                "runtime.algorithm.loss_aggregation=seq_mean_token_sum_norm",
                "policy.new_token_limit=false",
            ],
            ["loss_norm_length", "set it"],
        ),
        (
            ["runtime.algorithm.rejection_level=token", "runtime.algorithm.rejection_low=1.5"],
            ["rejection_low"],
        ),
        (
            ["policy.temperature=0.7", "policy.logprobs_mode=raw"],
            ["models.policy.logprobs_mode", "processed"],
        ),
        (
            ["policy.temperature=0"],
            ["temperature 0", "set temperature > 0"],
        ),  # (caught per model first)
        (
            ["policy.top_p=0.9", "policy.logprobs_mode=raw"],  # top-p with raw log-probs
            [
                "models.policy.logprobs_mode: raw",
                "before top_p 0.9",
                "set logprobs_mode: processed",
            ],
        ),
        (
            ["policy.top_k=20", "policy.logprobs_mode=raw"],
            ["models.policy.logprobs_mode: raw", "before top_k 20", "set logprobs_mode: processed"],
        ),
        (["policy.min_p=0.1"], ["models.policy.min_p: 0.1", "set min_p: 0.0"]),
        (
            ["policy.top_p=0.9", "policy_trainer.logits_top_p=0.8"],
            ["policy_trainer.logits_top_p: 0.8 differs from policy.top_p=0.9", "remove it"],
        ),
    ],
)
def test_bad_combinations_are_refused_naming_keys(main_yaml, capsys, overrides, expected):
    err = config_errors(main_yaml, capsys, *overrides)
    for text in expected:
        assert text in err, err


def test_recipes_and_temperature_accepted(main_yaml, capsys):
    assert config_errors(main_yaml, capsys) == ""
    dapo = [
        "runtime.algorithm.clip_eps_low=0.2",
        "runtime.algorithm.clip_eps_high=0.28",
        "runtime.algorithm.dynamic_sampling=true",
        "runtime.algorithm.overlong_buffer_length=8",
        "runtime.algorithm.loss_aggregation=token_mean",
        "policy.temperature=0.7",
    ]
    assert config_errors(main_yaml, capsys, *dapo) == ""
    gspo = [
        "runtime.algorithm.ratio_level=sequence",
        "runtime.algorithm.importance_sampling_cap=2.0",
        "runtime.algorithm.importance_sampling_level=geometric",
        "runtime.algorithm.clip_eps_low=3e-4",
        "runtime.algorithm.clip_eps_high=4e-4",
        "runtime.algorithm.loss_aggregation=seq_mean_token_mean",
    ]
    assert config_errors(main_yaml, capsys, *gspo) == ""
    # top-k / top-p with processed log-probs: the trainers that score the samples renormalise
    truncated = ["policy.top_p=0.9", "policy.top_k=20", "policy.logprobs_mode=processed"]
    assert config_errors(main_yaml, capsys, *truncated) == ""
    cfg = load_config(main_yaml, truncated)
    trainer = cfg.models["policy_trainer"].config
    assert (trainer.logits_top_p, trainer.logits_top_k) == (0.9, 20)
    trainer = load_config(main_yaml).models["policy_trainer"].config
    assert (trainer.logits_top_p, trainer.logits_top_k) == (None, None)  # defaults: no truncation


def test_loss_options_defaults_are_todays_call(main_yaml):
    cfg = load_config(main_yaml)
    assert grpo_step.loss_options(cfg) == L.PolicyLossOptions(
        clip_eps=0.2, kl_coef=0.0, kl_kind="k3"
    )
    cfg = load_config(
        main_yaml,
        [
            "runtime.algorithm.clip_eps_high=0.28",
            "runtime.algorithm.entropy_coef=0.01",
            "runtime.algorithm.loss_aggregation=seq_mean_token_sum_norm",
        ],
    )
    # Dr. GRPO's constant: the generation budget
    assert grpo_step.loss_options(cfg) == L.PolicyLossOptions(
        clip_eps=0.2,
        kl_coef=0.0,
        kl_kind="k3",
        clip_eps_high=0.28,
        entropy_coef=0.01,
        aggregation=L.seq_mean_token_sum_norm,
        norm_length=32,
    )


def test_advantage_estimators_follow_the_keys(main_yaml):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    mask = torch.ones(8, 3)
    data = TrainBatch(input_ids=torch.zeros(8, 4, dtype=torch.long), old_logprobs=torch.zeros(8, 3))

    def adv(*keys):
        return grpo_step.advantages(
            load_config(main_yaml, list(keys)).runtime.algorithm, rewards, 4, data, mask
        )

    assert torch.equal(adv(), L.group_advantages(rewards, 4))
    assert torch.equal(
        adv("runtime.algorithm.normalize_advantage_std=false"),
        L.group_advantages(rewards, 4, normalize_std=False),
    )
    assert torch.equal(
        adv("runtime.algorithm.advantage_estimator=rloo"), L.rloo_advantages(rewards, 4)
    )
    pp = adv("runtime.algorithm.advantage_estimator=reinforce_pp")
    assert pp.shape == (8, 3) and L.masked_mean(pp, mask).abs().item() < 1e-6


def fake_batch(rewards_per_group, n):
    """A RolloutBatch of len(rewards_per_group) groups of n samples, each group its own token."""
    groups = len(rewards_per_group)
    ids = torch.arange(groups).repeat_interleave(n)[:, None].expand(-1, 4).clone()
    return RolloutBatch(
        input_ids=ids,
        prompt_lengths=torch.full((groups * n,), 2),
        response_lengths=torch.full((groups * n,), 2),
        loss_mask=torch.ones(groups * n, 3),
        infer_logprobs=torch.zeros(groups * n, 3),
        prompt_index=torch.arange(groups * n) // n,
        texts=[""] * groups * n,
        prompt_texts=[None] * groups * n,
        finish_reasons=["stop"] * groups * n,
        metadata=[{}] * groups * n,
    )


class FakeRun:
    """What sample_full_groups uses of a Run: generate/score next prompts, a timer, the config."""

    def __init__(self, cfg, rounds):
        self.cfg, self.rounds, self.calls = cfg, list(rounds), 0
        self.timer = lambda phase: __import__("contextlib").nullcontext()

    def next_prompts(self):
        return [0]

    def generate(self, index):
        self.calls += 1
        self.next = self.rounds.pop(0)
        return fake_batch([r[0] for r in self.next], 2)

    def score(self, batch):
        return torch.tensor([x for group in self.next for x in group])


def test_dynamic_sampling_refills_and_counts(main_yaml):
    cfg = load_config(
        main_yaml,
        [
            "runtime.algorithm.dynamic_sampling=true",
            "policy.n=2",
            "runtime.algorithm.dynamic_sampling_max_rounds=1",
        ],
    )
    first = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]  # groups 0 and 2 have no variance
    run = FakeRun(cfg, [[[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    batch, rewards, m = grpo_step.sample_full_groups(
        run, fake_batch([g[0] for g in first], 2), torch.tensor(first).reshape(-1), 2
    )
    assert run.calls == 1 and len(batch) == 6 and rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert not grpo_step.equal_reward_groups(rewards[:4], 2).any()  # the two kept groups, first
    assert m == {
        "dynamic_sampling/dropped_groups": 4,
        "dynamic_sampling/rounds": 1,
        "dynamic_sampling/extra_generations": 6,
        "dynamic_sampling/unfilled_groups": 1,
    }
    assert batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    # a batch with every group useful: nothing generated
    run = FakeRun(cfg, [])
    batch, rewards, m = grpo_step.sample_full_groups(
        run, fake_batch([1, 1], 2), torch.tensor([1.0, 0, 0, 1]), 2
    )
    assert run.calls == 0 and m["dynamic_sampling/extra_generations"] == 0 and len(batch) == 4
