"""Pure logic of the generation service: `replace_prefix_tokens` (token-exact multi-turn) and
`verify_right_padding`, both public in chatgen.generation.

    .venv/bin/python -m pytest tests/unit/test_chat_tokens.py
"""

from types import SimpleNamespace

import pytest
import torch

from chatgen.generation import replace_prefix_tokens, verify_right_padding

EOS = 2
TOK = SimpleNamespace(eos_token_id=EOS)


def test_the_worked_example_of_nemo_rl_holds_exactly():
    # turn 1: template prefill + the model's " 4" + EOS
    model_prefix = [
        11,
        12,
        13,
        40,
        41,
        220,
        17,
        2,
    ]
    template_prefix = [11, 12, 13, 40, 41, 1001, 2]  # the template re-tokenizes " 4" as one token
    template = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]
    assert replace_prefix_tokens(TOK, model_prefix, template_prefix, template) == [
        11,
        12,
        13,
        40,
        41,
        220,
        17,
        2,
        21,
        22,
        40,
        41,
    ]


def test_no_model_prefix_returns_the_template():
    template = [5, 6, 2, 7]
    assert replace_prefix_tokens(TOK, [], [5, 6, 2], template) == template
    assert replace_prefix_tokens(TOK, [], [5, 6, 2], template) is not template  # a copy


def test_a_turn_cut_by_the_token_limit_has_no_eos_and_keeps_all_its_tokens():
    # the model stopped at max_tokens (no EOS); the template closes the turn with its EOS
    assert replace_prefix_tokens(TOK, [9, 30, 31], [9, 77, 2], [9, 77, 2, 50, 51]) == [
        9,
        30,
        31,
        2,
        50,
        51,
    ]


def test_eos_tokens_are_counted_not_positions():
    # three turns: the template of the whole chat drops the first answer's "think" tokens (88, 89), as Qwen3
    # does for older turns, so positions shift; the second answer still ends at the second EOS
    model_prefix = [1, 10, 2, 3, 20, 21, 2]
    template_prefix = [1, 88, 89, 10, 2, 3, 99, 2]
    template = [1, 10, 2, 3, 99, 2, 4, 5]
    assert replace_prefix_tokens(TOK, model_prefix, template_prefix, template) == [
        1,
        10,
        2,
        3,
        20,
        21,
        2,
        4,
        5,
    ]
    # by position (the template prefix's last EOS at index 7) the result would be wrong
    assert template[7:] != [2, 4, 5]


def test_merged_tokens_stay_as_the_model_produced_them():
    # the model produced the pair (30, 31) whose text the template tokenizes as one token 40
    assert replace_prefix_tokens(TOK, [9, 30, 31, 2], [9, 40, 2], [9, 40, 2, 60]) == [
        9,
        30,
        31,
        2,
        60,
    ]


def test_clear_errors():
    with pytest.raises(ValueError, match="no eos_token_id"):
        replace_prefix_tokens(SimpleNamespace(eos_token_id=None), [1, 2], [1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="holds no EOS token \\(id 2\\)"):
        replace_prefix_tokens(TOK, [1, 5, 2], [1, 6], [1, 6, 7])
    with pytest.raises(ValueError, match="hold only 1"):
        replace_prefix_tokens(TOK, [1, 5, 2, 6, 2], [1, 5, 2, 6, 2], [1, 5, 2, 7])


def test_verify_right_padding_names_rows_and_positions():
    good = {
        "input_ids": torch.tensor([[1, 5, 0, 0], [1, 5, 6, 7]]),
        "input_lengths": torch.tensor([2, 4]),
    }
    assert verify_right_padding(good, pad_value=0) == (True, None)
    left = {
        "input_ids": torch.tensor([[1, 5, 0, 0], [0, 0, 1, 7]]),
        "input_lengths": torch.tensor([2, 2]),
    }
    ok, message = verify_right_padding(left, pad_value=0)
    assert not ok and "row 1 is not right-padded" in message and "positions 2, 3" in message
    assert "row 0" not in message
    with pytest.raises(ValueError, match="row 1 is not right-padded"):
        verify_right_padding(left, pad_value=0, raise_error=True)
    out = {
        "output_ids": torch.tensor([[1, 5, 9, 3]]),
        "unpadded_sequence_lengths": torch.tensor([3]),
    }
    ok, message = verify_right_padding(out, pad_value=3)
    assert ok and message is None
    ok, message = verify_right_padding(out, pad_value=0)
    assert not ok and "unpadded_sequence_lengths[0]=3" in message and "positions 3" in message
    with pytest.raises(ValueError, match="needs input_ids \\+ input_lengths or output_ids"):
        verify_right_padding({"input_ids": torch.ones(1, 2)})
    # a length beyond the row (NeMo RL's verify_right_padding refuses it too)
    long = {"input_ids": torch.tensor([[1, 5, 0]]), "input_lengths": torch.tensor([5])}
    ok, message = verify_right_padding(long, pad_value=0)
    assert not ok and "input_lengths[0]=5 exceeds the width 3" in message
