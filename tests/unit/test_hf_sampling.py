"""The hf backend's pure logic: the choice of each token (chatgen/generation/hf/sampling.py) and its stop rule.

    .venv/bin/python -m pytest tests/unit/test_hf_sampling.py

The logits processors are checked by hand on small rows and against vLLM's own functions on random ones (the
hf backend must sample what vLLM samples); the stop rule on a module without a model.
"""

from types import SimpleNamespace

import pytest
import torch

from chatgen.generation.hf import sampling
from chatgen.generation.hf.sampling import RowSettings, SamplingParams, next_tokens

INF = float("inf")


def rows(b=1, **values) -> RowSettings:
    params = SamplingParams(**values)
    return RowSettings.of([params] * b)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = sampling.apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0]]


def test_min_p_drops_tokens_under_min_p_times_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = sampling.apply_min_p(probs.log(), torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]
    assert sampling.apply_min_p(probs.log(), torch.tensor([0.0])).equal(probs.log())


def test_top_k_then_top_p_keep_the_smallest_head_set():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    out = sampling.apply_top_k_top_p(
        logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.85])
    )
    # 0.8 < 0.85: one more
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False],  # top-k 2
        [True, True, False, False],  # 0.5 + 0.3 >= 0.7
        [True, True, True, False],
    ]
    assert out[torch.isfinite(out)].equal(logits[torch.isfinite(out)])  # kept logits are untouched


@pytest.mark.integration  # importing vLLM takes seconds
def test_processors_equal_vllms():
    """On random rows with mixed settings, our top-k/top-p and min-p keep exactly what vLLM's keep."""
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    k, p = torch.tensor([0, 1, 5, 50, 0, 300]), torch.tensor([1.0, 1.0, 0.9, 0.5, 0.3, 0.95])
    ours = sampling.apply_top_k_top_p(logits.clone(), k, p)
    theirs = vllm_ops.apply_top_k_top_p_pytorch(logits.clone(), torch.where(k > 0, k, 300), p)
    assert ours.equal(theirs)
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.5, 0.9, 1.0])
    probs = logits.softmax(-1)  # vLLM's MinPLogitsProcessor.apply
    theirs = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], -INF)
    assert sampling.apply_min_p(logits, min_p).equal(theirs)


def test_greedy_takes_the_penalised_argmax_and_draws_nothing():
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    seen = torch.tensor([[True, False, False]])
    tokens, logprobs = next_tokens(
        logits, rows(temperature=0.0, repetition_penalty=1.5), seen, g, "raw"
    )
    assert tokens.tolist() == [1]  # 3.0 / 1.5 = 2.0 < 2.9
    assert torch.allclose(logprobs, logits.log_softmax(-1))  # raw: the model's own distribution
    _, processed = next_tokens(
        logits, rows(temperature=0.0, repetition_penalty=1.5), seen, g, "processed"
    )
    assert torch.allclose(processed, torch.tensor([[2.0, 2.9, -1.0]]).log_softmax(-1))
    assert g.get_state().equal(state)  # an all-greedy step leaves the sampling generator alone


def test_processed_logprobs_are_of_the_distribution_sampled_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    settings = rows(temperature=0.5, top_k=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        token, logprobs = next_tokens(logits, settings, None, g, "processed")
        assert token.item() in (0, 1)  # top-k 2
        expected = torch.tensor([[4.0, 2.0]]).log_softmax(-1)[0]  # logits / 0.5, the two kept
        assert torch.allclose(logprobs[0, :2], expected) and logprobs[0, 2:].eq(-INF).all()
        _, raw = next_tokens(logits, settings, None, g, "raw")
        assert torch.allclose(raw, logits.log_softmax(-1))


def test_draws_follow_the_processed_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, -9.0]).repeat(20000, 1)
    tokens, _ = next_tokens(
        logits, rows(20000, temperature=2.0), None, torch.Generator().manual_seed(1), "raw"
    )
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, (logits[0] / 2).softmax(-1), atol=0.015), freq


