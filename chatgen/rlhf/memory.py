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
from chatgen.training.memory_estimate import GIB, Shape, engine_memory, trainer_memory

CONTEXT_BYTES = GIB  # a CUDA context + NCCL buffers per process, roughly


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
