# .venv/bin/python benchmarks/stress_server.py --output outputs/stress_server.json
"""The adversarial round's stress load against the OpenAI server, bounded: --concurrency requests
at once in --waves waves (completions and chats, streamed or not, n up to 4, some cancelled by their
client mid-way), with weight updates in all four modes (wait, keep, recompute, abort) landing while
they run.

What must hold, and is counted: no request hangs (each has a deadline), every answered request's
token counts agree (usage.completion_tokens = the tokens of its choices = the weight versions it
reports, a streamed one's chunks summed), no 5xx, /health answers after each wave, and the server's
memory (RSS) stays flat. Prints one JSON line per wave and the summary; saves them to --output. The
model is the tiny Llama (built into the test-model cache if missing); the server runs in this
process on a free loopback port (chatgen.serving.app + limits, as `chatgen serve` runs it).
"""

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("wait", "keep", "recompute", "abort")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def check_counts(body: dict, errors: list, what: str) -> int:
    """Tokens of an answered non-streamed request, after checking they agree with usage."""
    tokens = 0
    for choice in body["choices"]:
        message = choice.get("message") or {}
        ids = choice.get("token_ids") or message.get("generation_token_ids") or []
        versions = (
            choice.get("generation_weight_versions")
            or message.get("generation_weight_versions")
            or []
        )
        if len(versions) != len(ids):
            errors.append(f"{what}: {len(ids)} tokens, {len(versions)} weight versions")
        tokens += len(ids)
    if body["usage"]["completion_tokens"] != tokens:
        errors.append(
            f"{what}: usage says {body['usage']['completion_tokens']}, the choices hold {tokens}"
        )
    return tokens


async def one_request(client, i: int, rng: random.Random, stats: dict, errors: list) -> None:
    chat, stream, n = rng.random() < 0.5, rng.random() < 0.5, rng.choice((1, 1, 2, 4))
    cancel_after = rng.choice((None, None, None, 2)) if stream else None
    body = {
        "model": "tiny",
        "max_tokens": rng.randint(4, 40),
        "n": n,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"story {i}"}]
    else:
        path, body["prompt"] = "/v1/completions", f"once upon a time {i}"
    if stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    what = f"request {i} ({path}, n={n}, stream={stream})"
    try:
        if not stream:
            r = await client.post(path, json=body)
            if r.status_code >= 500:
                errors.append(f"{what}: {r.status_code} {r.text[:200]}")
            elif r.status_code == 200:
                stats["tokens"] += check_counts(r.json(), errors, what)
            stats["answered"] += 1
            return
        async with client.stream("POST", path, json=body) as r:
            if r.status_code >= 500:
                errors.append(f"{what}: {r.status_code}")
                return
            chunks, tokens, usage = 0, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    stats["stream_errors"] += 1  # e.g. a failed update's message: named, not a hang
                    continue
                chunks += 1
                for choice in event.get("choices", []):
                    tokens += len(choice.get("token_ids") or [])
                usage = event.get("usage") or usage
                if cancel_after is not None and chunks >= cancel_after:
                    stats["cancelled"] += 1
                    return  # leaving the block closes the connection: the server must abort it
            if usage is not None and usage["completion_tokens"] != tokens:
                errors.append(
                    f"{what}: usage says {usage['completion_tokens']}, the chunks hold {tokens}"
                )
            stats["tokens"] += tokens
            stats["answered"] += 1
    except Exception as e:  # a timeout is a hang
        errors.append(f"{what}: {type(e).__name__}: {e}")


def updater(module, weights, stop: threading.Event, counts: dict, errors: list) -> None:
    """Weight updates in every mode, one after the other, while requests run."""
    k = 0
    while not stop.is_set():
        mode = MODES[k % len(MODES)]
        try:
            module.update_weights(list(weights.items()), mode=mode)
            counts[mode] = counts.get(mode, 0) + 1
        except Exception as e:
            errors.append(f"update {mode}: {type(e).__name__}: {e}")
        k += 1
        stop.wait(0.05)


async def wave(url: str, key: str, concurrency: int, seed: int, timeout: float) -> tuple:
    import httpx

    rng, stats, errors = (
        random.Random(seed),
        {"answered": 0, "cancelled": 0, "tokens": 0, "stream_errors": 0},
        [],
    )
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        await asyncio.gather(
            *(one_request(client, i, rng, stats, errors) for i in range(concurrency))
        )
        health = (await client.get("/health")).status_code
    return stats, errors, health


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--concurrency", type=int, default=150)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="a request's deadline, seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(REPO / "tests"))
    import uvicorn
    from conftest import build_tiny_model
    from safetensors.torch import load_file

    from chatgen.core.distributed import free_port
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.serving.app import build_app
    from chatgen.serving.limits import uvicorn_config

    model = build_tiny_model("tiny_llama")
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    module = VLLMModule(
        dict(
            load=str(model),
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=True,
            seq_length=256,
            block_size=32,
            max_new_tokens=64,
            seed=0,
        )
    ).start()
    module.tokenizer.chat_template = chat_template
    weights = load_file(str(model / "model.safetensors"))
    key, port = "stress-key", free_port()
    server = uvicorn.Server(
        uvicorn_config(
            build_app(module, api_key=key, model_name="tiny"), host="127.0.0.1", port=port
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    results, updates, all_errors = [], {}, []
    try:
        for w in range(args.waves):
            stop, update_errors = threading.Event(), []
            up = threading.Thread(
                target=updater, args=(module, weights, stop, updates, update_errors)
            )
            start = time.perf_counter()
            up.start()
            stats, errors, health = asyncio.run(
                wave(f"http://127.0.0.1:{port}", key, args.concurrency, w, args.timeout)
            )
            stop.set()
            up.join()
            row = {
                "wave": w + 1,
                "seconds": round(time.perf_counter() - start, 1),
                **stats,
                "errors": len(errors) + len(update_errors),
                "health": health,
                "rss_mb": round(rss_mb(), 1),
                "updates_so_far": dict(updates),
                "weight_version": module.weight_version,
            }
            print(json.dumps(row), flush=True)
            results.append(row)
            all_errors += errors + update_errors
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        module.shutdown()
    summary = {
        "concurrency": args.concurrency,
        "waves": args.waves,
        "updates": updates,
        "requests_answered": sum(r["answered"] for r in results),
        "cancelled": sum(r["cancelled"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "errors": all_errors[:50],
        "rss_growth_after_first_wave_mb": round(results[-1]["rss_mb"] - results[0]["rss_mb"], 1),
        "load": os.getloadavg(),
    }
    print(json.dumps(summary), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"waves": results, "summary": summary}, indent=2))
    return 0 if not all_errors and all(r["health"] == 200 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
