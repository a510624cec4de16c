"""TRL's VLLMGeneration constructor, both shapes (trl/generation/vllm_generation.py): today's (model, accelerator,
processing_class, mode, ..., trust_remote_code, ...) and the 2026-06 one (is_fsdp_enabled third, removed on
2026-06-11), told apart by a bool third argument or the is_fsdp_enabled keyword. Pure unit test of the facade's
argument mapping (its engine start replaced by a recorder).

    python -m pytest tests/peers/test_trl_signature.py
"""

import pytest

from chatgen.generation.trl_merged import CURRENT, VLLMGeneration


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(VLLMGeneration, "_start", lambda self, *a, **kw: calls.append((a, kw)))
    return calls


def test_todays_positional_order_puts_the_tokenizer_third(recorded):
    VLLMGeneration("model", "acc", "tokenizer", "colocate")
    assert recorded == [(("model", "acc"), {"processing_class": "tokenizer", "mode": "colocate"})]


def test_the_2026_06_order_by_a_bool_or_the_keyword(recorded):
    VLLMGeneration("model", "acc", False, "tokenizer", "colocate")
    VLLMGeneration("model", "acc", is_fsdp_enabled=True, processing_class="tokenizer")
    assert [kw for _, kw in recorded] == [
        {"is_fsdp_enabled": False, "processing_class": "tokenizer", "mode": "colocate"},
        {"is_fsdp_enabled": True, "processing_class": "tokenizer"},
    ]


def test_every_argument_positionally_and_errors_as_python_gives_them(recorded):
    values = [f"v{i}" for i in range(len(CURRENT))]
    VLLMGeneration("model", "acc", *values)
    assert recorded[0][1] == dict(zip(CURRENT, values))
    assert recorded[0][1]["trust_remote_code"] == values[CURRENT.index("trust_remote_code")]
    with pytest.raises(TypeError, match="positional arguments"):
        VLLMGeneration("model", "acc", *values, "one too many")
    with pytest.raises(TypeError, match="multiple values for argument 'processing_class'"):
        VLLMGeneration("model", "acc", "tokenizer", processing_class="tokenizer")
