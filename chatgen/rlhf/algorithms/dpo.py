"""DPO (Direct Preference Optimization, Rafailov et al. 2023), offline: the algorithm, its config
section, its loop.

    chatgen train configs/dpo_tiny.yaml            # runtime.algorithm.name: dpo

The data are preference pairs, runtime.data_path / eval_data_path JSONL lines {"prompt", "chosen",
"rejected"}. Each episode: take sample_per_episode / 2 pairs; tokenize them in the driver into
trainer rows [chosen_0, rejected_0, chosen_1, ...] (BOS + prompt + response + EOS, the loss on
response + EOS, as the SFT warm start builds them); the frozen reference gives each row's per-token
log-probs; the trainer (Megatron) takes DPO steps on whole pairs: -log sigmoid(beta * ((log pi - log
ref)(chosen) - (log pi - log ref)(rejected))). Held-out: preference accuracy (how often the chosen
response's log-ratio is the larger) and reward margin on the eval pairs. No generation, no reward
model, no weight sync. docs/rlhf_engine.md has the details.
"""

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Optional

from chatgen.config import opt
from chatgen.core.jsonl import read_records
from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.rlhf import losses as L
from chatgen.rlhf.metrics import prefixed
from chatgen.rlhf.run import Run
from chatgen.rlhf.schema import AlgorithmConfig, Role

FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    beta: float = opt(
        0.1,
        "DPO temperature: how far the policy may move from the reference per unit of preference "
        "(larger = stays closer)",
    )
    tokenizer: Optional[str] = opt(
        None,
        "tokenizer directory the pairs are tokenized with; null = policy_trainer's "
        "`load` directory",
        path=True,
    )

    def check(self):
        if self.beta <= 0:
            yield "beta", f"must be > 0, got {self.beta}; 0.1 is the usual value"


MODELS = {
    "policy_trainer": Role("megatron", trainable=True, doc="the policy being trained"),
    "reference": Role(
        "megatron",
        trainable=False,
        doc="frozen copy of the starting policy, what the log-ratios are measured against",
    ),
}


def pair_problems(cfg):
    """For algorithms whose trainer rows come in (chosen, rejected) pairs: a micro-batch (the
    runtime's; a trainer takes it) must hold whole pairs; whole micro-batches then also make
    whole global batches and DP shards."""
    micro = cfg.runtime.train_micro_batch_size
    if micro % 2:
        yield (
            f"runtime.train_micro_batch_size: {micro} would split a (chosen, rejected) pair across micro-batches; "
            "make it even"
        )


def record_problem(record: dict):
    """None, or what a preference record lacks."""
    missing = [key for key in FIELDS if not isinstance(record.get(key), str)]
    if missing:
        return (
            f"needs string fields {', '.join(map(repr, missing))}; a DPO record is "
            '{"prompt": ..., "chosen": ..., "rejected": ...}'
        )
    return None


def check(cfg):
    yield from pair_problems(cfg)
    trainer = cfg.models.get("policy_trainer")
    if (
        not cfg.runtime.algorithm.tokenizer
        and trainer is not None
        and trainer.config is not None
        and not trainer.config.load
    ):
        yield (
            "runtime.algorithm.tokenizer: the pairs need a tokenizer and policy_trainer has no `load` directory "
            "to take it from; set tokenizer to a Hugging Face tokenizer directory"
        )
    for key in ("data_path", "eval_data_path"):
        path = getattr(cfg.runtime, key)
        if path and Path(path).is_file():  # run.check_config reports a missing file
            try:
                read_records(path, record_problem, "preference pairs")
            except ValueError as e:
                yield f"runtime.{key}: {e}"


