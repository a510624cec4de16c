"""RolloutBatch.from_samples puts each field where the module docstring says: prompt + response right-padded in
input_ids, and the per-token fields (loss mask, log-probs, weight versions) at the entries that predict the
response's tokens (entry p + k - 1 for response token k), whatever mix of samples a batch holds."""

import random

import pytest
import torch

from chatgen.core.rollout import RolloutBatch, Sample

PAD = 99


def _expected(samples):
    """The layout built entry by entry, the slow way."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = [[PAD] * width for _ in samples]
    mask = [[0.0] * (width - 1) for _ in samples]
    logprobs = [[0.0] * (width - 1) for _ in samples]
    versions = [[-1] * (width - 1) for _ in samples]
    for row, s in enumerate(samples):
        p = len(s.prompt_ids)
        for k, token in enumerate([*s.prompt_ids, *s.response_ids]):
            ids[row][k] = token
        for t in range(1, p):
            logprobs[row][t - 1] = s.prompt_logprobs[t] if s.prompt_logprobs else 0.0
        for k in range(len(s.response_ids)):
            mask[row][p + k - 1] = s.response_mask[k] if s.response_mask is not None else 1.0
            logprobs[row][p + k - 1] = s.response_logprobs[k]
            if s.weight_versions is not None:
                versions[row][p + k - 1] = s.weight_versions[k]
    return ids, mask, logprobs, versions


def test_every_field_lands_at_its_documented_entry():
    rng = random.Random(7)
    for _ in range(50):
        samples = []
        for i in range(rng.randint(1, 9)):
            p, r = rng.randint(1, 6), rng.randint(0, 5)
            samples.append(
                Sample(
                    prompt_ids=[rng.randint(0, 50) for _ in range(p)],
                    response_ids=[rng.randint(0, 50) for _ in range(r)],
                    response_logprobs=[-rng.random() for _ in range(r)],
                    prompt_index=i,
                    response_mask=[float(rng.random() < 0.5) for _ in range(r)]
                    if rng.random() < 0.4
                    else None,
                    weight_versions=[rng.randint(0, 4) for _ in range(r)]
                    if rng.random() < 0.7
                    else None,
                    prompt_logprobs=[0.0] + [-rng.random() for _ in range(p - 1)]
                    if rng.random() < 0.3
                    else None,
                )
            )
        batch = RolloutBatch.from_samples(samples, PAD)
        ids, mask, logprobs, versions = _expected(samples)
        assert batch.input_ids.tolist() == ids
        assert batch.loss_mask.tolist() == mask
        assert torch.allclose(batch.infer_logprobs, torch.tensor(logprobs), atol=0, rtol=0)
        if any(s.weight_versions is not None for s in samples):
            assert batch.weight_versions.tolist() == versions
        else:
            assert batch.weight_versions is None
        assert batch.prompt_lengths.tolist() == [len(s.prompt_ids) for s in samples]
        assert batch.response_lengths.tolist() == [len(s.response_ids) for s in samples]


def test_a_log_prob_count_that_does_not_match_the_response_names_the_sample():
    good = Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1])
    bad = Sample(prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.1])
    with pytest.raises(ValueError, match="sample 1: 2 response tokens but 1 log-probs"):
        RolloutBatch.from_samples([good, bad], PAD)
