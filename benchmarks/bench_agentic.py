# PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/bench_agentic.py --output /tmp/bench_agentic.json --plot docs/agentic_timeline.png
"""Agentic episodes over engines: episodes/s, engine and trainer idle fractions for synchronous vs
asynchronous (k = 2) steps, with 1 and 2 engine replicas, on a multi-turn environment with
long-tailed turn counts and a slow tool.

The policy (the tiny Llama widened to --hidden 1024, so that an engine step's time is the model's
work, as with real models, rather than Python's per-step overhead, which a hidden size of 128 is
all) runs as 2 replicas in Ray actors apart, one core each (tests/helpers.served_replicas:
chatgen.rlhf.runtime.engines_apart), each serving OpenAI HTTP (chatgen.serving.embedded); the
episodes are chatgen.rlhf.algorithms.grpo_multiturn.run_episodes over one or both servers (a
record's sessions start on the engine with the fewest in flight, and stay there). The environment
(`LongTail`, below, a protocol environment played by chatgen.environments.Runner: the client and
episode loop a `grpo_multiturn` run uses): each session takes 1-12 model turns of up to
--max-tokens (long-tailed: 56% take 1, 8% take 8 or more), every tool call sleeps `--tool-s` (one in
8 sleeps 8x as long: the slow tool). A step plays --batch sessions whatever the replica count (the same work: 2 replicas must
play it faster), enough that two engines each batch a few dozen.

The trainer is a stand-in on hardware of its own, as in a disaggregated run (no CPU): it sleeps
--train-s-per-turn per model turn of the batch it trains on (a trainer's time grows with the tokens
it trains on; the turn counts are the same in every mode), sized so that training is comparable to
generation, generation the larger part (about a quarter of a one-replica synchronous step), then the
weights go to every engine through shared memory (`load_shared_weights`): mode `wait` when
synchronous, mode `keep` with sessions in flight when asynchronous. Asynchronous k = 2: batch j
starts once the engines hold version >= j - 2 (the staleness bound of docs/async_rl.md, asserted on
every trained token's version), on a thread of its own, so the next batches' sessions run while the
trainer trains and while a batch's longest sessions finish.

Measured in steady state, as in a run of many steps: from the end of step 2 (the asynchronous runs'
batches 0-2 start together: the pipeline's one-time fill) to the end of the last step, the k batches
past it admitted as a longer run would (they finish unmeasured), the same window in every mode; the
whole run's s per step is reported beside it. Modes alternate within each round. Prints one line per
run (with the CPU each replica's process and the driver used, in cores) and a JSON summary
(--output); --plot draws the engine / trainer timeline of the last round, the measured window
shaded.
"""

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from chatgen.environments import Environment, Runner, Step


class LongTail(Environment):
    """A session: the model answers, a tool (a sleep) replies, for a long-tailed number of turns.
    A protocol environment, played by chatgen.environments.Runner as a `grpo_multiturn` run plays
    one (its client, its episode loop)."""

    tool_s = 0.05

    def reset(self, record):
        self.rng = random.Random(record["prompt"] + str(record.get("round", 0)))
        self.turns_n = min(12, int(self.rng.paretovariate(1.2)))  # 1 turn: 56%, 4+: 19%, 8+: 8%
        self.turn = 0
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, message):
        time.sleep(self.tool_s * (8 if self.rng.random() < 1 / 8 else 1))  # the tool
        self.turn += 1
        reply = {"role": "tool", "content": f" result {self.turn - 1}"}
        return Step(messages=[reply], done=self.turn >= self.turns_n)


def busy(intervals, t0, t1) -> float:
    """Seconds of [t0, t1] covered by the union of `intervals`."""
    total, end = 0.0, t0
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, t1)
        if b > a:
            total += b - a
            end = b
    return total


FILL = 3  # k + 1 for the asynchronous runs' k = 2


