# python scripts/gpu_probe.py --output probe.json [--small] [--trainer KEY=VALUE ...]   (scripts/gpu_run.sh runs it; docs/gpu.md)
"""A ~360M-parameter probe of the trainer and the hf engine on one GPU: what a colocated run does per episode,
each phase timed with its peak memory.

Builds a random Llama of 24 layers x hidden 1024 (377M parameters; --small: the tiny test model's shape, for the
CPU simulation), then: trainer start (bf16, megatron DDP + distributed optimizer), a warm-up train step, and two
episodes of: a train step, offload and onload (seconds, bytes freed on the GPU), a weight sync into an hf engine on
random weights (seconds, bytes), greedy generation (seconds, tokens/s, ms per forward step). `phases` holds the
first episode (host buffers pinned on first use), `steady` the second (what each later episode costs), plus
generation at 8x the batch (how much of a step's cost is fixed). On GPU each phase's peak is torch's
max_memory_allocated since the phase began; without CUDA the process's peak RSS at the end of the phase.
Writes one JSON file.
"""

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import yaml

from chatgen.core.imports import import_class
from chatgen.generation.base import load_backend
from chatgen.models import tiny
from chatgen.param_sync import sync_weights
from chatgen.training.megatron_module import MegatronModule

REPO = Path(__file__).resolve().parents[1]
PROBE = [
    "hidden_size=1024",
    "intermediate_size=4096",
    "num_hidden_layers=24",
    "num_attention_heads=16",
    "num_key_value_heads=8",
    "max_position_embeddings=2048",
]
CUDA = torch.cuda.is_available()


class Phases:
    """{phase: {seconds, peak_gib, ...}}: each `with phases("name"):` block timed, its peak memory recorded."""

    def __init__(self):
        self.result = {}

    def __call__(self, name, **extra):
        phases = self

        class Phase:
            def __enter__(self):
                if CUDA:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                self.t0 = time.perf_counter()
                phases.result[name] = dict(extra)
                return phases.result[name]

            def __exit__(self, *exc):
                if CUDA:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - self.t0
                peak = (
                    torch.cuda.max_memory_allocated()
                    if CUDA
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                )
                phases.result[name].update(
                    seconds=round(seconds, 4), peak_gib=round(peak / 2**30, 3)
                )

        return Phase()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def nll(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


def episode(trainer, engine, phases, ids, prompts) -> None:
    """One colocated episode's phases: a train step, offload and onload, the weight sync (the trainer's
    gradients and optimizer state offloaded, as a run does before the engine's turn), greedy generation."""
    with phases("train_step", tokens=ids.numel()) as p:
        p["loss"] = trainer.train_step({"input_ids": ids}, nll)["loss"]
    before = allocated()
    with phases("offload") as p:
        trainer.offload()
    p["freed_gib"] = round((before - allocated()) / 2**30, 3)
    with phases("onload"):
        trainer.onload()
    trainer.offload(params=False)
    with phases("sync") as p:
        report = sync_weights(trainer, engine)
    p.update(bytes=report.bytes, tensors=report.tensors)
    generation(engine, phases, "generate", prompts)
    trainer.onload()


def generation(engine, phases, name, prompts) -> None:
    """Greedy generation of `prompts` as phase `name`: seconds, tokens, tokens/s, ms per forward step."""
    with phases(name) as p:
        outputs = engine.finished(prompts, greedy=True)
    p["tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
    p["tokens_per_s"] = round(p["tokens"] / p["seconds"], 1)
    p["ms_per_step"] = round(1000 * p["seconds"] / engine.metrics["engine_steps"], 2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument(
        "--small", action="store_true", help="the tiny model's shape (CPU simulation)"
    )
    parser.add_argument(
        "--trainer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer config key (YAML value), e.g. activation_recompute=selective; repeatable",
    )
    args = parser.parse_args(argv)
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.trainer)}
    batch, seq, new_tokens = (2, 64, 8) if args.small else (8, 1024, 128)
    phases, steady, out = (
        Phases(),
        Phases(),
        {
            "cuda": CUDA,
            "device": torch.cuda.get_device_name(0) if CUDA else "cpu",
            "trainer": extra,
        },
    )
    with tempfile.TemporaryDirectory(prefix="chatgen-probe-") as work:
        spec = tiny.load_spec(REPO / "configs/models/tiny_llama.yaml", [] if args.small else PROBE)
        with phases("build_model"):
            model_dir = tiny.make_tiny_model(spec, Path(work) / "model")
        dtype = "bfloat16" if CUDA else "float32"
        with phases("trainer_start"):
            trainer = MegatronModule(
                dict(load=str(model_dir), dtype=dtype, lr=1e-5, seq_length=seq, **extra)
            ).start()
        out["parameters"] = sum(p.numel() for p in trainer.model.parameters())
        ids = torch.randint(
            0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
        )
        trainer.train_step({"input_ids": ids}, nll)  # warm-up: kernels, allocator, optimizer state
        backend = load_backend("hf")
        engine = import_class(backend.MODULE)(
            dict(
                load=str(model_dir),
                load_format="dummy",
                dtype=dtype,
                seed=0,
                temperature=0.0,
                new_token_limit=True,
                max_new_tokens=new_tokens,
                logprobs_mode="raw",
            ),
            name="engine",
        ).start()
        prompts = [{"input_ids": ids[i, :32].tolist()} for i in range(batch)]
        try:
            # round 1: each phase's first time (host buffers pinned, kernels picked); round 2: an episode's
            # steady state, what every later episode costs
            for record in (phases, steady):
                episode(trainer, engine, record, ids, prompts)
            trainer.offload(params=False)
            engine.finished(prompts * 8, greedy=True)  # this shape's first call picks its kernels
            # the per-step cost's share that is fixed
            generation(engine, steady, "generate_8x_batch", prompts * 8)
        finally:
            engine.shutdown()
            trainer.shutdown()
    out["phases"], out["steady"] = phases.result, steady.result
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
