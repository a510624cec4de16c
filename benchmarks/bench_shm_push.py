# PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/bench_shm_push.py --output /tmp/bench_shm_push.json
"""CPU of one weight push through shared memory, each end on one thread (an engine of
bench_agentic.py has a core): the trainer's `ShmSender.owned(token).write` and an engine's
`load_shm` into a real vLLM engine (the digest check, the finiteness check and vLLM's reload),
in CPU milliseconds (what a loaded machine bends least) and wall, the median of --pushes after
one warm-up. The model is bench_agentic.py's (the tiny Llama at --hidden 1024, 98 MB in fp32),
made by it when missing.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def timed(fn) -> tuple:
    """(wall ms, this process's CPU ms) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="the tiny Llama's hidden size")
    p.add_argument("--pushes", type=int, default=8)
    p.add_argument("--output", default="/tmp/bench_shm_push.json")
    args = p.parse_args(argv)

    import torch
    from conftest import build_tiny_model
    from helpers import chat_model, engine
    from safetensors.torch import load_file

    from chatgen.param_sync import ShmSender, load_shm

    torch.set_num_threads(1)
    width = {  # as bench_agentic.py
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": max(1, args.hidden // 256),
    }
    model = Path(f"/tmp/bench_agentic/model-{args.hidden}")
    if not (model / "model.safetensors").exists():
        chat_model(build_tiny_model("tiny_llama", max_position_embeddings=1024, **width), model)
    state = list(load_file(str(model / "model.safetensors")).items())
    policy = engine(model)
    sender = ShmSender.owned("bench-token")
    rows = []
    for i in range(args.pushes + 1):
        handles = {}
        write = timed(lambda: handles.update(sender.write(state)))
        load = timed(lambda: load_shm(policy, handles, "bench-token", "keep"))
        if i:  # the first write also creates the file
            rows.append(write + load)
            print(f"push {i}: write {write[1]:.1f} ms CPU, load {load[1]:.1f} ms CPU", flush=True)
    sender.close()
    keys = ("write_wall_ms", "write_cpu_ms", "load_wall_ms", "load_cpu_ms")
    out = {
        "args": vars(args),
        "bytes": sum(t.numel() * t.element_size() for _, t in state),
        "median": {k: statistics.median(r[i] for r in rows) for i, k in enumerate(keys)},
        "pushes": [dict(zip(keys, r)) for r in rows],
    }
    print(json.dumps(out["median"], indent=1))
    Path(args.output).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
