"""A run's per-GPU memory estimate, for `chatgen config`: each Megatron trainer's step
(chatgen.training. memory_estimate) and, when a generation model shares its GPUs
(runtime.colocation), the engine's share in the two phases a colocated run alternates: training (the
engine asleep: its KV cache freed, weights in host memory) and generating (the trainer offloaded as
its offload_* keys say).

    lines, warnings = memory_report(cfg, device_bytes=80 << 30)
"""

import json
from pathlib import Path

from chatgen.rlhf.placement import TRAINER_BACKENDS, engine_tp, model_world_size
from chatgen.training.memory_estimate import (
    BYTES,
    GIB,
    Shape,
    engine_memory,
    trainer_memory,
)

CONTEXT_BYTES = GIB  # a CUDA context + NCCL buffers per process, roughly
# a CPU run's process before any tensor of its own: torch, vLLM, megatron-core and the tokenizer
# resident (measured: the tiny GRPO job's process, benchmarks/bench_long_context.py)
HOST_BASE_BYTES = int(0.75 * GIB)


def _shape(load) -> Shape | str:
    """The model's sizes, or why there is no estimate."""
    path = Path(str(load or "")) / "config.json"
    if not path.is_file():
        return f"{path} is not readable here"
    try:
        return Shape.from_hf_config(json.loads(path.read_text()))
    except (KeyError, ValueError) as e:
        return f"{path} lacks {e}"


