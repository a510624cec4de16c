# .venv/bin/python benchmarks/bench_eval_phase.py --output /tmp/bench_eval_phase.json [--rounds 6] [--evals 5]
"""The main job's held-out evaluation (configs/grpo_tiny.yaml: 256 greedy prompts, one engine call),
before and after the batched request path (chatgen.generation.vllm.adapter.request_batch), alternating
in one process so that the machine's load hits both alike.

"before" is VLLMModule._queue as it was: a SamplingParams built per prompt and each prompt through
vLLM's whole input processing (validation, rendering, a deep copy of the params); "after" is the
shipped _queue: one params object per kind of prompt, vLLM's processing once per kind and a copy of
the processed request for the rest. Both give the same tokens (the script asserts the metrics are
equal). Writes {"before_s": [...], "after_s": [...], "ratio": median after / median before,
"load": the 1-minute load average at start and end} to --output.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def queue_before(self, items, is_eval=False, greedy=False) -> list:
    """VLLMModule._queue before the batched path (kept here for the comparison)."""
    request_ids = []
    for i, item in enumerate(items):
        self.check_item(item, f"run_generation: item {i}")
        params = self.sampling_params(
            len(item["input_ids"]),
            is_eval=is_eval,
            greedy=greedy or item.get("greedy", False),
            stop_strings=item.get("stop_strings") or (),
            stop_token_ids=item.get("stop_token_ids") or (),
        )
        request_ids.append(
            self.add_request(item["input_ids"], params, prompt_text=item.get("prompt"))
        )
    return request_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--evals", type=int, default=5, help="evaluations per round and variant")
    args = parser.parse_args()

    from chatgen.cli.config import checked_run_config
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.run import Run

    out_dir = tempfile.mkdtemp(prefix="bench_eval_phase_")
    cfg, _ = checked_run_config(
        "configs/grpo_tiny.yaml",
        [f"runtime.output_dir={out_dir}/run", "runtime.save_episode_interval=null"],
    )
    after = VLLMModule._queue
    times = {"before": [], "after": []}
    results = {}
    load = [os.getloadavg()[0]]
    try:
        with Run(cfg, False, grpo.PHASES, print, records_per_episode=32) as run:
            run.evaluate()  # warm-up
            for _ in range(args.rounds):
                for name, queue in (("before", queue_before), ("after", after)):
                    VLLMModule._queue = queue
                    for _ in range(args.evals):
                        start = time.perf_counter()
                        results[name] = run.evaluate()
                        times[name].append(time.perf_counter() - start)
    finally:
        VLLMModule._queue = after
        shutil.rmtree(out_dir, ignore_errors=True)
    load.append(os.getloadavg()[0])
    assert results["before"] == results["after"], results  # the same greedy tokens, scored
    report = {
        "before_s": times["before"],
        "after_s": times["after"],
        "median_before_s": statistics.median(times["before"]),
        "median_after_s": statistics.median(times["after"]),
        "ratio": statistics.median(times["after"]) / statistics.median(times["before"]),
        "load": load,
        "cpus": os.cpu_count(),
    }
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_s")}, indent=1))
    print(
        f"median per evaluation: before {report['median_before_s']:.3f} s, after "
        f"{report['median_after_s']:.3f} s"
    )
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
