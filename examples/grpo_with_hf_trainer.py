# python examples/grpo_with_hf_trainer.py --output outputs/grpo_hf/metrics.jsonl   (bash examples/prepare_tiny.sh first)
# server mode: chatgen serve --model outputs/tiny-llama-sft --control --api-key KEY seq_length=64 max_new_tokens=16 \
#                logprobs_mode=raw enforce_eager=true kv_cache_memory_bytes=33554432
#              python examples/grpo_with_hf_trainer.py --mode server --server-url http://127.0.0.1:8000 --api-key KEY
"""GRPO in plain PyTorch: a transformers model, a torch optimizer, and `chatgen.VLLMGeneration` for sampling.

No Megatron, no Ray, no chatgen run loop: the whole algorithm is the loop in `main`, top to bottom. Each step
samples `--group` completions of `--prompts` training prompts with vLLM, scores them with chatgen's sort-digits
rule, turns rewards into group-relative advantages, takes `--updates` clipped policy-gradient steps on the
transformers model, and syncs its weights into the engine: in this process (`--mode colocate`), or a
`chatgen serve --control` server's (`--mode server`, the same loop). The engine's log-probs are the "old"
log-probs of the ratio: with logprobs_mode="raw" they equal the model's own within 1e-4 (`logprob_mismatch`, the
largest difference over the step's first mini-batch, is logged; tests/integration/test_vllm_generation*.py
check it).
The held-out reward (greedy, 256 prompts the training never sees) is measured every `--eval-every` steps.

On the tiny warm-started Llama of examples/prepare_tiny.sh (sorts, mostly the wrong way) held-out reward goes
from ~0.26 to > 0.8 within 20 steps on 2 CPU cores (docs/vllm_generation.md has the measured curve).
"""

import argparse
import json
import time
from pathlib import Path

from chatgen.core import quiet

quiet.apply()  # before transformers and vLLM load; CHATGEN_VERBOSE=1 shows all they say

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from chatgen import VLLMGeneration  # noqa: E402
from chatgen.core.jsonl import read_prompt_records  # noqa: E402
from chatgen.core.train_batch import TrainBatch  # noqa: E402
from chatgen.rlhf.losses import PolicyLossOptions, group_advantages, policy_loss  # noqa: E402
from chatgen.tasks import sort_digits  # noqa: E402
from chatgen.training import muon  # noqa: E402


def token_batch(prompt_ids, completion_ids, pad_id):
    """Right-padded prompt + completion ids (S, L), their attention mask, and a (S, L-1) mask that is 1 where the
    next token is a completion token (position t predicts token t + 1)."""
    rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
    ids = torch.full((len(rows), max(map(len, rows))), pad_id)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, (p, row) in enumerate(zip(prompt_ids, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        mask[i, len(p) - 1 : len(row) - 1] = 1
    return ids, attention, mask


def evaluate(gen, tokenizer, records) -> float:
    _, completions, _ = gen.generate([tokenizer.encode(r["prompt"]) for r in records], greedy=True)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return sum(sort_digits.reward(t, r["answer"]) for t, r in zip(texts, records)) / len(records)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="outputs/tiny-llama-sft", help="HF model directory to start from"
    )
    parser.add_argument(
        "--data", default="outputs/sort_digits", help="directory with train.jsonl and eval.jsonl"
    )
    parser.add_argument(
        "--output", help="write one JSON line per step here (reward, eval_reward, seconds)"
    )
    parser.add_argument("--mode", choices=["colocate", "server"], default="colocate")
    parser.add_argument(
        "--server-url", default="http://127.0.0.1:8000", help="--mode server: the server's address"
    )
    parser.add_argument("--api-key", help="--mode server: the server's --api-key")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument(
        "--group", type=int, default=8, help="completions per prompt (the GRPO group)"
    )
    parser.add_argument(
        "--updates", type=int, default=2, help="optimizer steps per step (mini-batches)"
    )
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: torch.optim.Muon on the hidden matrices, AdamW on the rest (chatgen.training.muon)",
    )
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train, held_out = (
        read_prompt_records(f"{args.data}/train.jsonl"),
        read_prompt_records(f"{args.data}/eval.jsonl")[: args.eval_prompts],
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.optimizer == "muon":
        optimizer = muon.build(policy.named_parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    if args.mode == "colocate":
        gen = VLLMGeneration(
            args.model,
            max_completion_length=16,
            max_model_length=64,
            logprobs_mode="raw",
            enforce_eager=True,
            kv_cache_memory_bytes=32 << 20,
            seed=args.seed,
        )
    else:  # the server's engine settings are its own (see the command at the top)
        gen = VLLMGeneration(
            args.model,
            "server",
            server_base_url=args.server_url,
            api_key=args.api_key,
            max_completion_length=16,
        )
    gen.sync_weights(policy)  # a server may hold other weights; start both sides from the same ones
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    log = open(args.output, "w") if args.output else None
    history, start = [], time.perf_counter()
    for step in range(args.steps + 1):
        record = {"step": step}
        if step % args.eval_every == 0 or step == args.steps:
            record["eval_reward"] = evaluate(gen, tokenizer, held_out)
        if step < args.steps:
            batch = [train[(step * args.prompts + i) % len(train)] for i in range(args.prompts)]
            prompt_ids, completion_ids, infer_logprobs = gen.generate(
                [tokenizer.encode(r["prompt"]) for r in batch], num_generations=args.group
            )
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            rewards = torch.tensor(
                [
                    sort_digits.reward(t, batch[i // args.group]["answer"])
                    for i, t in enumerate(texts)
                ]
            )
            advantages = group_advantages(rewards, args.group)  # (S,)
            ids, attention, mask = token_batch(prompt_ids, completion_ids, tokenizer.pad_token_id)
            # (S, L-1): the engine's log-prob of each sampled token
            old_logprobs = torch.zeros_like(mask)
            for i, (p, lps) in enumerate(zip(prompt_ids, infer_logprobs)):
                old_logprobs[i, len(p) - 1 : len(p) - 1 + len(lps)] = torch.tensor(lps)
            for k, rows in enumerate(torch.randperm(len(ids)).chunk(args.updates)):
                logits = policy(input_ids=ids[rows], attention_mask=attention[rows]).logits[:, :-1]
                # (s, L-1)
                logprobs = torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None])[..., 0]
                # before this step's first update the engine holds the policy's weights (last sync)
                if k == 0:
                    mismatch = (
                        ((logprobs.detach() - old_logprobs[rows]).abs() * mask[rows]).max().item()
                    )
                batch = TrainBatch(
                    input_ids=ids[rows],
                    loss_mask=mask[rows],
                    old_logprobs=old_logprobs[rows],
                    advantages=advantages[rows],
                )
                loss, stats = policy_loss(logprobs, batch, PolicyLossOptions(clip_eps=0.2))
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
            sync = gen.sync_weights(policy)
            record.update(
                reward=rewards.mean().item(),
                loss=loss.item(),
                clip_fraction=stats["clip_fraction"].item(),
                logprob_mismatch=mismatch,
                sync_s=sync.seconds,
                synced_tensors=sync.tensors,
            )
        record["elapsed_s"] = time.perf_counter() - start
        history.append(record)
        print(
            json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}),
            flush=True,
        )
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
    gen.shutdown()
    return history


if __name__ == "__main__":
    main()
