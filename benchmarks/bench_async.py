# .venv/bin/python benchmarks/bench_async.py --output outputs/bench_async.json
"""Synchronous vs one-step overlap vs asynchronous GRPO (k = 2, with and without a handover), alternating.

The async modes: max_staleness: 2 (async2), the same with handover_step: 4 (async2_handover), and with
AReaL's decoupled correction (async2_decoupled: old_logprobs: recompute, importance_sampling_cap 2.0).

Each case runs the five modes in turn, --runs rounds of them (so machine noise hits all alike), on the tiny
sort-digits task with the shipped job's warm start of the tiny Llama (examples/sft_warm_start.py,
--warm-steps; or --model):
- `tiny`: configs/grpo_tiny.yaml's policy (up to 16 new tokens, stop at EOS).
- `longtail`: one prompt in 8 asks to sort 8-10 digits instead of 3-6, and its samples generate to the
  --long-tokens limit (112; `LongTailPolicy`: min_tokens for them; the others stop at EOS near 10 tokens,
  so ~10x shorter): the straggler case, where partial rollouts pay most.
Every mode: one optimizer step per episode, the shipped job's loss (old_logprobs: rollout: PPO's ratio and
clip against the engine's log-probs of the sampling weights, so an off-policy sample's ratio starts away
from 1 and is clipped), but async2_decoupled (the trainer's pass before the update as the proximal policy, the
behaviour -> proximal weight capped at 2); held-out evaluation every --eval-every episodes on the training
prompts.

Disaggregated (the default): one process (runtime.launcher: local), but the engine thread runs on one core
and the trainer (the main thread) on another (--cores GEN,TRAIN; os.sched_setaffinity per thread), each
with one OpenMP/torch thread (OMP_NUM_THREADS=1 before torch loads, num_cpu: 1): generation and training
no longer take each other's cycles, as on two devices. --shared: no pinning, both share every core.

Per run: `step_s`, the median time/episode over episodes >= 2 without an evaluation (a plain optimizer
step); the wall time of the episodes; the trainer's idle fraction (1 - its old log-prob and train phases
over the episodes' wall time) and the engine's (1 - its engine steps for training batches, timed in
`BenchPolicy.forward_step`, over the same wall time), measured alike in every mode; the share the trainer
waited for samples (time/generate); async staleness figures; the held-out reward after equal steps (the
last evaluation) and after equal wall time (the last evaluation each run had reached when the fastest of
its round finished). Ratios: async / overlap and async / sync step time. Read the figures with the load
average printed beside them: other processes on the two cores slow the pinned threads. A smoke run:
--runs 1 --episodes 3 --cases tiny.
"""

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--shared" not in sys.argv:
    # before torch loads: torch's thread count is process-wide, OpenMP's team per thread, and vLLM's CPU
    # attention asserts they agree; with 1 everywhere they do, on whichever core a thread runs
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_generation import tiny_model  # noqa: E402

MODES = {
    "sync": {},
    "overlap": {"runtime.algorithm.overlap_generation": True},
    "async2": {"runtime.algorithm.max_staleness": 2},
    # the batches ahead wait for the next weights after 4 engine steps (docs/async_rl.md)
    "async2_handover": {"runtime.algorithm.max_staleness": 2, "runtime.algorithm.handover_step": 4},
    # AReaL's decoupled PPO: at lr 5e-4 on 32 samples per step it learned about half as much per step as
    # the plain clip (docs/async_rl.md)
    "async2_decoupled": {
        "runtime.algorithm.max_staleness": 2,
        "runtime.algorithm.old_logprobs": "recompute",
        "runtime.algorithm.importance_sampling_cap": 2.0,
    },
}


def warm_model(base: Path, work: Path, steps: int) -> Path:
    """The shipped job's SFT warm start (examples/sft_warm_start.py, as examples/prepare_tiny.sh runs it) of
    `base`, `steps` steps: it sorts, mostly the wrong way, so rewards vary and GRPO improves them fast.
    Kept beside `base` (made once: ~30 s on 2 cores)."""
    import subprocess

    from chatgen import tasks

    out = base.parent / f"{base.name}-sft-{steps}"
    if not (out / "chatgen_sft.json").exists():
        tasks.write_task_data(str(work / "sft"))
        script = REPO / "examples" / "sft_warm_start.py"
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--load",
                str(base),
                "--data",
                str(work / "sft/sft.jsonl"),
            ]
            + ["--output", str(out), "--steps", str(steps)],
            check=True,
            # every core for the warm start: not this process's one-thread setting
            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            | {"PYTHONPATH": str(REPO)},
        )
    return out


