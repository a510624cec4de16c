"""`chatgen config`'s memory estimate at long sequences (chatgen.rlhf.memory.host_estimate for a CPU
run, memory_report's KV check on GPUs) and its warnings, which name the keys to change. The measured
side is benchmarks/bench_long_context.py (docs/long_context.md).

    python -m pytest tests/unit/test_long_context_memory.py
"""

import json
from pathlib import Path

import pytest

from chatgen.rlhf.memory import HOST_BASE_BYTES, host_estimate, host_warnings, memory_report
from chatgen.training.memory_estimate import GIB

REPO = Path(__file__).resolve().parents[2]
TINY = dict(  # outputs/tiny-llama-sft's sizes, with a 16K context
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=352,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=16384,
)


def _config(tmp_path, length, *overrides):
    from chatgen.rlhf.config import load_config

    model = tmp_path / "tiny16k"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY))
    return load_config(
        REPO / "configs/grpo_tiny.yaml",
        [
            f"policy.load={model}",
            f"policy_trainer.load={model}",
            f"policy.max_new_tokens={length}",
            f"policy.seq_length={length + 64}",
            f"policy_trainer.seq_length={length + 64}",
            "runtime.train_micro_batch_size=1",
            *overrides,
        ],
    )


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_host_estimate_counts_each_part_by_its_formula(tmp_path, recompute):
    s, b, h, a, layers, vocab = 8192 + 64, 1, 128, 4, 2, 512
    cfg = _config(tmp_path, 8192, f"policy_trainer.activation_recompute={recompute}")
    e = host_estimate(cfg)
    # float32 activations: twice Korthikanti et al.'s 16-bit bytes, per layer s*b*h*(34 + 5*a*s/h)
    per_layer = s * b * h * (34 + 5 * a * s / h)
    if recompute == "none":
        assert e["policy_trainer/activations"] == int(2 * layers * per_layer)
    else:  # each layer's input kept, one layer's whole set while it is recomputed
        assert e["policy_trainer/activations"] == int(2 * (layers * 2 * s * b * h + per_layer))
    assert e["policy_trainer/logits"] == 2 * 4 * s * b * vocab  # fp32 logits and log-softmax
    # one layer's backward: the float32 gradients of its probabilities and scores
    assert e["policy_trainer/attention_backward"] == 2 * 4 * a * s * s * b
    assert e["policy/kv"] == cfg.models["policy"].config.kv_cache_memory_bytes
    assert e["base"] == HOST_BASE_BYTES
    assert e["total"] == sum(v for k, v in e.items() if k != "total")


def test_the_estimate_grows_with_the_sequence_and_recompute_bounds_it(tmp_path):
    totals = [host_estimate(_config(tmp_path, n))["total"] for n in (1024, 4096, 8192)]
    assert totals[0] < totals[1] < totals[2]
    none = host_estimate(_config(tmp_path, 8192))["policy_trainer/activations"]
    full = host_estimate(_config(tmp_path, 8192, "policy_trainer.activation_recompute=full"))
    # with recompute the layers' s^2 attention terms are not all kept at once
    assert full["policy_trainer/activations"] < 0.6 * none


def test_a_cpu_run_that_does_not_fit_is_warned_naming_the_keys(tmp_path):
    cfg = _config(tmp_path, 8192)
    e = host_estimate(cfg)
    assert host_warnings(cfg, e, e["total"]) == []
    (warning,) = host_warnings(cfg, e, e["total"] - 1)
    for key in ("seq_length", "micro_batch_size", "activation_recompute", "kv_cache_memory_bytes"):
        assert key in warning
    assert "policy_trainer/activations" in warning  # the biggest part, named


def test_a_gpu_engine_whose_kv_cache_holds_no_whole_sequence_is_warned(tmp_path):
    big = dict(TINY, num_hidden_layers=80, hidden_size=8192, num_attention_heads=64)
    big.update(num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256)
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(big))
    from chatgen.rlhf.config import load_config

    def report(util):
        cfg = load_config(
            REPO / "configs/grpo_tiny.yaml",
            [
                f"policy.load={model}",
                f"policy_trainer.load={model}",
                "policy.dtype=bfloat16",
                "policy_trainer.dtype=bfloat16",
                "policy.max_new_tokens=8192",
                "policy.seq_length=16384",
                "policy_trainer.seq_length=16384",
                "policy_trainer.activation_recompute=full",
                "models.policy_trainer.num_gpu=8",
                "models.policy.num_gpu=8",
                "policy.tensor_parallel_size=8",
                "policy_trainer.tensor_model_parallel_size=8",
                f"policy.gpu_memory_utilization={util}",
            ],
        )
        return memory_report(cfg, 80 * GIB)[1]

    (kv,) = [w for w in report(0.22) if "KV cache" in w]
    assert "gpu_memory_utilization" in kv and "seq_length 16384" in kv
    assert not [w for w in report(0.9) if "KV cache" in w]


def test_chatgen_config_prints_the_host_estimate_and_warns_before_the_run(tmp_path, capsys):
    from chatgen.cli.config import print_memory_estimate

    print_memory_estimate(_config(tmp_path, 1024))
    out, err = capsys.readouterr()
    assert "host memory estimate of this CPU run" in out and "policy_trainer/activations" in out
    assert err == ""
    # 64 heads at 16K tokens: the attention's s x s gradients alone are ~128 GiB
    wide = dict(TINY, num_attention_heads=64, head_dim=2)
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps(wide))
    cfg = _config(
        tmp_path,
        16000,
        f"policy.load={tmp_path / 'wide'}",
        f"policy_trainer.load={tmp_path / 'wide'}",
    )
    print_memory_estimate(cfg)
    err = capsys.readouterr().err
    assert (
        "chatgen config: warning:" in err and "seq_length" in err and "activation_recompute" in err
    )


def test_host_estimate_leaves_out_an_engine_released_during_training(tmp_path):
    from chatgen.rlhf.memory import host_estimate

    kept = host_estimate(_config(tmp_path, 1024))
    released = host_estimate(_config(tmp_path, 1024, "policy.release_during_training=true"))
    assert kept["policy/weights"] > 0 and "policy/weights" not in released
    assert kept["total"] - released["total"] == kept["policy/weights"] + kept["policy/kv"]
