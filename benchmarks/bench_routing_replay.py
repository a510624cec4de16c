# python benchmarks/bench_routing_replay.py --output outputs/bench_routing_replay.json [--dtypes float32,bfloat16]
"""Train/inference log-prob mismatch of a mixture-of-experts policy with and without routing replay.

For each dtype: the tiny Qwen3-MoE (configs/models/tiny_qwen3_moe.yaml, built into a temporary directory; or
--model DIR) is loaded by a VLLMModule that records routing (`return_routed_experts`) and by a MegatronModule in
the same dtype; the engine samples --prompts sort-task prompts x --n responses at temperature 1 (up to
--max-new-tokens), then the trainer scores the sampled tokens twice: routing itself, and replaying the engine's
experts (`moe_routing_replay`). Reported per dtype, over every sampled token:

    routing_disagreement  share of (token, layer) pairs whose top-k set the trainer's router picks differs from
                          the one the engine used
    no_replay / replay    max and mean |trainer - engine| log-prob

Writes JSON to --output with the load average (figures of mismatch do not depend on the load; times are not
reported). A few seconds per dtype on 2 CPU cores.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def measure(model_dir: str, dtype: str, prompts: int, n: int, max_new_tokens: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import TopKRouter

    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.rlhf import tasks
    from chatgen.training.megatron_module import MegatronModule

    policy = VLLMModule(
        dict(
            load=model_dir,
            dtype=dtype,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            seq_length=128,
            new_token_limit=True,
            max_new_tokens=max_new_tokens,
            logprobs_mode="raw",
            temperature=1.0,
            seed=0,
            n=n,
            return_routed_experts=True,
        )
    ).start()
    try:
        prompts_text = [r["prompt"] for r in tasks.sort_digits_records(prompts, 7)]
        batch = policy.run_generation(policy.build_dataset(prompts_text))
    finally:
        policy.shutdown()
    data, mask = batch.trainer_inputs(), batch.loss_mask
    out = {"tokens": int(mask.sum())}
    for replay in (False, True):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        trainer = MegatronModule(
            dict(load=model_dir, dtype=dtype, moe_routing_replay=replay)
        ).start()
        chosen = []  # the trainer's own (tokens, E) routing maps, layer by layer
        if not replay:
            for router in (m for m in trainer.model.modules() if isinstance(m, TopKRouter)):
                router.register_forward_hook(
                    lambda _m, _a, output: chosen.append(output[1].detach())
                )
        diff = (trainer.forward_tokens(data) - batch.infer_logprobs).abs() * mask
        out["replay" if replay else "no_replay"] = {
            "max": float(diff.max()),
            "mean": float(diff.sum() / mask.sum()),
        }
        if chosen:  # compare on the positions whose routing fed a sampled token's log-prob (prompt + response)
            s, length = data["input_ids"].shape
            recorded = data["routed_experts"]  # (S, L, layers, k)
            # (S, L, layers, E)
            own = torch.stack([m.view(length, s, -1).transpose(0, 1) for m in chosen], dim=2)
            engine = torch.zeros_like(own).scatter_(-1, recorded.clamp(min=0), True)
            known = recorded[..., 0] >= 0
            out["routing_disagreement"] = float((own != engine).any(-1)[known].float().mean())
        trainer.shutdown()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument(
        "--model", help="an MoE HF directory; default: the tiny Qwen3-MoE, built for the run"
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory(prefix="chatgen-replay-") as tmp:
        model = args.model
        if model is None:
            from chatgen.models import tiny

            model = str(
                tiny.make_tiny_model(
                    tiny.load_spec(REPO / "configs/models/tiny_qwen3_moe.yaml"),
                    Path(tmp) / "tiny-qwen3-moe",
                )
            )
        results = {
            dtype: measure(model, dtype, args.prompts, args.n, args.max_new_tokens)
            for dtype in args.dtypes.split(",")
        }
    report = {
        "model": args.model or "configs/models/tiny_qwen3_moe.yaml",
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
        "loadavg": os.getloadavg(),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    for dtype, r in results.items():
        print(
            f"{dtype}: {r['tokens']} sampled tokens, routing disagreement {r['routing_disagreement']:.4f}; "
            f"|dlogprob| without replay max {r['no_replay']['max']:.3g} mean {r['no_replay']['mean']:.3g}, "
            f"with replay max {r['replay']['max']:.3g} mean {r['replay']['mean']:.3g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