def bench_policies():
    """{name: policy class} (made on first use: importing vLLM is slow). Both pin the engine thread to
    CORES["generate"] at their first engine step (when set) and add each step's seconds to ENGINE_BUSY."""
    from chatgen import VLLMModule

    class BenchPolicy(VLLMModule):
        """The tiny case's policy: the engine's own core, and its busy time measured step by step."""

        def forward_step(self, data, iteration):
            self._pin()
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return self.execute_step(data)
            finally:
                ENGINE_BUSY[0] += time.perf_counter() - start
                ENGINE_BUSY[1] += time.thread_time() - cpu

        def eval_forward(self, data, iteration=0):  # an evaluation's steps: not training's samples
            self._pin()
            return self.execute_step(data)

        def _pin(self):
            if CORES["generate"] is not None and not getattr(self, "_pinned", False):
                # runs on the engine thread: 0 is the calling thread for sched_setaffinity
                os.sched_setaffinity(0, {CORES["generate"]})
                self._pinned = True

    class LongTailPolicy(BenchPolicy):
        """Samples of a long-tail prompt (LONG_DIGITS digits or more) generate to the token limit."""

        def _add_request(self, data, is_eval=False):
            request_ids = []
            for item in data:
                params = self.sampling_params(
                    len(item["input_ids"]), is_eval=is_eval, greedy=item.get("greedy", False)
                )
                if sum(map(str.isdigit, item.get("prompt", ""))) >= LONG_DIGITS:
                    params.min_tokens = params.max_tokens
                request_ids.append(
                    self.add_request(item["input_ids"], params, prompt_text=item.get("prompt"))
                )
            return request_ids

    return {"BenchPolicy": BenchPolicy, "LongTailPolicy": LongTailPolicy}


# the long-tail prompts sort 8-10 digits (the others 3-6): short prompts with long answers, as a reasoning
# model's tail is; a long prompt would widen every trained row (rows pad to the batch's longest) and make
# the case the trainer's, whatever the generation does
LONG_DIGITS = 8
# the process's one shared state (the policy classes reach it as module `bench_async`, also when this
# file runs as __main__): the core the engine thread pins itself to, and its stepping seconds
CORES = {"generate": None, "train": None}
ENGINE_BUSY = [0.0, 0.0]  # wall, CPU (the engine thread's own: what the load does not inflate)


def __getattr__(name):  # `bench_async:LongTailPolicy`, as the policy's model_class imports it
    if name in ("BenchPolicy", "LongTailPolicy"):
        return bench_policies()[name]
    raise AttributeError(name)


def shared_state():
    """This file as module `bench_async` (CORES, ENGINE_BUSY): the one the policy classes import."""
    return importlib.import_module("bench_async")


TRAINER_PHASES = (
    "old_logprobs",
    "train",
)  # the trainer's work in an episode (the rest waits or syncs)


@contextlib.contextmanager
def trainer_cpu_counted(seconds: list):
    """Add the trainer thread's CPU seconds in its phases to seconds[0] while inside (a load-free figure
    beside their wall time: PhaseTimer's phases run on the thread that trains)."""
    from chatgen.rlhf import metrics

    real = metrics.PhaseTimer.__call__

    @contextlib.contextmanager
    def counted(self, phase):
        cpu = time.thread_time()
        try:
            with real(self, phase):
                yield
        finally:
            if phase in TRAINER_PHASES:
                seconds[0] += time.thread_time() - cpu

    metrics.PhaseTimer.__call__ = counted
    try:
        yield
    finally:
        metrics.PhaseTimer.__call__ = real


def disaggregate(generate: int, train: int) -> None:
    """One core for generation, one for training, in this process: the calling (trainer) thread on
    `train`, the engine thread on `generate` (at its first step), one OpenMP/torch thread each."""
    import torch

    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 was set before torch loaded (the top of this file)
    os.sched_setaffinity(0, {train})
    shared_state().CORES.update(generate=generate, train=train)


