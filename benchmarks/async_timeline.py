# .venv/bin/python benchmarks/async_timeline.py --output docs/async_timeline.png
"""The timeline of docs/async_rl.md: synchronous vs one-step overlap vs asynchronous (max_staleness: 2,
handover_step: 4) GRPO, drawn from real runs' recorded phase timings.

Each mode runs --episodes episodes of the tiny sort-digits task in one process (runtime.launcher: local,
the model and settings of benchmarks/bench_async.py's `tiny` case). What is recorded:
- engine: every engine step (`TimedPolicy.forward_step`, the policy's hook around one vLLM step), merged
  into busy intervals where steps follow each other within 2 ms;
- trainer: the trainer's phases (old log-probs, train) from the run's PhaseTimer;
- weight push: the `sync` phase (the trainer's weights into the engine).
The figure shows episodes 3 to 3 + --shown of each run, each mode on its own time axis from the start of
episode 3, and the JSON beside it (--output with .json) holds every interval. On one shared CPU the
engine and the trainer compete for the same cores: read lengths with the load average printed with them.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_async  # noqa: E402
from bench_generation import tiny_model  # noqa: E402

STEPS = []  # (start, end) of every engine step, perf_counter seconds
MODES = {
    "synchronous": {},
    "one-step overlap": {"runtime.algorithm.overlap_generation": True},
    "async, k = 2, handover_step 4": {
        "runtime.algorithm.max_staleness": 2,
        "runtime.algorithm.handover_step": 4,
    },
}
TRAINER = ("old_logprobs", "train")


def timed_policy():
    """The policy class that records its engine steps (made on first use: importing vLLM is slow)."""
    from chatgen import VLLMModule

    class TimedPolicy(VLLMModule):
        def forward_step(self, data, iteration):
            start = time.perf_counter()
            try:
                return super().forward_step(data, iteration)
            finally:
                STEPS.append((start, time.perf_counter()))

    return TimedPolicy


def __getattr__(name):  # `async_timeline:TimedPolicy`, as the policy's model_class imports it
    if name == "TimedPolicy":
        return timed_policy()
    raise AttributeError(name)


def merged(steps: list, gap: float = 0.002) -> list:
    """Engine steps as busy intervals: steps closer than `gap` seconds are one interval."""
    out = []
    for start, end in sorted(steps):
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def record(model, data, work, name, extra, args) -> dict:
    """One run of a mode: {"engine", "trainer", "push", "eval": [(start, end) seconds]}."""
    from chatgen.rlhf import metrics

    me = sys.modules["async_timeline"]
    phases, real = [], metrics.PhaseTimer.__call__

    @contextlib.contextmanager
    def recording(timer, phase):
        start = time.perf_counter()
        with real(timer, phase):
            yield
        phases.append((phase, start, time.perf_counter()))

    me.STEPS.clear()
    metrics.PhaseTimer.__call__ = recording
    try:
        bench_async.one_run(
            model,
            data,
            work / name.split(",")[0].replace(" ", "_"),
            args.episodes,
            {"models.policy.model_class": "async_timeline:TimedPolicy", **extra},
            args,
        )
    finally:
        metrics.PhaseTimer.__call__ = real
    return {
        "engine": merged(me.STEPS),
        "trainer": [(s, e) for p, s, e in phases if p in TRAINER],
        "push": [(s, e) for p, s, e in phases if p == "sync"],
        "eval": [(s, e) for p, s, e in phases if p == "eval"],
    }


def draw(runs: dict, path: Path, shown: int, load: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.6 * len(runs) + 0.8), sharex=True)
    for ax, (mode, run) in zip(axes, runs.items()):
        pushes = run["push"]
        t0 = pushes[1][1]  # after episode 2's weight push: the steady state
        t1 = pushes[min(len(pushes) - 1, 1 + shown)][1]

        def bars(intervals, t0=t0, t1=t1):
            return [(s - t0, e - s) for s, e in intervals if e > t0 and s < t1]

        ax.broken_barh(bars(run["engine"]), (2, 0.8), color="tab:blue")
        ax.broken_barh(bars(run["trainer"]), (1, 0.8), color="tab:orange")
        ax.broken_barh(bars(run["eval"]), (2, 0.8), color="tab:gray")
        for s, e in run["push"]:
            if t0 < e <= t1:
                ax.axvline(e - t0, color="tab:red", lw=1)
        ax.set_yticks([1.4, 2.4], ["trainer", "engine"])
        ax.set_ylim(0.8, 3.0)
        ax.set_title(mode, loc="left", fontsize=10)
    axes[-1].set_xlabel(
        f"seconds from the end of episode 2's weight push (red: a weight push; blue: engine steps; "
        f"orange: old log-probs + train; load average {load[0]:.1f} -> {load[1]:.1f})",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--output", required=True, help="the PNG to write (and a .json beside it)")
    parser.add_argument("--model", help="a warm-started HF model (default: made here)")
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--shown", type=int, default=3, help="episodes drawn per mode")
    parser.add_argument("--warm-steps", type=int, default=100)
    args = parser.parse_args(argv)
    args.prompts, args.eval_every = 8, "null"
    import async_timeline  # noqa: F401  (the module the policy's model_class names)

    work = Path(tempfile.mkdtemp(prefix="async_timeline_"))
    model = (
        Path(args.model)
        if args.model
        else bench_async.warm_model(
            tiny_model(REPO / "outputs" / "bench-tiny-llama"), work, args.warm_steps
        )
    )
    data = bench_async.write_data(work, args.prompts)["tiny"]
    load = [os.getloadavg()[0]]
    runs = {mode: record(model, data, work, mode, extra, args) for mode, extra in MODES.items()}
    load.append(os.getloadavg()[0])
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(runs, out, args.shown, load)
    out.with_suffix(".json").write_text(json.dumps({"load": load, "runs": runs}))
    print(f"written to {out} and {out.with_suffix('.json')} (load {load[0]:.1f} -> {load[1]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
