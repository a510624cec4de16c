"""GDPO (advantage_estimator: gdpo, chatgen.rlhf.recipe.gdpo) against hand-computed advantages: each
reward term normalised in its group, the weighted sum whitened over the batch; the terms ride with
the RolloutBatch through select / concat (dynamic sampling, replay) and reach the estimator.

    pytest tests/unit/test_rlhf_gdpo.py
"""

import math

import pytest
import torch

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.core.train_batch import TrainBatch
from chatgen.rlhf.algorithms.grpo import Config, step
from chatgen.rlhf.recipe import advantage, gdpo

# 2 prompts x n = 2; `acc` and `fmt` vary differently, fmt weighs 0.5
TERMS = {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0]), "fmt": torch.tensor([0.0, 3.0, 2.0, 0.0])}
WEIGHTS = {"acc": 1.0, "fmt": 0.5}


def test_gdpo_by_hand_keeps_the_term_grpo_of_the_sum_loses():
    adv = gdpo.gdpo_advantages(TERMS, WEIGHTS, n=2)
    # per group of 2 (unbiased std |x - y| / sqrt 2): acc -> [+h, -h], [0, 0]; fmt -> [-h, +h],
    # [+h, -h] with h = 1 / sqrt 2; sum acc + fmt / 2 -> h / 2 * [1, -1, 1, -1]; whitened (unbiased
    # std of [c, -c, c, -c] is c sqrt(4 / 3)) -> [1, -1, 1, -1] / sqrt(4 / 3)
    s = 1 / math.sqrt(4 / 3)
    assert adv.tolist() == pytest.approx([s, -s, s, -s], abs=1e-5)
    # GRPO of the weighted sum [1, 1.5, 2, 1] ranks sample 0 (accurate) below sample 1
    total = TERMS["acc"] + 0.5 * TERMS["fmt"]
    grpo = advantage.get("grpo")(total, 2, None, Config(name="grpo"))
    assert grpo[0] < 0 < adv[0]
    metrics = gdpo.term_metrics(TERMS, 2)
    h = 1 / math.sqrt(2)
    assert metrics == {
        "advantage/acc": pytest.approx(h / 2, abs=1e-5),  # one group of two varied
        "advantage/fmt": pytest.approx(h, abs=1e-5),
    }


def _batch(terms=None, weights=None):
    samples = [
        Sample(prompt_ids=[1, 2], response_ids=[3] * (k + 1), response_logprobs=[-0.5] * (k + 1))
        for k in range(4)
    ]
    batch = RolloutBatch.from_samples(samples, pad_token_id=0)
    batch.reward_terms, batch.reward_weights = terms, weights
    return batch


def test_terms_ride_with_the_batch_through_select_and_concat():
    batch = _batch(dict(TERMS), dict(WEIGHTS))
    picked = batch.select([3, 0])
    assert picked.reward_terms["fmt"].tolist() == [0.0, 0.0]
    assert picked.reward_terms["acc"].tolist() == [1.0, 1.0]
    assert picked.reward_weights == WEIGHTS
    both = RolloutBatch.concat([batch.select([0, 1]), batch.select([2, 3])], pad_token_id=0)
    assert both.reward_terms["fmt"].tolist() == TERMS["fmt"].tolist()
    assert (
        RolloutBatch.concat([batch, _batch()], 0).reward_terms is None
    )  # not every batch has them


def test_the_estimator_reads_the_terms_and_a_shaping_is_centred_not_normalised():
    batch = _batch(dict(TERMS), dict(WEIGHTS))
    algo = Config(name="grpo", advantage_estimator="gdpo")
    data = batch.trainer_inputs()
    rewards = TERMS["acc"] + 0.5 * TERMS["fmt"]
    extras = gdpo.with_terms(batch, rewards, rewards)
    adv = step.advantages(algo, rewards, 2, data, batch.loss_mask, extras)
    assert torch.allclose(adv, gdpo.gdpo_advantages(TERMS, WEIGHTS, 2))
    assert (
        data.extras == {}
    )  # the terms are the estimator's view only: nothing travels to the trainer
    penalty = torch.tensor([0.0, -0.1, 0.0, 0.0])
    extras = gdpo.with_terms(batch, rewards, rewards + penalty)
    assert torch.allclose(extras["reward_shaping"], penalty)
    adv = step.advantages(algo, rewards + penalty, 2, data, batch.loss_mask, extras)
    # the sum before whitening: h / 2 * [1, -1, 1, -1] (above) plus the centred penalty
    # [0.05, -0.05, 0, 0]: a small penalty stays small (normalised it would weigh as much as acc)
    h = 1 / 2**0.5
    total = torch.tensor([h / 2 + 0.05, -h / 2 - 0.05, h / 2, -h / 2])
    expected = (total - total.mean()) / (total.std() + gdpo.EPS)
    assert torch.allclose(adv, expected, atol=1e-5)
    metrics = gdpo.term_metrics(TERMS, 2, shaping=penalty)
    assert metrics["advantage/shaping"] == pytest.approx(0.05 / 2)


def test_gdpo_without_terms_is_refused_naming_the_key_and_the_fix():
    algo = Config(name="grpo", advantage_estimator="gdpo")
    batch = TrainBatch(input_ids=torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="advantage_estimator: gdpo.*Rewards.*terms"):
        advantage.get("gdpo")(torch.zeros(4), 2, batch, algo)
