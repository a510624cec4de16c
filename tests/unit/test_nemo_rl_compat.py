"""NeMo RL's generation config and refit world size, mapped onto chatgen's (pure logic: no engine).

python -m pytest tests/unit/test_nemo_rl_compat.py
"""

import pytest
import torch

from chatgen.compat.nemo_rl import NemoRLRefit
from chatgen.compat.nemo_rl.config import engine_config, with_stops
from chatgen.generation.config import GenerationConfig


def test_seed_000s_config_becomes_chatgen_keys_every_one_known():
    keys, stops = engine_config(
        {
            "backend": "vllm",
            "max_new_tokens": 128,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "model_name": "/models/llama",
            "stop_token_ids": [2],
            "vllm_cfg": {
                "tensor_parallel_size": 1,
                "gpu_memory_utilization": 0.9,
                "max_model_len": 2048,
                "load_format": "auto",
                "skip_tokenizer_init": True,
                "precision": "bfloat16",
            },
            "vllm_kwargs": {"enforce_eager": True},
        }
    )
    assert keys == {
        "load": "/models/llama",
        "max_new_tokens": 128,
        "new_token_limit": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "seq_length": 2048,
        "load_format": "auto",
        "dtype": "bfloat16",
        "enforce_eager": True,
    }
    known = set(GenerationConfig.__dataclass_fields__) | {
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "enforce_eager",
    }
    assert set(keys) <= known  # every key one the engine's config reads
    assert stops == {"stop_token_ids": [2], "stop_strings": []}


@pytest.mark.parametrize(
    "config, match",
    [
        ({"model_name": "m", "max_tokens": 3}, r"unknown config key\(s\) \['max_tokens'\]"),
        (
            {"model_name": "m", "vllm_cfg": {"max_len": 3}},
            r"unknown vllm_cfg key\(s\) \['max_len'\]",
        ),
        ({"model_name": "m", "vllm_cfg": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size"),
        ({"model_name": "m", "backend": "hf"}, "backend='hf'"),
        ({"max_new_tokens": 3}, "needs model_name"),
    ],
)
def test_a_key_chatgen_cannot_honour_is_named(config, match):
    with pytest.raises(ValueError, match=match):
        engine_config(config)


def test_the_configs_stops_join_each_rows_own():
    batch = {"input_ids": torch.zeros(2, 3), "stop_token_ids": [[7], None]}
    out = with_stops(batch, {"stop_token_ids": [2], "stop_strings": ["</a>"]})
    assert out["stop_token_ids"] == [[2, 7], [2]] and out["stop_strings"] == [["</a>"], ["</a>"]]
    assert batch["stop_token_ids"] == [[7], None]  # the caller's batch untouched


class _Group(NemoRLRefit):
    inference_world_size = 4

    def open_weight_channel(self, ip, port, world_size):
        return [(ip, port, world_size)]


def test_init_collective_takes_the_seeds_world_size():
    group = _Group()
    # training world + inference world; the group chatgen forms: the trainer's rank 0 + 4 engine ranks
    assert group.init_collective("h", 1, 1 + 4) == [("h", 1, 5)]
    assert group.init_collective("h", 1, 8 + 4) == [("h", 1, 5)]
    assert group.init_collective("h", 1, 8 + 4, train_world_size=8) == [("h", 1, 5)]
    with pytest.raises(ValueError, match="training ranks"):
        group.init_collective("h", 1, 4)
    with pytest.raises(ValueError, match="train_world_size=2"):
        group.init_collective("h", 1, 8 + 4, train_world_size=2)


def test_a_placement_is_checked_before_any_engine_starts():
    import ray

    from chatgen.compat.nemo_rl import VllmGeneration

    with pytest.raises(ValueError, match="placement='gpu' is not one of"):
        VllmGeneration({"model_name": "/nowhere"}, placement="gpu")
    if not ray.is_initialized():
        with pytest.raises(RuntimeError, match=r"needs a running Ray: call ray.init"):
            VllmGeneration({"model_name": "/nowhere"}, num_workers=2, placement="ray")
