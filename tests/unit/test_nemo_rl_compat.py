"""NeMo RL's generation config and refit world size, mapped onto chatgen's (pure logic: no engine).

python -m pytest tests/unit/test_nemo_rl_compat.py
"""

import pytest
import torch

from chatgen.compat.nemo_rl import NemoRLRefit
from chatgen.compat.nemo_rl.config import engine_config
from chatgen.generation.config import GenerationConfig


def test_seed_000s_config_becomes_chatgen_keys_every_one_known():
    nemo = engine_config(
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
    keys, stops = nemo.keys, nemo.stops
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
        ({"model_name": "m", "max_tokens": 3}, "max_tokens is not a key of NeMo RL's config"),
        (
            {"model_name": "m", "vllm_cfg": {"max_len": 3}},
            "vllm_cfg.max_len is not a key of NeMo RL's config",
        ),
        ({"model_name": "m", "vllm_cfg": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size"),
        ({"model_name": "m", "backend": "hf"}, "backend='hf'"),
        ({"max_new_tokens": 3}, "Missing required keys in VllmConfig: model_name"),
    ],
)
def test_a_key_chatgen_cannot_honour_is_named(config, match):
    with pytest.raises(ValueError, match=match):
        engine_config(config)


def test_the_configs_stops_come_before_each_rows_own(monkeypatch):
    """VllmGenerationWorker.sampling_params: the config's stops (NeMo RL's stop_token_ids /
    stop_strings) joined before a row's own, for every call; the texts keep their stop string."""
    import types

    from chatgen.generation import workers
    from chatgen.generation.vllm.module import VLLMModule

    monkeypatch.setattr(
        VLLMModule, "sampling_params", lambda self, n, **kw: types.SimpleNamespace(**kw)
    )

    def worker(stops):  # no engine: only what sampling_params reads
        w = workers.VllmGenerationWorker.__new__(workers.VllmGenerationWorker)
        w.stops = stops
        return w

    params = worker({"stop_token_ids": [2], "stop_strings": ["</a>"]}).sampling_params(
        3, stop_token_ids=[7], stop_strings=()
    )
    assert params.stop_token_ids == [2, 7] and params.stop_strings == ["</a>"]
    assert params.include_stop_str_in_output is True and params.output_text_buffer_length == 0
    bare = worker({}).sampling_params(3, stop_token_ids=[7])
    assert bare.stop_token_ids == [7] and bare.stop_strings == []


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