def shape_positions(load) -> int:
    """The model's max_position_embeddings: what a trainer without seq_length accepts."""
    return json.loads((Path(str(load)) / "config.json").read_text()).get(
        "max_position_embeddings", 4096
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def memory_report(cfg, device_bytes: int) -> tuple[list[str], list[str]]:
    """(lines to print, warnings) for every Megatron model of `cfg` whose `load` has a readable
    config.json."""
    lines, warnings = [], []
    groups = [set(g) for g in cfg.runtime.colocation]
    for name, entry in cfg.models.items():
        if entry.backend != "megatron":
            continue
        c = entry.config
        shape = _shape(c.load)
        if isinstance(shape, str):
            lines.append(f"{name}: no estimate ({shape})")
            continue
        tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
        dp = max(1, model_world_size(entry) // (tp * pp))
        seq, micro = (
            c.seq_length or shape_positions(c.load),
            c.micro_batch_size or cfg.runtime.train_micro_batch_size,
        )
        t = trainer_memory(
            shape,
            tp=tp,
            pp=pp,
            dp=dp,
            seq_length=seq,
            micro_batch_size=micro,
            dtype=c.dtype,
            grad_reduce_dtype=c.grad_reduce_dtype,
            recompute=c.activation_recompute,
            recompute_layers=c.recompute_num_layers,
            sequence_parallel=c.sequence_parallel,
        )
        lines.append(
            f"{name} (TP {tp} x PP {pp} x DP {dp}, {micro} x {seq} tokens a micro-batch, recompute "
            f"{c.activation_recompute}): "
            + ", ".join(f"{k} {_gib(v)}" for k, v in t.items())
            + " GiB"
        )
        train_phase, generate_phase = t["total"] + CONTEXT_BYTES, CONTEXT_BYTES
        kept = {
            "weights": c.offload_params,
            "gradients": c.offload_grads,
            "optimizer": c.offload_optimizer,
        }
        generate_phase += sum(t[k] for k, offloaded in kept.items() if not offloaded)
        engines = [
            n
            for g in groups
            if name in g
            for n in g
            if cfg.models[n].backend not in (*TRAINER_BACKENDS, "python")
        ]
        for engine in engines:
            e_entry = cfg.models[engine]
            util = getattr(e_entry.config, "gpu_memory_utilization", None)
            if util is None:
                continue
            e = engine_memory(
                shape,
                tp=engine_tp(e_entry),
                dtype=e_entry.config.dtype,
                device_bytes=device_bytes,
                gpu_memory_utilization=util,
            )
            lines.append(
                f"{engine} (TP {engine_tp(e_entry)}, gpu_memory_utilization {util}): weights "
                f"{_gib(e['weights'])}, KV cache {_gib(e['kv_cache'])} GiB = {e['kv_tokens']:,} tokens"
            )
            longest = getattr(e_entry.config, "seq_length", None) or seq
            if e["kv_tokens"] < longest:  # vLLM refuses to start: not one sequence fits
                warnings.append(
                    f"{engine}: its KV cache holds ~{e['kv_tokens']:,} tokens, less than one "
                    f"sequence of seq_length {longest}; raise gpu_memory_utilization (or "
                    "kv_cache_memory_bytes), more TP, or a shorter seq_length / max_new_tokens"
                )
            generate_phase += e["total"]
            train_phase += CONTEXT_BYTES  # the sleeping engine's process
        lines.append(
            f"per GPU: training {_gib(train_phase)} GiB, generating {_gib(generate_phase)} GiB of "
            f"{_gib(device_bytes)}"
        )
        for phase, used in (("training", train_phase), ("generating", generate_phase)):
            if used > device_bytes:
                warnings.append(
                    f"{name}: the {phase} phase needs ~{_gib(used)} GiB a GPU, more than the device's "
                    f"{_gib(device_bytes)}; set activation_recompute: selective (or full), "
                    "sequence_parallel: true with TP > 1, more TP / PP, a shorter seq_length or a "
                    "smaller micro_batch_size"
                    + (" / gpu_memory_utilization" if phase == "generating" else "")
                )
    return lines, warnings


def host_estimate(cfg) -> dict:
    """{part: bytes} of a CPU run's memory: every model of the run in one process (colocated, as
    the CPU recipes run), its peak while training: HOST_BASE_BYTES, each Megatron trainer's step
    (trainer_memory at its seq_length, micro-batch, dtype and recompute: weights, fp32 gradients,
    Adam, the backward's activations, fp32 logits; plus the two s x s attention gradients of one
    layer's backward), and each vLLM engine's weights and KV cache
    (kv_cache_memory_bytes; on CPU the engine keeps both while the trainer trains, unless its
    release_during_training frees them), plus "total"."""
    out = {"base": HOST_BASE_BYTES}
    for name, entry in cfg.models.items():
        c = entry.config
        if entry.backend != "megatron" or isinstance(shape := _shape(c.load), str):
            continue
        t = trainer_memory(
            shape,
            seq_length=c.seq_length or shape_positions(c.load),
            micro_batch_size=c.micro_batch_size or cfg.runtime.train_micro_batch_size,
            dtype=c.dtype,
            grad_reduce_dtype=c.grad_reduce_dtype,
            recompute=c.activation_recompute,
            recompute_layers=c.recompute_num_layers,
        )
        out.update({f"{name}/{k}": v for k, v in t.items() if k != "total"})
        # megatron-core's local attention (the only one on CPU) is unfused: a layer's backward also
        # holds the gradients of its (b, a, s, s) probabilities and scores, in float32 (measured:
        # Korthikanti's stored activations alone miss ~40% of the peak at 4K tokens)
        s = c.seq_length or shape_positions(c.load)
        b = c.micro_batch_size or cfg.runtime.train_micro_batch_size
        out[f"{name}/attention_backward"] = 2 * 4 * shape.heads * s * s * b
        for engine, e_entry in cfg.models.items():
            load = getattr(e_entry.config, "load", None)
            released = getattr(e_entry.config, "release_during_training", False)
            if (
                e_entry.backend == "vllm"
                and str(load) == str(c.load)
                and f"{engine}/kv" not in out
                and not released
            ):
                out[f"{engine}/weights"] = shape.params() * BYTES[e_entry.config.dtype]
                out[f"{engine}/kv"] = e_entry.config.kv_cache_memory_bytes or 0
    out["total"] = sum(out.values())
    return out


def host_warnings(cfg, estimate: dict, host_bytes: int) -> list[str]:
    """A warning naming the keys to change when a CPU run's estimate exceeds the host's memory."""
    if estimate["total"] <= host_bytes:
        return []
    biggest = max((k for k in estimate if k not in ("total", "base")), key=estimate.get)
    return [
        f"the run needs ~{_gib(estimate['total'])} GiB of host memory, more than this machine's "
        f"{_gib(host_bytes)} (the most: {biggest} {_gib(estimate[biggest])} GiB); lower the trainer's "
        "seq_length or micro_batch_size (max_new_tokens of the policy), set its "
        "activation_recompute: full, or lower the policy's kv_cache_memory_bytes"
    ]
