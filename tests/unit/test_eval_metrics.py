"""Held-out figures over eval_n samples per prompt (chatgen.rlhf.metrics.eval_metrics): pass@k by
the unbiased estimator of Chen et al. 2021 against hand-computed cases, mean@k, and the eval_n
config keys.

    pytest tests/unit/test_eval_metrics.py
"""

import dataclasses

import pytest
import torch

from chatgen.generation.config import GenerationConfig, samples_per_prompt, sampling_kwargs
from chatgen.rlhf.metrics import eval_metrics, pass_at_k


def test_pass_at_k_matches_hand_computed_cases():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@4 = 1 (only 3 are wrong)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3) = 1/10
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)


def test_eval_metrics_over_prompts_of_n_samples():
    # prompt 0: rewards 1, 0, 0.5, 1 (solved at >= 1: 2 of 4); prompt 1: none solved;
    # prompt 2: all solved
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    m = eval_metrics(rewards, 4, 1.0)
    assert m["eval/reward"] == pytest.approx(6.7 / 12) and m["eval/mean@4"] == pytest.approx(
        6.7 / 12
    )
    assert m["eval/solved"] == pytest.approx(6 / 12)
    # pass@1 per prompt c/n: 0.5, 0, 1; pass@2: 1 - C(2,2)/C(4,2) = 5/6, 0, 1; pass@4: 1, 0, 1
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["eval/pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert sorted(k for k in m if "pass@" in k) == ["eval/pass@1", "eval/pass@2", "eval/pass@4"]
    assert sorted(eval_metrics(torch.zeros(12), 6, 1.0)) == sorted(
        [
            "eval/reward",
            "eval/mean@6",
            "eval/solved",
            "eval/pass@1",
            "eval/pass@2",
            "eval/pass@4",
            "eval/pass@6",
        ]
    )
    # greedy: one sample, nothing solved
    one = eval_metrics(torch.tensor([1.0, 0.0]), 1, None, "eval/greedy")
    assert one == {"eval/greedy/reward": 0.5}


def test_eval_n_sets_the_samples_of_an_evaluation_only():
    cfg = dataclasses.replace(
        GenerationConfig(), n=8, eval_n=16, eval_temperature=0.6, seq_length=64, max_new_tokens=16
    )
    assert sampling_kwargs(cfg, 4, is_eval=True)["n"] == 16 and sampling_kwargs(cfg, 4)["n"] == 8
    assert samples_per_prompt(cfg, is_eval=True) == 16
    assert sampling_kwargs(cfg, 4, is_eval=True, greedy=True)["n"] == 1
    unset = dataclasses.replace(cfg, eval_n=None)
    assert sampling_kwargs(unset, 4, is_eval=True)["n"] == 8  # null: n, as before
    greedy = dataclasses.replace(cfg, eval_temperature=0.0)
    # 16 samples of a greedy evaluation: refused
    assert [key for key, _ in greedy.check()] == ["eval_n"]
