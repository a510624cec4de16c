"""MegatronConfig: every key is read by the trainer or rejected (tokenizer and save were documented but never
read, so a YAML setting them now fails with the unknown-key error). pytest tests/unit/test_megatron_config.py"""

import pytest

from chatgen.config import ConfigError, load_model_config
from chatgen.training.config import MegatronConfig


@pytest.mark.parametrize("key, value", [("tokenizer", "/models/tok"), ("save", "/ckpt")])
def test_keys_the_trainer_never_read_are_unknown(tmp_path, key, value):
    path = tmp_path / "trainer.yaml"
    path.write_text(f"load: /models/tiny\n{key}: {value}\n")
    with pytest.raises(ConfigError, match=f"{key}.*unknown key"):
        load_model_config(path, MegatronConfig)


def test_seq_length_defaults_to_the_model_and_must_be_positive(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text("load: /models/tiny\n")
    assert load_model_config(path, MegatronConfig).seq_length is None
    path.write_text("load: /models/tiny\nseq_length: 0\n")
    with pytest.raises(ConfigError, match="seq_length: must be >= 1 or null, got 0"):
        load_model_config(path, MegatronConfig)


def test_moe_keys_are_range_checked(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text("load: /models/tiny\nexpert_model_parallel_size: 0\nmoe_aux_loss_coeff: -0.1\n")
    with pytest.raises(ConfigError) as err:
        load_model_config(path, MegatronConfig)
    assert "expert_model_parallel_size: must be >= 1, got 0" in str(err.value)
    assert "moe_aux_loss_coeff: must be >= 0, got -0.1" in str(err.value)