def pair_batch(tokenizer, records: list):
    """Trainer rows of preference records: a chatgen.core.rollout.RolloutBatch of 2 x
    len(records) rows, row 2k the k-th record's prompt + chosen, row 2k + 1 its prompt +
    rejected. Each row is BOS + prompt + response + EOS (the tokenizer adds BOS to the prompt as
    it does for generation), loss_mask 1 on the response and EOS."""
    samples = []
    for k, record in enumerate(records):
        prompt = tokenizer.encode(record["prompt"])
        for key in ("chosen", "rejected"):
            response = tokenizer.encode(record[key], add_special_tokens=False) + [
                tokenizer.eos_token_id
            ]
            # no engine sampled these tokens: their inference log-probs are 0 (unused)
            samples.append(
                Sample(prompt, response, [0.0] * len(response), prompt_index=k, text=record[key])
            )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return RolloutBatch.from_samples(samples, pad)


class PreferenceEval:
    """The held-out evaluation (Run's `evaluate=`): preference accuracy and reward margin of the
    policy on the eval pairs. The pairs and their reference log-probs are computed once (the
    reference is frozen); each evaluation runs the policy over them, in chunks of an episode's
    pairs (a size every model's batch split accepts), the last chunk filled up with copies of its
    first pair that are left out of the figures."""

    def __init__(self, tokenizer, pairs_per_call: int, beta: float):
        self.tokenizer, self.pairs_per_call, self.beta = tokenizer, pairs_per_call, beta
        self.chunks = None  # [(trainer inputs, reference log-probs, real pairs)]

    def __call__(self, run) -> dict:
        import torch

        if self.chunks is None:
            self.chunks = []
            records, size = run.eval_records, self.pairs_per_call
            for start in range(0, len(records), size):
                chunk = records[start : start + size]
                inputs = pair_batch(
                    self.tokenizer, chunk + [chunk[0]] * (size - len(chunk))
                ).trainer_inputs()
                self.chunks.append((inputs, run.forward_tokens("reference", inputs), len(chunk)))
        chosen, rejected = [], []
        for inputs, ref, real in self.chunks:
            c, r = L.pair_logratios(
                run.forward_tokens("policy_trainer", inputs), ref, inputs.loss_mask
            )
            chosen.append(c[:real])
            rejected.append(r[:real])
        loss, stats = L.dpo_loss(torch.cat(chosen), torch.cat(rejected), self.beta)
        return {
            "eval/preference_accuracy": stats["accuracy"].item(),
            "eval/reward_margin": stats["margin"].item(),
            "eval/loss": loss.item(),
        }


PHASES = ["reference", "train", "checkpoint", "eval"]


def train(cfg, resume: bool = False, log=print) -> dict:
    """Run DPO as configured; returns the last episode's metrics. Actors are stopped however it
    ends."""
    from transformers import AutoTokenizer

    algo, rt = cfg.runtime.algorithm, cfg.runtime
    tokenizer = AutoTokenizer.from_pretrained(
        algo.tokenizer or cfg.models["policy_trainer"].config.load
    )
    loss_fn = partial(L.dpo_loss_fn, beta=algo.beta)
    pairs = rt.sample_per_episode // 2

    with Run(
        cfg,
        resume,
        PHASES,
        log,
        records_per_episode=pairs,
        evaluate=PreferenceEval(tokenizer, pairs, algo.beta),
    ) as run:
        timer, metrics = run.timer, {}
        run.evaluate_start()  # episode 0: the policy is the reference, accuracy 0.5
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            batch = pair_batch(tokenizer, [run.records[i] for i in run.next_prompts()])
            data = batch.trainer_inputs()  # (2P, L) rows: chosen_0, rejected_0, chosen_1, ...
            with timer("reference"):
                data = data.replace(ref_logprobs=run.forward_tokens("reference", data))
            with timer("train"):
                # shuffles whole pairs
                stats = run.train("policy_trainer", data, loss_fn, group_size=2)
            metrics = {
                **prefixed("policy", stats),
                "response/length": batch.response_lengths.float().mean().item(),
            }
            run.end_episode(episode, metrics, start)  # eval, checkpoint, log
    return metrics
