"""Which tokens top-k then top-p sampling keeps, as vLLM 0.32's sampler decides it
(vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch): one function that the hf
generation backend samples with and the trainers renormalise their log-probs over, so that an
engine reporting processed log-probs and the trainer score the same distribution.

    keep = top_k_top_p_keep(logits / temperature, top_k, top_p)      # (N, V) bool
"""

import torch


def top_k_top_p_keep(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """(N, V) bool: the tokens each row keeps. logits: (N, V), already divided by the temperature;
    top_k, top_p: a number for every row or (N,) tensors (top_k <= 0 or >= V: off; top_p 1.0:
    off).

    vLLM's order and ties: top-k keeps every logit >= the k-th largest (a tie at the k-th value
    keeps all its tokens); top-p then sorts what is left ascending and drops the tokens whose
    cumulative probability from the bottom stays <= 1 - top_p, so the smallest set holding top_p
    stays and the most likely token always does (ties inside the sort fall as torch.sort orders
    them, as in vLLM)."""
    n, vocab = logits.shape
    top_k = torch.as_tensor(top_k, device=logits.device).expand(n)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(n)
    ordered, index = logits.sort(dim=-1)  # ascending
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).long()
    kth = ordered.gather(1, (vocab - k)[:, None])  # (N, 1) the k-th largest logit
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    drop |= ordered == float("-inf")
    return torch.empty_like(drop).scatter_(1, index, ~drop)