def write_data(work: Path, prompts: int) -> dict:
    """{case: data directory}: the tiny task's prompts; for longtail one prompt in 8 with 8-10 digits."""
    from chatgen import tasks

    tasks.write_task_data(str(work / "tiny"), n_train=prompts, n_eval=8)
    long = max(1, prompts // 8)
    tasks.write_task_data(str(work / "short"), n_train=prompts - long, n_eval=8)
    tasks.write_task_data(
        str(work / "long"), n_train=long, n_eval=8, min_digits=LONG_DIGITS, max_digits=10
    )
    (work / "longtail").mkdir()
    (work / "longtail" / "train.jsonl").write_text(
        (work / "short" / "train.jsonl").read_text() + (work / "long" / "train.jsonl").read_text()
    )
    return {"tiny": work / "tiny", "longtail": work / "longtail"}


def case_overrides(case: str, long_tokens: int = 112) -> dict:
    if case == "longtail":
        return {
            "models.policy.model_class": "bench_async:LongTailPolicy",
            "policy.max_new_tokens": long_tokens,
            "policy.seq_length": 256,
            "policy_trainer.seq_length": 256,
        }
    return {"models.policy.model_class": "bench_async:BenchPolicy"}


def one_run(model: Path, data: Path, out: Path, episodes: int, extra: dict, args) -> dict:
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    samples = args.prompts * 4
    items = {
        "runtime.data_path": f"{data}/train.jsonl",
        "runtime.eval_data_path": f"{data}/train.jsonl",
        "runtime.output_dir": str(out),
        "runtime.num_episode": episodes,
        "runtime.sample_per_episode": samples,
        "runtime.train_micro_batch_size": samples,
        "runtime.train_global_batch_size": samples,
        "runtime.eval_episode_interval": args.eval_every,
        "runtime.save_episode_interval": "null",
        "policy.load": model,
        "policy.n": 4,
        "policy_trainer.load": model,
        # one core each (disaggregate): the local worker's torch.set_num_threads(num_cpu) matches the
        # OpenMP team of one that OMP_NUM_THREADS=1 gave every thread
        **(
            {}
            if getattr(args, "shared", True)
            else {"models.policy.num_cpu": 1, "models.policy_trainer.num_cpu": 1}
        ),
        **extra,
    }
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [f"{k}={v}" for k, v in items.items()])
    busy = shared_state().ENGINE_BUSY
    busy[:], trainer_cpu = [0.0, 0.0], [0.0]
    with trainer_cpu_counted(trainer_cpu):
        grpo.train(cfg, log=lambda *_: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["episode"] >= 1]
    elapsed, curve = 0.0, []
    for r in records:
        elapsed += r.get("time/episode", 0.0)
        if "eval/reward" in r:
            curve.append((elapsed, r["eval/reward"]))

    def mean(key):
        values = [r[key] for r in timed if key in r]
        return statistics.mean(values) if values else None

    def total(*keys):
        return sum(r.get(key, 0.0) for r in timed for key in keys)

    wall = total("time/episode")
    # an episode with an evaluation or a checkpoint is not a plain optimizer step
    plain = [r for r in timed if r["episode"] >= 2 and "time/eval" not in r]
    result = {
        "step_s": statistics.median(r["time/episode"] for r in plain or timed),
        "median_episode_s": statistics.median(
            r["time/episode"] for r in timed if r["episode"] >= 2
        ),
        "wall_s": elapsed,
        "eval_curve": curve,
        "response_length_mean": mean("response/length"),
        # the same measure in every mode: the trainer works in its old log-prob and train phases, the
        # engine in its steps (BenchPolicy.forward_step; evaluations' steps included, their time too)
        "trainer_idle_fraction": 1 - total(*(f"time/{p}" for p in TRAINER_PHASES)) / wall,
        "engine_idle_fraction": 1 - busy[0] / wall if "model_class" in str(extra) else None,
        "trainer_waits_for_samples": total("time/generate") / wall,
        # per episode: seconds of engine steps, and of the engine thread's CPU in them
        "engine_step_s": busy[0] / len(timed),
        "engine_cpu_s": busy[1] / len(timed),
        "trainer_cpu_s": trainer_cpu[0] / len(timed),
    }
    for key in ("async/staleness_mean", "async/staleness_max", "async/samples_spanning_versions"):
        if key in timed[-1]:
            result[key] = mean(key)
    return result


