# python benchmarks/bench_lora_memory.py --output outputs/bench_lora_memory.json [--model DIR ...] [--rank 4]
"""Trainer memory of LoRA against full fine-tuning: trainable parameters, optimizer state and gradient buffers.

For each model (default: the tiny Llama of tests/conftest.py and SmolLM2-135M where it is cached), a
MegatronModule (fp32, TP 1) is built twice, full and with `lora.rank` adapters on every linear layer, and takes
one train step; reported per mode:

    trainable / share       parameters the optimizer steps, and their share of the model
    optimizer_state_bytes   Adam's moments plus any main-weight copies distinct from the model's parameters
    grad_buffer_bytes       megatron DDP's gradient buffers

and the LoRA / full ratios. Writes JSON to --output with the load average (bytes do not depend on the load).
"""

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(model_dir: str, lora: dict | None) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    cfg = dict(load=model_dir, lr=1e-4, seq_length=64)
    if lora:
        cfg["lora"] = lora
    trainer = MegatronModule(cfg).start()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    trainer.train_step({"input_ids": ids}, lambda lp, mb: (-lp.mean(), {}))
    params = {p.data_ptr() for p in trainer.model.parameters()}
    state = 0
    for chained in trainer.optimizer.chained_optimizers:
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.data_ptr() not in params:  # a main-weight copy (bf16/fp16 models)
                    state += p.numel() * p.element_size()
                state += sum(
                    t.numel() * t.element_size() for t in inner.state[p].values() if t.dim() > 0
                )
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in trainer.ddp.buffers)
    total = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.shutdown()
    return dict(
        trainable=trainable,
        share=trainable / total,
        optimizer_state_bytes=state,
        grad_buffer_bytes=grads,
    )


def default_models() -> list[str]:
    """The tiny Llama and, where its GGUF package is installed, SmolLM2-135M (the test suite's cached
    builds); bench_lora_sync measures the same two."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_model, smollm2_model

    models = [str(build_tiny_model("tiny_llama"))]
    try:
        models.append(str(smollm2_model()))
    except LookupError as e:
        print(f"SmolLM2 skipped: {e}")
    return models


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="outputs/bench_lora_memory.json")
    parser.add_argument("--model", action="append", help="HF model directory (repeatable)")
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args(argv)
    models = args.model or default_models()
    out = {"load_average": os.getloadavg(), "rank": args.rank, "models": {}}
    for model in models:
        full = measure(model, None)
        lora = measure(model, dict(rank=args.rank, alpha=2.0 * args.rank))
        row = dict(
            full=full,
            lora=lora,
            optimizer_state_ratio=lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
            grad_buffer_ratio=lora["grad_buffer_bytes"] / full["grad_buffer_bytes"],
        )
        out["models"][Path(model).name] = row
        print(Path(model).name, json.dumps(row, indent=1))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
