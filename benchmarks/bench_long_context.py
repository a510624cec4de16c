# .venv/bin/python benchmarks/bench_long_context.py --output /tmp/bench_long_context.json [--lengths 1024 4096 8192]
"""GRPO episodes of the tiny model with long responses on CPU: the peak memory of each phase, measured,
against `chatgen config`'s estimate (chatgen.rlhf.memory.memory_report), at each response length.

For each length L (a fresh process each): configs/grpo_tiny.yaml for one episode of 2 prompts x n 2
responses of exactly L tokens (policy.ignore_eos: true, max_new_tokens L), the trainer at
micro_batch_size 1 with activation_recompute: full, seq_length L + 64. The model is the tiny SFT
Llama (outputs/tiny-llama-sft, examples/prepare_tiny.sh) with its max_position_embeddings raised to
16384 (a made-up longer context: RoPE needs no other change; the weights are the same). A thread
samples the process's resident memory every 10 ms and files each sample under the phase running
(the run's PhaseTimer: generate, train, sync, ...; "startup" before the first); the whole run is one
process (colocated), so the process's peak RSS is the run's. Writes {L: {"peak_rss_gib",
"phases": {phase: peak GiB}, "estimate_gib", "estimate_parts_gib", "error": estimate / peak - 1,
"seconds"}} and the machine's load to --output.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_BUDGET = 64  # sort_digits prompts are ~20 tokens


def make_model(out: Path) -> Path:
    """The tiny SFT Llama with a 16K context (config.json edited; same weights)."""
    src = REPO / "outputs" / "tiny-llama-sft"
    if not (src / "config.json").is_file():
        sys.exit(f"{src} is missing: run examples/prepare_tiny.sh first")
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def overrides(length: int, out_dir: str) -> list:
    seq = length + PROMPT_BUDGET
    return [
        "runtime.num_episode=1",
        "runtime.sample_per_episode=4",
        "runtime.generation_batch_size=4",
        "runtime.train_micro_batch_size=1",
        "runtime.train_global_batch_size=4",
        "runtime.eval_episode_interval=null",
        "runtime.save_episode_interval=null",
        f"runtime.output_dir={out_dir}",
        "policy.n=2",
        "policy.ignore_eos=true",
        "policy.stop_token_list=''",  # no stop string either: every response is L tokens
        f"policy.max_new_tokens={length}",
        f"policy.seq_length={seq}",
        # 4 sequences of seq tokens at 1 KiB a token, in 64-token blocks, twice over
        f"policy.kv_cache_memory_bytes={2 * 4 * (-(-seq // 64) * 64) * 1024}",
        f"policy_trainer.seq_length={seq}",
        "policy_trainer.activation_recompute=full",
    ]


def one(length: int, model: str) -> dict:
    """Run the episode in this process; return the peaks and the estimate."""
    os.environ["POLICY_LOAD"] = model
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from chatgen.cli.config import checked_run_config
    from chatgen.rlhf import memory, metrics
    from chatgen.rlhf.algorithms import grpo

    out_dir = tempfile.mkdtemp(prefix="bench_long_context_")
    cfg, _ = checked_run_config(
        str(REPO / "configs" / "grpo_tiny.yaml"), overrides(length, out_dir)
    )
    estimate = memory.host_estimate(cfg)
    phase, peaks, page = ["startup"], {}, os.sysconf("SC_PAGE_SIZE")
    stop = threading.Event()

    def sample():
        with open("/proc/self/statm") as f:
            while not stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * page
                peaks[phase[0]] = max(peaks.get(phase[0], 0), rss)
                time.sleep(0.01)

    timed = metrics.PhaseTimer.__call__

    def call(self, name):
        phase[0] = name
        return timed(self, name)

    metrics.PhaseTimer.__call__ = call
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        grpo.train(cfg, log=lambda *a, **k: None)
        (record,) = metrics.read_jsonl_metrics(Path(out_dir) / "metrics.jsonl")
    finally:
        stop.set()
        thread.join()
        shutil.rmtree(out_dir, ignore_errors=True)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gib = 1 << 30
    return {
        "peak_rss_gib": peak / gib,
        "phases": {k: v / gib for k, v in peaks.items()},
        "estimate_gib": estimate["total"] / gib,
        "estimate_parts_gib": {k: v / gib for k, v in estimate.items()},
        "error": estimate["total"] / peak - 1,
        "seconds": time.perf_counter() - start,
        "episode": {k: v for k, v in record.items() if k.startswith(("time/", "response"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process's length
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        Path(args.output).write_text(json.dumps(one(args.one, args.model)))
        return
    report = {"load_start": os.getloadavg()[0], "cpus": os.cpu_count(), "lengths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny-llama-16k")
        for length in args.lengths:
            part = Path(tmp) / f"{length}.json"
            cmd = [sys.executable, __file__, "--output", str(part), "--one", str(length)]
            subprocess.run([*cmd, "--model", str(model)], check=True, cwd=REPO)
            report["lengths"][length] = json.loads(part.read_text())
            r = report["lengths"][length]
            print(
                f"{length} tokens: peak {r['peak_rss_gib']:.2f} GiB, estimate "
                f"{r['estimate_gib']:.2f} GiB ({r['error']:+.0%}), phases "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                + f"; {r['seconds']:.0f} s",
                flush=True,
            )
    report["load_end"] = os.getloadavg()[0]
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
