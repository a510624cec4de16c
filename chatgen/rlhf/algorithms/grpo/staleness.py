"""How stale a batch's samples are, from the weight version the engine stamped on each token.

    stale = sample_staleness(batch.weight_versions, current)   # (S,) current - the sample's oldest version
    spans = spans_versions(batch.weight_versions)               # (S,) bool: tokens of 2+ versions
    over = groups_over(stale, n, k)                             # (G,) bool: a sample of the group > k

`weight_versions` (S, L-1) long is chatgen.core.rollout.RolloutBatch's: the engine's weight version
of each generated token (0 = the weights it started with, +1 per sync), -1 on prompt and padding.
`current` is the engine version of the weights the trainer holds now (the ones the next update
starts from). A token's staleness is current - its version; a sample's is its oldest token's,
AReaL's definition (a sample that began under version v is as stale as v, however many of its tokens
came later). Pure torch.
"""

import torch

MISMATCH_KEYS = ("mismatch/logprob_max_abs", "mismatch/logprob_mean_abs")


def _generated(versions: torch.Tensor) -> torch.Tensor:
    return versions >= 0


def sample_staleness(versions: torch.Tensor, current: int) -> torch.Tensor:
    """(S,) long: current - the oldest version among each sample's generated tokens (0 for a
    sample without any). A negative value means a token newer than `current`: a bookkeeping
    error."""
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(_generated(versions), versions, big).min(dim=1).values
    return torch.where(oldest == big, 0, current - oldest)


def spans_versions(versions: torch.Tensor) -> torch.Tensor:
    """(S,) bool: the sample's generated tokens come from two or more weight versions (a partial
    rollout: the weights changed while it was being generated)."""
    generated = _generated(versions)
    newest = torch.where(generated, versions, -1).max(dim=1).values
    oldest = torch.where(generated, versions, torch.iinfo(versions.dtype).max).min(dim=1).values
    return generated.any(dim=1) & (newest > oldest)


def groups_over(staleness: torch.Tensor, n: int, bound: int) -> torch.Tensor:
    """(S / n,) bool: groups (n consecutive samples, one prompt) with a sample staler than
    `bound`."""
    return (staleness > bound).view(-1, n).any(dim=1)


def staleness_metrics(versions: torch.Tensor, loss_mask: torch.Tensor, current: int) -> dict:
    """async/staleness_mean and async/staleness_max over the trained tokens (loss_mask (S, L-1)),
    async/samples_spanning_versions: the share of samples with tokens of 2+ versions."""
    trained = (loss_mask > 0) & _generated(versions)
    token_staleness = (current - versions)[trained].float()
    return {
        "async/staleness_mean": token_staleness.mean().item() if token_staleness.numel() else 0.0,
        "async/staleness_max": token_staleness.max().item() if token_staleness.numel() else 0.0,
        "async/samples_spanning_versions": spans_versions(versions).float().mean().item(),
    }


def on_policy_mismatch(old_logprobs, infer_logprobs, loss_mask, versions, current: int) -> dict:
    """The train/inference mismatch (mismatch/logprob_*) over the samples the trainer's current
    weights sampled whole (every token version == current): what the weight sync gets wrong,
    without the staleness an asynchronous batch adds on purpose. A partial rollout's current
    tokens are left out too: the engine read its older tokens' KV, computed with older weights.
    {} when none is fresh."""
    whole = sample_staleness(versions, current) == 0  # (S,): its oldest token is current
    fresh = loss_mask * (versions == current) * whole.unsqueeze(1)
    if fresh.sum() == 0:
        return {}
    diff = (old_logprobs - infer_logprobs).abs() * fresh
    return {
        "mismatch/logprob_max_abs": diff.max().item(),
        "mismatch/logprob_mean_abs": (diff.sum() / fresh.sum()).item(),
    }
