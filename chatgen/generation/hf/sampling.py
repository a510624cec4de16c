"""The hf backend's request settings and its choice of each next token, as vLLM 0.32's sampler makes
them.

    params = SamplingParams(**chatgen.generation.config.sampling_kwargs(cfg, prompt_len))   # one request
    rows = RowSettings.of([params_of_each_row])                                              # (B,) tensors
    tokens, logprobs = next_tokens(logits, rows, seen, generator, "raw")                     # one decode step

The order is vLLM's (vllm/v1/sample/sampler.py): log-softmax of the raw logits (logprobs_mode raw) ->
repetition penalty -> greedy rows (temperature 0) take the argmax -> temperature -> min_p -> top-k, then top-p
-> log-softmax of what is left (logprobs_mode processed) -> sample. Pure torch: unit-tested in
tests/unit/test_hf_sampling.py.
"""

import dataclasses

import torch

from chatgen.core.truncation import top_k_top_p_keep

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings: the keyword names of vLLM's `SamplingParams` that
    chatgen.generation.config.sampling_kwargs fills (top_k 0 = off, as vLLM has it)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 16
    stop: tuple = ()
    stop_token_ids: tuple = ()
    logprobs: int = 0  # top-N log-probs per generated token besides the sampled one's
    prompt_logprobs: int | None = None  # top-N per prompt token; None = off

    # lists from sampling_kwargs: kept as tuples, so that params can be shared and hashed
    def __post_init__(
        self,
    ):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclasses.dataclass
class RowSettings:
    """The sampling settings of a batch's B rows as (B,) tensors (vLLM's SamplingMetadata)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # 0 = off
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor

    @classmethod
    def of(cls, params: list, device="cpu") -> "RowSettings":
        def column(key, dtype):
            return torch.tensor([getattr(p, key) for p in params], dtype=dtype, device=device)

        return cls(
            column("temperature", torch.float32),
            column("top_p", torch.float32),
            column("top_k", torch.long),
            column("min_p", torch.float32),
            column("repetition_penalty", torch.float32),
        )


def apply_repetition_penalty(logits, seen, penalty):
    """Where a row's token is in `seen` (B, V) (its prompt or its output so far): positive logits
    divided by the row's penalty, negative ones multiplied (vLLM's apply_repetition_penalties)."""
    scale = torch.where(seen, penalty[:, None], torch.ones_like(logits))
    return logits * torch.where(logits > 0, 1.0 / scale, scale)


def apply_min_p(logits, min_p):
    """Drop tokens whose probability is under min_p times the row's top probability (rows with
    min_p 0 keep all)."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(
        probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf")
    )


def apply_top_k_top_p(logits, top_k, top_p):
    """Keep each row's top_k logits (0 = all), then the smallest set of them holding top_p of the
    probability (1.0 = all; the top token always stays); the rest become -inf
    (chatgen.core.truncation, vLLM's apply_top_k_top_p_pytorch)."""
    return logits.masked_fill(~top_k_top_p_keep(logits, top_k, top_p), float("-inf"))


def next_tokens(logits, rows: RowSettings, seen, generator, logprobs_mode: str):
    """One step's tokens for B rows: (tokens (B,) long, logprobs (B, V) float32), where
    `logprobs` is the distribution the sampled token's log-prob is read from (logprobs_mode raw:
    the model's own; processed: after the penalty, temperature, min_p, top-k and top-p, what the
    token was drawn from).

    logits: (B, V) of the last position; seen: (B, V) bool, the tokens of each row's prompt and
    output (None when no row has a repetition penalty); generator: the torch.Generator the draws
    come from."""
    logits = logits.float()
    raw = logits.log_softmax(dim=-1)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, rows.repetition_penalty)
    greedy = rows.temperature < GREEDY_BELOW
    if greedy.all():  # no draw: a greedy call leaves the generator where it was, as in vLLM
        return logits.argmax(dim=-1), raw if logprobs_mode == "raw" else logits.log_softmax(dim=-1)
    scaled = (
        logits / torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)[:, None]
    )
    if (rows.min_p > 0).any():
        scaled = apply_min_p(scaled, rows.min_p)
    if (rows.top_k > 0).any() or (rows.top_p < 1).any():
        scaled = apply_top_k_top_p(scaled, rows.top_k, rows.top_p)
    # vLLM's draw (random_sample): argmax of p / q with q ~ Exp(1), which picks a token with
    # probability p; on CPU it is ~10x faster than torch.multinomial over a large vocabulary
    noise = torch.empty_like(scaled).exponential_(generator=generator)
    drawn = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    if logprobs_mode == "raw":
        return tokens, raw
    # processed: greedy rows report the penalised logits' distribution (vLLM: no temperature or
    # filters on them)
    return tokens, torch.where(
        greedy[:, None], logits.log_softmax(dim=-1), scaled.log_softmax(dim=-1)
    )


def top_logprobs(logprobs, token: int, n: int) -> dict:
    """{token id: log-prob} of `token` and the n most likely tokens of one (V,) row (vLLM's
    logprobs=n)."""
    ids = [token, *logprobs.topk(n).indices.tolist()] if n else [token]
    return {i: float(logprobs[i]) for i in ids}


def stop_string_at(text: str, stops) -> tuple:
    """(stop string, where it starts) of the earliest stop string in `text`, or (None, -1)."""
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None, -1
    at, stop = min(found)
    return stop, at
