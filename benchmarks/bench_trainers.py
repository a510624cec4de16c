# python benchmarks/bench_trainers.py --output outputs/bench_trainers.json [--model DIR] [--rounds 10]
"""The two trainer backends side by side: train-step time and peak memory of the fsdp trainer (transformers +
torch FSDP2, chatgen/training/fsdp_module.py) against the megatron one, on the same model and batch.

Time: both trainers are built in one process (one rank) and take their train steps alternately, fsdp then
megatron, --rounds times after one warm-up step each, so that a change of the machine's load hits both
alike; reported are each backend's median step and the fsdp / megatron ratio. Memory: each backend in a
fresh process of its own takes --steps steps; on GPU the peak of torch.cuda.max_memory_allocated, on CPU
the process's peak resident memory above what it held before the model was built (both import the same
libraries first; the resident high-water mark is reset after the imports). Prints the figures with `uptime`'s load and writes them as JSON to --output.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_generation import tiny_model  # noqa: E402


def batch(rows: int, length: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 2 :] = 1  # the loss reads the second half, as a response after a prompt
    return {
        "input_ids": torch.randint(4, vocab, (rows, length), generator=gen),
        "loss_mask": mask,
    }


def nll(logprobs, mb):
    mask = mb["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {}


def build(backend: str, model_dir: str):
    if backend == "fsdp":
        from chatgen.training.fsdp_module import FSDPModule as cls
    else:
        from chatgen.training.megatron_module import MegatronModule as cls
    return cls(dict(load=model_dir, lr=1e-5, pack_shared_prefix=False)).start()


def step_seconds(trainer, data) -> float:
    start = time.perf_counter()
    trainer.train_step(data, nll)
    return time.perf_counter() - start


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def memory(backend: str, model_dir: str, rows: int, length: int, steps: int) -> float:
    """Peak bytes of one backend's training (see the module docstring); run in a fresh process. On CPU the
    high-water mark of resident memory is reset (Linux: /proc/self/clear_refs) once the libraries are
    imported, so the figure is the model's, not the imports'."""
    import torch

    import chatgen.training.fsdp_module  # noqa: F401 - both backends' imports, whichever runs
    import chatgen.training.megatron_module  # noqa: F401

    if not torch.cuda.is_available():
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    trainer = build(backend, model_dir)
    data = batch(rows, length, trainer.hf_config["vocab_size"])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        trainer.train_step(data, nll)
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(_status_bytes("VmHWM") - before)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument(
        "--model",
        default=str(REPO / "outputs" / "bench-tiny-llama"),
        help="HF model directory (a family both backends train); the tiny Llama is built if missing",
    )
    parser.add_argument("--rounds", type=int, default=10, help="alternated steps per backend")
    parser.add_argument("--steps", type=int, default=3, help="steps of each memory measurement")
    parser.add_argument("--rows", type=int, default=16, help="samples per train step")
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    parser.add_argument("--memory-of", choices=["fsdp", "megatron"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model_dir = str(
        tiny_model(args.model) if args.model.endswith("bench-tiny-llama") else args.model
    )
    if args.memory_of:  # the child of a memory measurement
        print(json.dumps(memory(args.memory_of, model_dir, args.rows, args.length, args.steps)))
        return 0

    trainers = {name: build(name, model_dir) for name in ("fsdp", "megatron")}
    data = batch(args.rows, args.length, trainers["fsdp"].hf_config["vocab_size"])
    times = {name: [] for name in trainers}
    for name, trainer in trainers.items():
        step_seconds(trainer, data)  # warm-up
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            times[name].append(step_seconds(trainer, data))
    peaks = {}
    for name in trainers:
        child = [sys.executable, __file__, "--output", args.output, "--model", model_dir]
        child += [
            "--steps",
            str(args.steps),
            "--rows",
            str(args.rows),
            "--length",
            str(args.length),
        ]
        done = subprocess.run(
            [*child, "--memory-of", name], capture_output=True, text=True, check=True
        )
        peaks[name] = json.loads(done.stdout.strip().splitlines()[-1])
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "model": model_dir,
        "rows": args.rows,
        "length": args.length,
        "rounds": args.rounds,
        "device": "cuda" if trainers["fsdp"].device.type == "cuda" else "cpu",
        "step_seconds_median": median,
        "step_seconds": times,
        "peak_bytes": peaks,
        "time_ratio_fsdp_over_megatron": median["fsdp"] / median["megatron"],
        "memory_ratio_fsdp_over_megatron": peaks["fsdp"] / peaks["megatron"],
        "load_average": os.getloadavg(),
    }
    print(
        f"train step: fsdp {median['fsdp'] * 1e3:.1f} ms, megatron {median['megatron'] * 1e3:.1f} ms "
        f"(x{result['time_ratio_fsdp_over_megatron']:.2f}); peak memory: fsdp "
        f"{peaks['fsdp'] / 2**20:.0f} MiB, megatron {peaks['megatron'] / 2**20:.0f} MiB "
        f"(x{result['memory_ratio_fsdp_over_megatron']:.2f}); "
        f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