def reward_at(curve: list, seconds: float) -> float:
    """The last evaluation reached within `seconds` of the run's episodes."""
    reached = [reward for elapsed, reward in curve if elapsed <= seconds + 1e-9]
    return reached[-1] if reached else curve[0][1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--model", help="a warm-started HF model (default: made here)")
    parser.add_argument("--runs", type=int, default=2, help="rounds of the modes, per case")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per episode (x4 samples)")
    parser.add_argument("--cases", default="tiny,longtail")
    parser.add_argument(
        "--long-tokens", type=int, default=112, help="tokens of a long-tail sample (longtail)"
    )
    parser.add_argument("--warm-steps", type=int, default=300, help="SFT steps of the warm start")
    parser.add_argument(
        "--cores",
        default=",".join(map(str, sorted(os.sched_getaffinity(0))[:2])),
        help="GEN,TRAIN: the core of the engine thread and the trainer's (default: the first two)",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="no pinning: generation and training share every core (OpenMP's default team)",
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    model = (
        Path(args.model)
        if args.model
        else warm_model(tiny_model(REPO / "outputs" / "bench-tiny-llama"), work, args.warm_steps)
    )
    if not args.shared:  # after the warm start, which uses every core
        disaggregate(*map(int, args.cores.split(",")))
    data = write_data(work, args.prompts)
    result = {"args": vars(args), "cases": {}}
    for case in args.cases.split(","):
        load_before, runs = os.getloadavg(), {mode: [] for mode in MODES}
        for round_ in range(args.runs):
            for mode, extra in MODES.items():
                out = work / f"{case}_{mode}_{round_}"
                run = one_run(
                    model,
                    data[case],
                    out,
                    args.episodes,
                    {**extra, **case_overrides(case, args.long_tokens)},
                    args,
                )
                runs[mode].append(run)
                engine_idle = run["engine_idle_fraction"]
                print(
                    f"{case} round {round_} {mode}: {run['step_s']:.3f} s/step, eval "
                    f"{run['eval_curve'][-1][1]:.3f}, trainer idle "
                    f"{run['trainer_idle_fraction']:.2f}, engine idle "
                    f"{'-' if engine_idle is None else f'{engine_idle:.2f}'}; CPU s/episode: engine "
                    f"{run['engine_cpu_s']:.2f}, trainer {run['trainer_cpu_s']:.2f}; load "
                    f"{os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            fastest = min(runs[m][-1]["wall_s"] for m in MODES)
            for mode in MODES:
                runs[mode][-1]["eval_at_equal_wall"] = reward_at(
                    runs[mode][-1]["eval_curve"], fastest
                )
        median = {mode: statistics.median(r["step_s"] for r in runs[mode]) for mode in MODES}
        result["cases"][case] = {
            "runs": runs,
            "step_s": median,
            "idle": {
                m: {
                    side: statistics.median(r[f"{side}_idle_fraction"] or 0 for r in runs[m])
                    for side in ("engine", "trainer")
                }
                for m in MODES
            },
            "async_over_overlap": median["async2"] / median["overlap"],
            "async_over_sync": median["async2"] / median["sync"],
            "handover_over_overlap": median["async2_handover"] / median["overlap"],
            "eval_equal_steps": {
                m: statistics.mean(r["eval_curve"][-1][1] for r in runs[m]) for m in MODES
            },
            "eval_equal_wall": {
                m: statistics.mean(r["eval_at_equal_wall"] for r in runs[m]) for m in MODES
            },
            "loadavg_before_after": [load_before, os.getloadavg()],
        }
        c = result["cases"][case]
        print(
            f"{case}: s/step {json.dumps({m: round(v, 3) for m, v in median.items()})}; async/overlap "
            f"{c['async_over_overlap']:.2f}, async/sync {c['async_over_sync']:.2f}; eval (equal steps) "
            f"{json.dumps({m: round(v, 3) for m, v in c['eval_equal_steps'].items()})}; eval (equal "
            f"wall) {json.dumps({m: round(v, 3) for m, v in c['eval_equal_wall'].items()})}; load "
            f"{c['loadavg_before_after']}",
            flush=True,
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
