# .venv/bin/python benchmarks/bench_eval_admission.py --output /tmp/bench_eval_admission.json [--evals 20]
"""What admitting the main job's held-out evaluation's 256 prompts costs (configs/grpo_tiny.yaml,
the call bench_eval_phase.py times): each piece on the CPU clock of the thread that runs it, per
evaluation, beside the whole call's engine-thread and process CPU.

The pieces: adding the requests (chatgen's `add_request`, all of it; inside it vLLM's output
processor's `RequestState`, the engine core's `Request` construction with its block hashes, the
scheduler's `add_request`); the prefill step's `Scheduler.schedule` (vLLM's, which admits them)
and, inside it, the calls an exact shortcut of its admission would keep (the prefix-cache lookup,
`allocate_slots`, `get_blocks`, the prefix-cache stats) and `NewRequestData.from_request`; the
model runner's `_update_states` of that step and its `InputBatch.add_request`. A piece's figure
includes the timing wrappers' own ~0.3-1 us a call (an enclosing piece's, those of the pieces
inside it), so the figures bound from above what an exact shortcut of a piece could save. Writes
{"per_eval_ms": {piece: ms}, "engine_cpu_ms", "process_cpu_ms", "threads": {piece: thread name},
"load": the 1-minute load average at start and end} to --output.
"""

import argparse
import collections
import json
import os
import shutil
import tempfile
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--evals", type=int, default=20)
    args = parser.parse_args()

    from bench_eval_phase import engine_loop
    from vllm.v1.core.sched.output import NewRequestData

    from chatgen.cli.config import checked_run_config
    from chatgen.generation.vllm import adapter
    from chatgen.generation.vllm.adapter.split_step import engine_core
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.run import Run

    spent, threads = collections.defaultdict(float), {}
    admitting = [False]  # inside the prefill step's schedule() or _update_states

    def timed(function, piece, only_admitting=False):
        def wrapper(*args, **kwargs):
            if only_admitting and not admitting[0]:
                return function(*args, **kwargs)
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[piece] += time.thread_time() - start
                threads[piece] = threading.current_thread().name

        return wrapper

    def admission(function, piece, is_admission):
        timed_function = timed(function, piece)

        def wrapper(*args, **kwargs):
            if not is_admission(*args):
                return function(*args, **kwargs)
            admitting[0] = True
            try:
                return timed_function(*args, **kwargs)
            finally:
                admitting[0] = False

        return wrapper

    out_dir = tempfile.mkdtemp(prefix="bench_eval_admission_")
    cfg, _ = checked_run_config(
        "configs/grpo_tiny.yaml",
        [f"runtime.output_dir={out_dir}/run", "runtime.save_episode_interval=null"],
    )
    load = [os.getloadavg()[0]]
    try:
        with Run(cfg, False, grpo.PHASES, print, records_per_episode=32) as run:
            run.evaluate()  # starts the engine loop
            loop = engine_loop()
            engine, core = loop.llm.llm_engine, engine_core(loop.llm)
            scheduler, manager = core.scheduler, core.scheduler.kv_cache_manager
            (runner,) = loop.call(lambda: loop.llm.collective_rpc(lambda w: w.model_runner))
            processor, client = engine.output_processor, engine.engine_core
            adapter.add_request = timed(adapter.add_request, "add: adapter.add_request, all")
            processor.add_request = timed(
                processor.add_request, "add: RequestState (output processor)"
            )
            client.add_request = timed(client.add_request, "add: engine core, all")
            core.preprocess_add_request = timed(core.preprocess_add_request, "add:  Request")
            core.add_request = timed(core.add_request, "add:  scheduler.add_request")
            scheduler.schedule = admission(
                scheduler.schedule,
                "schedule: prefill step, all",
                lambda *a: bool(scheduler.waiting),
            )
            for owner, name in (
                (scheduler, "_get_local_prefix_cache_hit"),
                (manager, "allocate_slots"),
                (manager, "get_blocks"),
                (manager, "record_prefix_cache_stats"),
            ):
                setattr(owner, name, timed(getattr(owner, name), f"schedule:  {name}", True))
            from_request = NewRequestData.from_request
            NewRequestData.from_request = timed(from_request, "schedule:  NewRequestData", True)
            runner._update_states = admission(
                runner._update_states,
                "runner: _update_states of the prefill step, all",
                lambda output: bool(output.scheduled_new_reqs),
            )
            batch = runner.input_batch
            batch.add_request = timed(batch.add_request, "runner:  InputBatch.add_request", True)
            run.evaluate()
            spent.clear()
            start_engine, start_cpu = loop.call(time.thread_time), time.process_time()
            for _ in range(args.evals):
                run.evaluate()
            engine_cpu = (loop.call(time.thread_time) - start_engine) / args.evals
            process_cpu = (time.process_time() - start_cpu) / args.evals
            NewRequestData.from_request = from_request
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    load.append(os.getloadavg()[0])
    report = {
        "per_eval_ms": {k: v / args.evals * 1e3 for k, v in sorted(spent.items())},
        "engine_cpu_ms": engine_cpu * 1e3,
        "process_cpu_ms": process_cpu * 1e3,
        "threads": threads,
        "load": load,
    }
    print(json.dumps(report, indent=1))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
