# python benchmarks/bench_lora_sync.py --output outputs/bench_lora_sync.json [--model DIR ...] [--rank 4] [--repeats 5]
"""A LoRA trainer's two syncs into vLLM, in one process on CPU: merged (W + (alpha / r) B A of every adapted
weight through `sync_weights`) against adapter-only (`sync_adapter`: the adapter alone, loaded from memory as a
vLLM LoRA adapter on the engine's base weights).

For each model (default: the tiny Llama of tests/conftest.py and SmolLM2-135M where it is cached) a MegatronModule
(fp32, TP 1, lora.rank on every target) takes one step; one engine syncs merged, another (enable_lora) takes the
adapter; the two syncs alternate --repeats times. Reported: bytes each moves, median seconds, the ratios, and
the engines' log-prob agreement with the trainer after each. Writes JSON to --output with the load average
(times depend on the load: compare the ratios). `benchmarks/bench_sync.py` runs the same `measure` as its LoRA
case.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vllm(model_dir: str, lora_rank: int | None):
    """An engine on the model's own weights (the adapter-only one serves adapters of up to lora_rank)."""
    from chatgen.generation.vllm.module import VLLMModule

    lora = dict(enable_lora=True, max_lora_rank=lora_rank) if lora_rank else {}
    return VLLMModule(
        dict(
            load=model_dir,
            enforce_eager=True,
            dtype="float32",
            seed=0,
            seq_length=128,
            kv_cache_memory_bytes=64 << 20,
            temperature=0.0,
            new_token_limit=True,
            max_new_tokens=6,
            logprobs_mode="raw",
            **lora,
        )
    ).start()


def measure(model_dir: str, rank: int, repeats: int) -> dict:
    import torch
    from helpers import SYNC_PROMPTS, batch, build, generate, nll_loss

    from chatgen.param_sync import sync_adapter, sync_weights

    trainer = build(model_dir, lr=1e-3, seq_length=64, lora=dict(rank=rank, alpha=2.0 * rank))
    trainer.train_step({"input_ids": batch(vocab=100, t=16)}, nll_loss)
    trainer.train_step({"input_ids": batch(vocab=100, t=16)}, nll_loss)
    merged_llm, lora_llm = vllm(model_dir, None), vllm(model_dir, max(8, rank))

    def agreement(llm) -> float:
        worst = 0.0
        for prompt, (ids, lp) in zip(SYNC_PROMPTS, generate(llm)):
            mine = trainer.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[0]
            worst = max(worst, (mine[len(prompt) - 1 :] - torch.tensor(lp)).abs().max().item())
        return worst

    times = {"merged": [], "adapter": []}
    out = {}
    for _ in range(repeats):
        t = time.perf_counter()
        out["merged_bytes"] = sync_weights(trainer, merged_llm).bytes
        times["merged"].append(time.perf_counter() - t)
        t = time.perf_counter()
        out["adapter_bytes"] = sync_adapter(trainer, lora_llm).bytes
        times["adapter"].append(time.perf_counter() - t)
    out.update(
        merged_s=statistics.median(times["merged"]),
        adapter_s=statistics.median(times["adapter"]),
        merged_min_s=min(times["merged"]),
        adapter_min_s=min(times["adapter"]),
        merged_logprob_max_abs=agreement(merged_llm),
        adapter_logprob_max_abs=agreement(lora_llm),
    )
    out["bytes_ratio"] = out["adapter_bytes"] / out["merged_bytes"]
    out["time_ratio"] = out["adapter_s"] / out["merged_s"]
    merged_llm.shutdown()
    lora_llm.shutdown()
    trainer.shutdown()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="outputs/bench_lora_sync.json")
    parser.add_argument("--model", action="append", help="HF model directory (repeatable)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.model:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_lora_memory import default_models
    models = args.model or default_models()
    out = {"load_average": os.getloadavg(), "rank": args.rank, "models": {}}
    for model in models:
        row = measure(model, args.rank, args.repeats)
        out["models"][Path(model).name] = row
        print(Path(model).name, json.dumps(row, indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
