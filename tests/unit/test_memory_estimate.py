"""The per-GPU memory estimate (chatgen.training.memory_estimate, chatgen.rlhf.memory) and the memory keys' checks.

.venv/bin/python -m pytest tests/unit/test_memory_estimate.py
"""

import json
from pathlib import Path

import pytest

from chatgen.training.memory_estimate import (
    GIB,
    Shape,
    activation_bytes,
    engine_memory,
    trainer_memory,
)

REPO = Path(__file__).resolve().parents[2]
QWEN2_7B = dict(
    num_hidden_layers=28,
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
)
LLAMA_70B = Shape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)


def test_parameter_and_kv_counts_match_the_published_models():
    qwen = Shape.from_hf_config(QWEN2_7B)
    # Qwen2.5-7B: 7.61B (its q/k/v biases left out)
    assert qwen.params() == pytest.approx(7.62e9, rel=0.01)
    assert LLAMA_70B.params() == pytest.approx(70.55e9, rel=0.01)
    assert qwen.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2  # K and V, bf16


def test_trainer_parts_follow_the_layout_and_keys():
    qwen = Shape.from_hf_config(QWEN2_7B)
    base = trainer_memory(qwen, tp=4, dp=2, seq_length=2048, micro_batch_size=4)
    assert base["weights"] == pytest.approx(qwen.params() * 2 / 4, rel=0.01)
    assert base["gradients"] == 2 * base["weights"]  # float32 buffers under bf16 weights
    # the distributed optimizer shards over DP
    assert trainer_memory(qwen, tp=4, dp=4, seq_length=2048, micro_batch_size=4)[
        "optimizer"
    ] == pytest.approx(base["optimizer"] / 2, rel=1e-6)
    half = trainer_memory(
        qwen, tp=4, dp=2, seq_length=2048, micro_batch_size=4, grad_reduce_dtype="bfloat16"
    )
    assert half["gradients"] == base["weights"]
    assert base["total"] == sum(v for k, v in base.items() if k != "total")


def test_recompute_and_sequence_parallel_lower_activations():
    qwen = Shape.from_hf_config(QWEN2_7B)
    none, selective, full = (
        activation_bytes(qwen, 4096, 1, tp=4, recompute=r) for r in ("none", "selective", "full")
    )
    assert full < selective < none
    assert activation_bytes(qwen, 4096, 1, tp=4, sequence_parallel=True) < none
    # linear in the batch
    assert activation_bytes(qwen, 4096, 2, tp=4) == pytest.approx(2 * none, rel=1e-6)
    assert activation_bytes(qwen, 4096, 1, tp=4, dtype="float32") == pytest.approx(
        2 * none, rel=1e-6
    )


def test_engine_kv_cache_is_what_its_weights_leave():
    e = engine_memory(LLAMA_70B, tp=8, device_bytes=80 * GIB, gpu_memory_utilization=0.35)
    assert e["weights"] + e["kv_cache"] + GIB == e["total"] == int(0.35 * 80 * GIB)
    assert e["kv_tokens"] == e["kv_cache"] // (LLAMA_70B.kv_bytes_per_token() // 8)
    # docs/scaling.md: ~230-280K tokens a replica, not the ~524K wanted
    assert 200_000 < e["kv_tokens"] < 300_000


def _config(tmp_path, *overrides):
    from chatgen.rlhf.config import load_config

    model = tmp_path / "qwen7b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps({**QWEN2_7B, "architectures": ["Qwen2ForCausalLM"]})
    )
    return load_config(
        REPO / "configs/grpo_tiny.yaml",
        [
            f"policy.load={model}",
            f"policy_trainer.load={model}",
            "policy_trainer.dtype=bfloat16",
            "policy.dtype=bfloat16",
            "models.policy_trainer.num_gpu=8",
            "models.policy.num_gpu=8",
            "models.policy.num_replicas=4",
            "policy.tensor_parallel_size=2",
            "policy.gpu_memory_utilization=0.4",
            "policy_trainer.tensor_model_parallel_size=4",
            "runtime.train_micro_batch_size=4",
            *overrides,
        ],
    )


def test_memory_report_warns_when_a_phase_exceeds_the_device(tmp_path):
    from chatgen.rlhf.memory import memory_report

    lines, warnings = memory_report(_config(tmp_path, "policy_trainer.seq_length=8192"), 80 * GIB)
    assert any(line.startswith("policy_trainer (TP 4 x PP 1 x DP 2") for line in lines), lines
    assert (
        len(warnings) == 1
        and "training phase" in warnings[0]
        and "activation_recompute" in warnings[0]
    )
    lines, warnings = memory_report(
        _config(
            tmp_path, "policy_trainer.seq_length=8192", "policy_trainer.activation_recompute=full"
        ),
        80 * GIB,
    )
    assert warnings == [], (lines, warnings)


def test_memory_keys_are_checked():
    from chatgen.training.config import MegatronConfig

    problems = dict(MegatronConfig(sequence_parallel=True).check())
    assert "tensor_model_parallel_size > 1" in problems["sequence_parallel"]
    problems = dict(MegatronConfig(dtype="bfloat16", grad_reduce_dtype="float16").check())
    assert "float32, bfloat16 or null" in problems["grad_reduce_dtype"]
    assert not dict(
        MegatronConfig(
            dtype="bfloat16",
            grad_reduce_dtype="bfloat16",
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            activation_recompute="full",
        ).check()
    )


def test_partial_recompute_lies_between_none_and_full():
    """recompute_num_layers: N of L layers recompute, the others keep everything: N = L is full,
    and each layer less recomputed adds what one layer of `none` keeps beyond full's input."""
    at = lambda **kw: activation_bytes(LLAMA_70B, 1024, 2, **kw)  # noqa: E731
    full, none = at(recompute="full"), at(recompute="none")
    layers = LLAMA_70B.layers
    assert at(recompute="full", recompute_layers=layers) == full
    partial = [at(recompute="full", recompute_layers=n) for n in range(layers, 0, -1)]
    assert full < partial[-1] and partial == sorted(partial)
    assert partial[-1] < none + none // layers  # one layer recomputed: about none's
