# python benchmarks/bench_token_microbatches.py --output /tmp/bench_token_microbatches.json [--rounds 3]
"""Train step time of token micro-batches (max_tokens_per_micro_batch) against fixed micro-batches on a
long-tailed batch: a few long samples among many short ones.

One MegatronModule (the tiny Llama of outputs/tiny-llama, or --model DIR; fp32, CPU) trains the same batch
in alternating rounds: fixed micro-batches of --micro-batch-size samples (each padded to the batch's longest
sample, as every trainer without token budgets runs them), then token micro-batches of at most --max-tokens
tokens (whole samples binned first-fit decreasing, each bin packed into one row). The batch: --long samples of
--long-length tokens among --short samples of 16-40 tokens, every prompt distinct (SFT-shaped; the loss is the
token-mean NLL of the responses). The learning rate is below fp32 resolution, so every round trains the same
weights. The two losses differ a little by design: fixed micro-batches average their micro-batch means,
token micro-batches give the global batch's token mean (docs/long_context.md). Prints and writes JSON: the median step time of each and their
ratio (target <= 0.6), with the load average.
"""

import argparse
import json
import os
import statistics
import time

import torch

from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf.losses import nll_loss_fn
from chatgen.training.megatron_module import MegatronModule


def long_tailed(long: int, long_length: int, short: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(long + short):
        prompt = torch.randint(4, vocab, (8 + i % 5,), generator=gen).tolist()
        n = (
            long_length - len(prompt)
            if i < long
            else int(torch.randint(8, 32, (1,), generator=gen))
        )
        response = torch.randint(4, vocab, (n,), generator=gen).tolist()
        samples.append(
            Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[0.0] * n)
        )
    order = torch.randperm(len(samples), generator=gen).tolist()  # the long ones anywhere
    return RolloutBatch.from_samples([samples[i] for i in order], pad_token_id=0).trainer_inputs()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="outputs/tiny-llama")
    parser.add_argument("--output", default="/tmp/bench_token_microbatches.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=2)
    parser.add_argument("--long-length", type=int, default=512)
    parser.add_argument("--short", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()

    trainer = MegatronModule(
        dict(load=args.model, lr=1e-12, clip_grad=0.0, micro_batch_size=args.micro_batch_size)
    ).start()
    data = long_tailed(args.long, args.long_length, args.short, trainer.spec.vocab_size)
    times = {"fixed": [], "tokens": []}
    losses = {}
    for _ in range(args.rounds + 1):  # the first round warms up, untimed
        for mode, budget in (("fixed", None), ("tokens", args.max_tokens)):
            trainer.config.max_tokens_per_micro_batch = budget
            start = time.perf_counter()
            metrics = trainer.train_step(data, nll_loss_fn)
            times[mode].append(time.perf_counter() - start)
            losses[mode] = metrics
    trainer.shutdown()
    fixed, tokens = (statistics.median(times[m][1:]) for m in ("fixed", "tokens"))
    result = dict(
        batch=dict(
            samples=len(data),
            width=data.input_ids.shape[1],
            tokens=int(data.attention_mask.sum()),
            long=args.long,
            long_length=args.long_length,
        ),
        micro_batch_size=args.micro_batch_size,
        max_tokens_per_micro_batch=args.max_tokens,
        step_s=dict(fixed=fixed, tokens=tokens),
        ratio=tokens / fixed,
        rounds=times,
        loss=dict(fixed=losses["fixed"]["loss"], tokens=losses["tokens"]["loss"]),
        padding_tokens_trained={m: losses[m]["padding_tokens_trained"] for m in losses},
        loadavg=os.getloadavg(),
    )
    print(json.dumps(result, indent=1))
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
