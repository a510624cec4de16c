# .venv/bin/python examples/sft_warm_start.py --load outputs/tiny-llama --data outputs/sort_digits/sft.jsonl --output outputs/tiny-llama-sft --steps 300
"""Supervised warm start before RL: a few steps of next-token training on (prompt, answer) pairs with the
Megatron trainer (MegatronModule.train_step + chatgen.rlhf.algorithms.nll_loss_fn), saved as an HF directory
that vLLM and the RLHF trainers then load.

RL needs a policy that sometimes gets it right. examples/train_grpo_tiny.sh warm-starts on sft.jsonl of the
sort-digits task (mixed demonstrations: 70% sorted descending), so the model can sort but mostly the wrong
way, and GRPO does the rest. One process, CPU or one GPU; 300 steps take ~30 s on 2 CPU cores.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from chatgen.core import quiet


def sft_batch(tokenizer, records) -> dict:
    """Right-padded BOS + prompt + answer + EOS, with loss_mask (B, T-1) = 1 where the next token is answer/EOS."""
    rows, masks = [], []
    for r in records:
        prompt = tokenizer.encode(r["prompt"])
        answer = tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        masks.append([0] * (len(prompt) - 1) + [1] * len(answer))
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def sft_record_problem(record) -> str | None:
    """What a demonstration line lacks: string "prompt" and "answer" fields (chatgen.core.jsonl.read_records)."""
    missing = [key for key in ("prompt", "answer") if not isinstance(record.get(key), str)]
    if missing:
        return (
            f"needs string fields {', '.join(map(repr, missing))}; a demonstration is "
            '{"prompt": ..., "answer": ...} (python -m chatgen.tasks writes sft.jsonl in this form)'
        )
    return None


def batch_indices(num_records: int, batch_size: int, steps: int, generator: torch.Generator):
    """`steps` lists of `batch_size` record indices: a fresh shuffle per pass over the data, full batches only
    (a pass's remainder is dropped, so every batch splits into micro-batches)."""
    if batch_size > num_records:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {num_records} records; lower it"
        )
    per_pass = num_records // batch_size
    for step in range(steps):
        if step % per_pass == 0:
            order = torch.randperm(num_records, generator=generator).tolist()
        start = (step % per_pass) * batch_size
        yield order[start : start + batch_size]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="HF model directory to start from")
    parser.add_argument("--data", required=True, help="JSONL with prompt and answer fields")
    parser.add_argument(
        "--output", required=True, help="HF directory to write (replaced if it exists)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    quiet.apply()  # before the libraries load (CHATGEN_VERBOSE=1 shows all they say)

    from transformers import AutoTokenizer

    from chatgen import MegatronModule
    from chatgen.core.checkpoint_io import atomic_file
    from chatgen.core.jsonl import read_records
    from chatgen.models.convert import megatron_to_hf_dir
    from chatgen.rlhf.losses import nll_loss_fn
    from chatgen.rlhf.metrics import progress_bar, say

    torch.manual_seed(args.seed)
    try:  # before the model loads: a missing field is one line naming the file, the line and the fix
        records = read_records(args.data, sft_record_problem, "demonstrations")
    except (OSError, ValueError) as e:
        print(f"sft_warm_start.py: --data {e}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.load)
    trainer = MegatronModule(
        dict(
            load=args.load,
            lr=args.lr,
            seed=args.seed,
            clip_grad=1.0,
            micro_batch_size=args.batch_size,
            global_batch_size=args.batch_size,
        )
    ).start()
    try:
        start = time.perf_counter()
        batches = batch_indices(
            len(records), args.batch_size, args.steps, torch.Generator().manual_seed(args.seed)
        )
        # a live line on a terminal, else a line per 20%
        with progress_bar(args.steps, "sft step") as bar:
            for step, index in enumerate(batches):
                stats = trainer.train_step(
                    sft_batch(tokenizer, [records[i] for i in index]), nll_loss_fn
                )
                bar.set_postfix_str(f"loss {stats['loss']:.3f}", refresh=False)
                bar.update(1)
                if bar.disable and (
                    (step + 1) % max(1, args.steps // 5) == 0 or step == args.steps - 1
                ):
                    say(
                        f"sft step {step + 1}/{args.steps}: loss {stats['loss']:.3f} "
                        f"({time.perf_counter() - start:.1f}s)"
                    )
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.output))) as tmp:
            ckpt = trainer.save_checkpoint(os.path.join(tmp, "megatron"))
            out = megatron_to_hf_dir(ckpt, args.output, replace=True, side_files_from=args.load)
    finally:
        trainer.shutdown()
    with atomic_file(out / "chatgen_sft.json") as f:
        f.write_text(json.dumps(vars(args), indent=1))
    say(
        f"wrote the warm-started model to {args.output} (sft loss {stats['loss']:.3f} after {args.steps} steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