def run_mode(envs, records, k, steps, batch, push, versions, cpu, args):
    """`steps` trainer steps of `batch` records each; k = 0 synchronous, else async with bound k,
    the generation of k batches past the last step admitted as in a longer run (the pipeline
    stays full; they finish unmeasured). Measured in steady state, the same window in every
    mode: from the end of step FILL - 1 (the asynchronous runs' first FILL batches start
    together: the pipeline's one-time fill) to the end of the last step. Returns (metrics,
    timeline: the engine's and the trainer's intervals and the window, in seconds from the
    start). Asserts the staleness bound on every trained token: batch j trains against version
    v0 + j, and its tokens carry the versions that sampled them (`generation_weight_versions`)."""
    from chatgen.rlhf.algorithms.grpo_multiturn import run_episodes

    gen, train, lock = [], [], threading.Lock()
    version, cond = [0], threading.Condition()
    v0 = versions()

    def generate(j):
        with cond:  # admission: the engines hold version >= j - k
            cond.wait_for(lambda: version[0] >= j - k)
        start = time.perf_counter()
        out = run_episodes(envs, records[j * batch : (j + 1) * batch], 1, 1.0, args.max_tokens)
        with lock:
            gen.append((start, time.perf_counter()))
        return out

    t0 = time.perf_counter()
    marks, pushes, oldest = [], [], 0  # marks: (time, CPU seconds, episodes) after each step
    with concurrent.futures.ThreadPoolExecutor(k + 1) as pool:
        futures = {}
        for j in range(steps):
            for i in range(j, j + k + 1):
                if i not in futures:
                    futures[i] = pool.submit(generate, i)
            played = futures[j].result()
            stamps = [v for e in played for t in e.turns for v in t["generation_weight_versions"]]
            stale = v0 + j - min(stamps)
            assert 0 <= stale <= k, f"batch {j}: a token {stale} versions stale (bound {k})"
            oldest = max(oldest, stale)
            start = time.perf_counter()
            # the trainer stand-in: seconds in proportion to what it trains on
            time.sleep(args.train_s_per_turn * sum(len(e.turns) for e in played))
            train.append((start, time.perf_counter()))
            push("keep" if k else "wait")
            pushes.append(time.perf_counter() - train[-1][1])
            with cond:
                version[0] += 1
                cond.notify_all()
            marks.append((time.perf_counter(), cpu(), len(played)))
    (w0, cpu0, _), (w1, cpu1, _) = marks[FILL - 1], marks[-1]
    window, measured = w1 - w0, steps - FILL
    metrics = {
        "s_per_step": window / measured,
        "episodes_per_s": sum(m[2] for m in marks[FILL:]) / window,
        "s_per_step_whole_run": (w1 - t0) / steps,  # the fill included
        "engine_idle_fraction": 1 - busy(gen, w0, w1) / window,
        "trainer_idle_fraction": 1 - busy(train, w0, w1) / window,
        "push_s": statistics.mean(pushes),
        "staleness_max": oldest,
    }
    # how busy each replica's process (engine, server) and the driver kept a core
    metrics.update({f"cpu_replica{i}": (cpu1[i] - cpu0[i]) / window for i in range(2)})
    metrics["cpu_driver"] = (cpu1[2] - cpu0[2]) / window
    timeline = {
        "engine": [(a - t0, b - t0) for a, b in gen],
        "trainer": [(a - t0, b - t0) for a, b in train],
        "window": (w0 - t0, w1 - t0),
    }
    return metrics, timeline


def cpu_seconds(pids: list) -> list:
    """User + system CPU seconds each process has run (Linux /proc/PID/stat)."""
    tick, out = os.sysconf("SC_CLK_TCK"), []
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def _pid(worker):
    return os.getpid()


