# .venv/bin/python benchmarks/bench_hf_vs_vllm.py --output outputs/bench_hf_vs_vllm.json [--model DIR] [--rounds 6]
"""chatgen's two generation backends on one model, in one process: vLLM (`VLLMModule`, step-driven) against HF
transformers (`HFGeneration`), on the tiny task's two calls (issue 36: where is HF faster on CPU?).

    generate   --prompts train prompts x n samples, temperature 1 (an episode's rollout)
    eval       every held-out prompt, greedy (a held-out evaluation)

Both modules get the same per-model keys (configs/grpo_tiny/policy.yaml's, `load` replaced by --model; HF
the ones its schema has, i.e. all but vLLM's engine keys) and the
same prompts, and run alternately after a warm-up call each, so a load change hits both alike. Per call it records
wall seconds and this process's CPU seconds (the CPU figure is the one that survives a loaded machine; the wall
one says what a user waits for). Where vLLM's median falls below HF's is the crossover: run it for models of
several sizes (`--model` any HF Llama-family directory: the tiny model, SmolLM2-135M, ...).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument(
        "--model",
        default=str(REPO / "outputs" / "tiny-llama-sft"),
        help="HF model directory (default: the tiny task's warm start, examples/prepare_tiny.sh)",
    )
    parser.add_argument(
        "--config",
        default=str(REPO / "configs" / "grpo_tiny" / "policy.yaml"),
        help="per-model YAML whose keys both backends get (load replaced by --model)",
    )
    parser.add_argument(
        "--data",
        default=str(REPO / "outputs" / "sort_digits"),
        help="directory with train.jsonl and eval.jsonl (python -m chatgen.tasks)",
    )
    parser.add_argument(
        "--prompts", type=int, default=32, help="train prompts per generate call (x n samples)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    # as `chatgen train` sets it, before torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(REPO))

    import dataclasses

    import yaml

    from chatgen.core.jsonl import read_prompt_records
    from chatgen.generation.hf.module import HFGeneration
    from chatgen.generation.vllm.module import VLLMModule

    keys = {**yaml.safe_load(Path(args.config).read_text()), "load": args.model}
    # the shared generation keys
    hf_keys = {f.name for f in dataclasses.fields(HFGeneration.config_class)}
    modules = {
        "vllm": VLLMModule(keys).start(),
        "hf": HFGeneration({k: v for k, v in keys.items() if k in hf_keys}).start(),
    }
    train = [
        r["prompt"] for r in read_prompt_records(Path(args.data) / "train.jsonl")[: args.prompts]
    ]
    held_out = [r["prompt"] for r in read_prompt_records(Path(args.data) / "eval.jsonl")]
    calls = {
        name: {
            "generate": (m.prepare_dataset(train), False),
            "eval": (m.prepare_dataset(held_out, True), True),
        }
        for name, m in modules.items()
    }
    times = {
        name: {call: {"wall_s": [], "cpu_s": []} for call in ("generate", "eval")}
        for name in modules
    }
    for r in range(args.rounds + 1):  # round 0: warm-up, not recorded
        for name in list(modules) if r % 2 else list(modules)[::-1]:
            for call, (items, is_eval) in calls[name].items():
                wall, cpu = time.perf_counter(), time.process_time()
                modules[name].run_generation(items, is_eval)
                if r:
                    times[name][call]["wall_s"].append(time.perf_counter() - wall)
                    times[name][call]["cpu_s"].append(time.process_time() - cpu)
    medians = {
        name: {call: {k: statistics.median(v) for k, v in t.items()} for call, t in calls_.items()}
        for name, calls_ in times.items()
    }
    result = {
        "model": args.model,
        "config": args.config,
        "prompts": args.prompts,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "median": medians,
        "vllm_over_hf": {
            call: {
                k: medians["vllm"][call][k] / medians["hf"][call][k] for k in ("wall_s", "cpu_s")
            }
            for call in ("generate", "eval")
        },
        "all": times,
    }
    for m in modules.values():
        m.shutdown()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps({k: result[k] for k in ("model", "median", "vllm_over_hf", "loadavg")}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
