# PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/bench_agentic_threads.py --output /tmp/bench_agentic_threads.json
"""Where the CPU of bench_agentic.py's two-replica case goes, thread by thread: CPU milliseconds per
model turn (and per weight push) of each replica's threads (the engine loop, the HTTP server's event
loop, its tokenizer thread, Ray's call thread, gloo's), of the driver (the sessions' clients and the
trainer's write) and of every other process on the machine, from /proc (CPU seconds: what a loaded
machine bends least; wall time under other jobs is noise).

The replicas, the model (the tiny Llama at --hidden 1024) and the sessions (`LongTail`, played by
chatgen.environments.Runner over both servers) are bench_agentic.py's; each of --rounds plays
--batch sessions, then pushes the weights into both engines (mode `keep`), as a step of the bench
does. Then --pushes pushes alone, for the push's cost per thread. docs/async_rl.md reads it.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

# bench_agentic's import puts the repository and tests/ on sys.path
from bench_agentic import LongTail, bench_model

TICK = os.sysconf("SC_CLK_TCK")


def _threads(worker) -> tuple:
    """In a replica's actor: its pid and {native thread id: Python thread name}."""
    return os.getpid(), {t.native_id: t.name for t in threading.enumerate()}


def _cpu(path: str) -> tuple:
    """(name, user + system CPU seconds) of /proc/PID/stat or /proc/PID/task/TID/stat."""
    with open(path) as f:
        stat = f.read()
    fields = stat.rpartition(")")[2].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK


def snapshot(replicas: dict) -> dict:
    """CPU seconds by (owner, thread or process name): each replica's threads (named as Python
    names them, else as the OS does), the driver's process (threads that ended included) and
    every other process."""
    out = {}
    for i, (pid, names) in enumerate(replicas.items()):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm, s = _cpu(f"/proc/{pid}/task/{tid}/stat")
            except FileNotFoundError:  # ended meanwhile
                continue
            key = (f"replica{i}", names.get(int(tid), comm))
            out[key] = out.get(key, 0.0) + s
    out[("driver", "process")] = _cpu(f"/proc/{os.getpid()}/stat")[1]
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in replicas and int(pid) != os.getpid():
            try:
                comm, s = _cpu(f"/proc/{pid}/stat")
            except (FileNotFoundError, ProcessLookupError):
                continue
            out[("others", comm)] = out.get(("others", comm), 0.0) + s
    return out


def per_unit(before: dict, after: dict, units: int) -> dict:
    """CPU milliseconds per unit, by owner then name, largest first, zeros left out."""
    rows = {}
    for (owner, name), s in after.items():
        ms = (s - before.get((owner, name), 0.0)) * 1000 / units
        if ms >= 0.01:
            rows.setdefault(owner, {})[name] = ms
    return {
        owner: {k: round(v, 2) for k, v in sorted(r.items(), key=lambda kv: -kv[1])}
        for owner, r in rows.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=96, help="sessions a round, over both replicas")
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv-mib", type=int, default=256)
    p.add_argument("--output", default="/tmp/bench_agentic_threads.json")
    args = p.parse_args(argv)

    from helpers import served_replicas

    from chatgen.environments import Runner
    from chatgen.param_sync import ShmSender
    from chatgen.rlhf.algorithms.grpo_multiturn import run_episodes

    model, state = bench_model(args.hidden)
    overrides = ["policy.seq_length=1024", f"policy.kv_cache_memory_bytes={args.kv_mib << 20}"]
    with served_replicas(model, 2, "bench-key", overrides) as (rt, urls):
        policy = rt["policy"]
        envs = [
            Runner(LongTail, "LongTail", url, "bench-key", "policy", max_turns=12) for url in urls
        ]
        sender = ShmSender.owned(policy.token)

        def push():
            policy.load_shared_weights(sender.write(state), mode="keep")

        def records(rnd):
            return [
                {
                    "prompt": f"sort: {i % 10} {(i * 7) % 10} {(i * 3) % 10} =",
                    "round": rnd * 1000 + i,
                }
                for i in range(args.batch)
            ]

        run_episodes(
            envs, records(-1), 1, 1.0, args.max_tokens
        )  # warm-up: the engine threads start
        push()
        replicas = dict(policy.run(_threads))
        before, start, turns = snapshot(replicas), time.perf_counter(), 0
        for rnd in range(args.rounds):
            played = run_episodes(envs, records(rnd), 1, 1.0, args.max_tokens)
            turns += sum(len(e.turns) for e in played)
            push()
        after, wall = snapshot(replicas), time.perf_counter() - start
        sessions = per_unit(before, after, turns)
        cores = {o: round(sum(r.values()) * turns / 1000 / wall, 3) for o, r in sessions.items()}
        before = snapshot(replicas)
        for _ in range(args.pushes):
            push()
        pushes = per_unit(before, snapshot(replicas), args.pushes)
        sender.close()
    out = {
        "args": vars(args),
        "load": os.getloadavg(),
        "turns": turns,
        "wall_s": wall,
        "cpu_ms_per_turn_rounds_with_pushes": sessions,
        "cores": cores,
        "cpu_ms_per_push": pushes,
    }
    print(json.dumps(out, indent=1))
    Path(args.output).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