def bench_model(hidden: int):
    """The bench's policy: the tiny Llama at width `hidden` (heads of 128), as a chat model
    directory, and its weights as (name, tensor) pairs for the pushes."""
    from conftest import build_tiny_model
    from helpers import chat_model
    from safetensors.torch import load_file

    width = {  # the tiny Llama's proportions; heads of 128
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": max(1, hidden // 256),
    }
    model = chat_model(
        build_tiny_model("tiny_llama", max_position_embeddings=1024, **width),
        Path(f"/tmp/bench_agentic/model-{hidden}"),
    )
    return model, list(load_file(str(model / "model.safetensors")).items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help=f"trainer steps a run, {FILL} unmeasured")
    p.add_argument("--batch", type=int, default=48, help="sessions per step (any replica count)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per model turn")
    p.add_argument("--hidden", type=int, default=1024, help="the tiny Llama's hidden size")
    p.add_argument(
        "--train-s-per-turn",
        type=float,
        default=0.02,
        help="the trainer stand-in's seconds per model turn of the batch it trains on",
    )
    p.add_argument("--kv-mib", type=int, default=256, help="each engine's KV cache, MiB")
    p.add_argument("--tool-s", type=float, default=0.05)
    p.add_argument("--output", default="/tmp/bench_agentic.json")
    p.add_argument("--plot", default=None, help="a PNG of the last round's timelines")
    p.add_argument(
        "--modes",
        default="sync_1rep,async_k2_1rep,sync_2rep,async_k2_2rep",
        help="the modes to run (comma-separated; the ratios need all four)",
    )
    args = p.parse_args(argv)
    if args.steps <= FILL:
        p.error(f"--steps {args.steps}: the first {FILL} are the pipeline's fill; give more")
    LongTail.tool_s = args.tool_s

    from helpers import served_replicas

    from chatgen.param_sync import ShmSender

    model, state = bench_model(args.hidden)
    # the KV cache holds every session in flight: k + 1 batches of --batch sessions, up to 12 turns
    overrides = ["policy.seq_length=1024", f"policy.kv_cache_memory_bytes={args.kv_mib << 20}"]
    with served_replicas(model, 2, "bench-key", overrides) as (rt, urls):
        policy = rt["policy"]
        pids = policy.run(_pid) + [os.getpid()]  # replica 0, replica 1, the driver
        print("pids (replica 0, replica 1, driver):", pids, flush=True)
        envs = [
            Runner(LongTail, "LongTail", url, "bench-key", "policy", max_turns=12) for url in urls
        ]
        sender = ShmSender.owned(policy.token)

        def push(mode):
            policy.load_shared_weights(sender.write(state), mode=mode)

        def versions():
            (v,) = set(policy.weight_versions())  # every engine gets every push
            return v

        results, timelines = {}, {}
        modes = [(r, k) for r in (1, 2) for k in (0, 2)]
        for rnd in range(args.rounds):
            for replicas, k in modes if rnd % 2 == 0 else modes[::-1]:  # alternating
                name = f"{'sync' if k == 0 else f'async_k{k}'}_{replicas}rep"
                if name not in args.modes.split(","):
                    continue
                records = [
                    {
                        "prompt": f"sort: {i % 10} {(i * 7) % 10} {(i * 3) % 10} =",
                        "round": rnd * 1000 + i,
                    }
                    for i in range((args.steps + k) * args.batch)
                ]
                load = os.getloadavg()[0]
                m, timeline = run_mode(
                    envs[:replicas],
                    records,
                    k,
                    args.steps,
                    args.batch,
                    push,
                    versions,
                    lambda: cpu_seconds(pids),
                    args,
                )
                m["load"] = load
                results.setdefault(name, []).append(m)
                timelines[name] = timeline
                print(name, json.dumps({key: round(v, 3) for key, v in m.items()}), flush=True)
        sender.close()
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    ratios = {}
    for k in ("sync", "async_k2"):
        if f"{k}_2rep" in summary and f"{k}_1rep" in summary:
            ratios[f"episodes_per_s_2rep_over_1rep_{k}"] = (
                summary[f"{k}_2rep"]["episodes_per_s"] / summary[f"{k}_1rep"]["episodes_per_s"]
            )
    for r in (1, 2):
        if f"async_k2_{r}rep" in summary and f"sync_{r}rep" in summary:
            ratios[f"s_per_step_async_over_sync_{r}rep"] = (
                summary[f"async_k2_{r}rep"]["s_per_step"] / summary[f"sync_{r}rep"]["s_per_step"]
            )
    out = {
        "args": vars(args),
        "uptime": subprocess.run(
            ["uptime"], check=False, capture_output=True, text=True
        ).stdout.strip(),
        "runs": results,
        "median": summary,
        "ratios": ratios,
        "timelines_last_round": timelines,
    }
    print(json.dumps({"median": summary, "ratios": ratios, "uptime": out["uptime"]}, indent=1))
    Path(args.output).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(timelines, args.plot)
    return 0


def plot(timelines: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.3 * len(timelines)), sharex=True)
    for ax, (name, tl) in zip(axes, sorted(timelines.items())):
        for row, (side, color) in enumerate((("engine", "tab:blue"), ("trainer", "tab:orange"))):
            ax.broken_barh(
                [(a, b - a) for a, b in tl[side]], (row * 10, 8), facecolors=color, alpha=0.6
            )
        ax.axvspan(*tl["window"], color="0.9", zorder=0)  # the measured steps
        ax.set_yticks([4, 14], ["engines (batches)", "trainer"])
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