def test_mixed_rows_greedy_and_sampled():
    logits = torch.tensor([[0.0, 5.0, 4.9]]).repeat(2, 1)
    settings = RowSettings.of(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    )
    tokens, _ = next_tokens(logits, settings, None, torch.Generator().manual_seed(0), "processed")
    assert tokens.tolist() == [1, 1]


def test_same_seed_same_draws_other_seed_other_draws():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))

    def draw(seed):
        return next_tokens(logits, rows(64), None, torch.Generator().manual_seed(seed), "raw")[0]

    assert draw(5).equal(draw(5)) and not draw(5).equal(draw(6))


def test_top_logprobs_has_the_token_and_the_top_n():
    logprobs = torch.tensor([-3.0, -0.5, -1.0, -2.0])
    assert sampling.top_logprobs(logprobs, 3, 0) == {3: -2.0}
    assert sampling.top_logprobs(logprobs, 3, 2) == {3: -2.0, 1: -0.5, 2: -1.0}


def test_sampling_params_take_sampling_kwargs_as_they_are():
    from chatgen.config import load_model_config
    from chatgen.generation import config as gc
    from chatgen.generation.hf.config import HFConfig

    cfg = load_model_config(
        None, HFConfig, {"load": "/m", "seq_length": 64, "max_new_tokens": 16, "n": 4, "top_k": -1}
    )
    params = SamplingParams(**gc.sampling_kwargs(cfg, 10, stop_strings=["\n"], stop_token_ids=[2]))
    assert (params.n, params.top_k, params.max_tokens, params.stop, params.stop_token_ids) == (
        4,
        0,
        54,
        ("\n",),
        (2,),
    )


def test_stop_string_at_finds_the_earliest():
    assert sampling.stop_string_at("a b</answer> c\n", ["\n", "</answer>"]) == ("</answer>", 3)
    assert sampling.stop_string_at("abc", ["x"]) == (None, -1)


# ---------------------------------------------------------------- the stop rule (HFGeneration._stop)


@pytest.fixture
def module():
    from chatgen.generation.hf.module import HFGeneration

    m = HFGeneration({"load": "/m"})
    m._eos, m._eos_stops = 2, (7,)  # the tokenizer's EOS; another EOS id of generation_config.json
    m.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(chr, ids)))
    return m


@pytest.mark.parametrize(
    "tokens, params, expected",
    [
        ([5, 2], {}, ("stop", None, None)),  # EOS: no stop_reason
        ([5, 2], {"ignore_eos": True}, None),
        ([5, 2], {"ignore_eos": True, "max_tokens": 2}, ("length", None, None)),
        ([5, 7], {}, ("stop", 7, None)),  # generation_config's EOS: a stop token
        ([5, 7], {"ignore_eos": True}, None),
        ([5, 9], {"stop_token_ids": (9,), "ignore_eos": True}, ("stop", 9, None)),
        (
            [5, 9],
            {"stop_token_ids": (9,), "max_tokens": 2},
            ("stop", 9, None),
        ),  # a stop beats the limit, as in vLLM
        ([97, 98, 99], {"stop": ("bc",)}, ("stop", "bc", "a")),  # text cut before the stop string
        ([97, 98, 99], {"stop": ("bc",), "max_tokens": 3}, ("stop", "bc", "a")),
        ([97, 98], {"stop": ("bc",)}, None),
        ([97, 98], {"max_tokens": 2}, ("length", None, None)),
    ],
)
def test_stop_rule_is_vllms(module, tokens, params, expected):
    assert module._stop(tokens, SamplingParams(**{"max_tokens": 16, **params})) == expected


def test_temperatures_under_vllms_epsilon_are_greedy():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    tokens, _ = next_tokens(torch.tensor([[0.0, 1.0]]), rows(temperature=1e-6), None, g, "raw")
    assert tokens.tolist() == [1] and g.get_state().equal(state)  # the greedy path: nothing drawn
