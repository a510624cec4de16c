"""`chatgen check-sync`: sync Megatron weights into a generation engine and compare their log-probs
(chatgen.tools.check_sync; docs/check_sync.md).

    chatgen check-sync --hf-checkpoint outputs/tiny-llama --train-tp 2 --train-pp 1 --infer-tp 1 \\
        --input prompts.jsonl --output check.json --max-new-tokens 16
"""

import json
import sys
import time
from pathlib import Path

from chatgen.cli import positive_int
from chatgen.tools.check_sync import check_sync


def add_arguments(p):
    p.add_argument(
        "--hf-checkpoint", required=True, help="HF model directory (a family of chatgen/models)"
    )
    p.add_argument("--train-tp", type=positive_int, default=1, help="trainer tensor-parallel size")
    p.add_argument(
        "--train-pp", type=positive_int, default=1, help="trainer pipeline-parallel size"
    )
    p.add_argument(
        "--train-ep", type=positive_int, default=1, help="trainer expert-parallel size (MoE models)"
    )
    p.add_argument(
        "--trainer-backend",
        choices=["megatron", "fsdp"],
        default="megatron",
        help="the trainer to sync from: megatron (default; families of chatgen/models) or fsdp "
        "(transformers' model under FSDP2: any family; docs/fsdp_backend.md)",
    )
    p.add_argument(
        "--train-dp",
        type=positive_int,
        default=1,
        help="data-parallel trainer ranks of --trainer-backend fsdp (FSDP shards over them)",
    )
    p.add_argument("--infer-tp", type=positive_int, default=1, help="vLLM tensor-parallel size")
    p.add_argument(
        "--backend",
        default="vllm",
        help="generation backend to sync into and compare: vllm (default) or "
        "hf (transformers, the reference)",
    )
    p.add_argument("--input", required=True, help='JSONL of {"prompt_ids": [...]} lines')
    p.add_argument("--output", required=True, help="where to write the JSON report")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy, raw log-probs; T > 0: the engine samples at T and "
        "reports the tempered (processed) log-probs, the trainer scores logits / T "
        "(as an RLHF run at that temperature)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="with --temperature: the engine samples from its top-k (0: off) and the trainer "
        "renormalises over the same set",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="the same for top-p (1.0: off; after top-k)"
    )
    p.add_argument(
        "--threshold", type=float, default=1e-4, help="max |vLLM - trainer| log-prob allowed"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bucket-mb", type=float, default=256, help="sync bucket size in MiB")
    p.add_argument(
        "--validate", action="store_true", help="also compare every synced tensor bit for bit"
    )
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM KV cache size (CPU)")
    p.add_argument(
        "--lora",
        type=positive_int,
        default=None,
        metavar="RANK",
        help="a LoRA trainer of this rank on every target, its adapters random (docs/lora.md)",
    )
    p.add_argument(
        "--lora-sync",
        choices=["merged", "adapter"],
        default="merged",
        help="with --lora: merged weights (any layout) or the adapter only (one trainer process, TP 1 engine)",
    )


def run(args) -> int:
    start = time.perf_counter()
    result = check_sync(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    ok = (
        result["max_abs_logprob_diff"] <= args.threshold
        and result.get("max_abs_expert_weight_diff", 0.0) == 0.0
    )
    print(
        f"check-sync {result['mode']}"
        + (f" LoRA rank {args.lora} ({args.lora_sync})" if args.lora else "")
        + f" train TP={args.train_tp} PP={args.train_pp}"
        + (f" EP={args.train_ep}" if args.train_ep > 1 else "")
        + f" -> infer TP={args.infer_tp}: "
        f"max |dlogprob| {result['max_abs_logprob_diff']:.3g} (threshold {args.threshold:g}), "
        f"sync {result['sync_seconds'] * 1e3:.1f} ms for {result['sync_bytes'] / 1e6:.1f} MB, "
        + (
            f"trainer start {result['trainer_start_seconds']:.1f} s, "
            if "trainer_start_seconds" in result
            else ""
        )
        + (
            f"max |dweight| over {len(result['expert_weight_max_abs_diff'])} expert weights "
            f"{result['max_abs_expert_weight_diff']:.3g}, "
            if "max_abs_expert_weight_diff" in result
            else ""
        )
        + f"{len(result['samples'])} samples, {time.perf_counter() - start:.1f} s total -> {out}: "
        f"{'OK' if ok else 'FAILED'}",
        file=sys.stderr if not ok else sys.stdout,
    )
    return 0 if ok else 1
