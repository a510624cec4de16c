"""Online DPO (as TRL's OnlineDPOTrainer and ChatLearn's OnlineDPOEngine ship it): the algorithm,
its config section and its loop.

    chatgen train configs/online_dpo_tiny.yaml            # runtime.algorithm.name: online_dpo

Each episode: take sample_per_episode / n prompts; the policy (vLLM) samples n >= 2 responses to
each; the reward model scores them; each prompt's best and worst response make a (chosen, rejected)
pair (a prompt whose responses all tie states no preference: its pair stays in the batch with weight
0); the frozen reference gives the pairs' per-token log-probs; the trainer (Megatron) takes DPO
steps on whole pairs; the new weights are synced into vLLM; then checkpoint, eval (the policy's
held-out reward, as for GRPO) and log. docs/rlhf_engine.md has the details.
"""

import dataclasses
import time
from functools import partial

from chatgen.config import opt
from chatgen.rlhf import losses as L
from chatgen.rlhf.algorithms.dpo import pair_problems
from chatgen.rlhf.metrics import prefixed, sample_metrics
from chatgen.rlhf.run import Run
from chatgen.rlhf.schema import AlgorithmConfig, Role


@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    beta: float = opt(
        0.1,
        "DPO temperature: how far the policy may move from the reference per unit of preference "
        "(larger = stays closer)",
    )

    def check(self):
        if self.beta <= 0:
            yield "beta", f"must be > 0, got {self.beta}; 0.1 is the usual value"


MODELS = {
    "policy": Role("generation", doc="samples n >= 2 responses per prompt"),
    "policy_trainer": Role(
        "megatron", trainable=True, syncs_to="policy", doc="the policy's trainable copy"
    ),
    "reference": Role(
        "megatron",
        trainable=False,
        doc="frozen copy of the starting policy, what the log-ratios are measured against",
    ),
    "reward": Role("python", doc="ranks the responses (e.g. chatgen.rlhf.rewards:RuleReward)"),
}


def trainer_rows(cfg) -> int:
    """Rows the trainers get per episode: one (best, worst) pair per prompt."""
    policy = cfg.models.get("policy")  # (a missing policy is reported by run.check_config)
    return (
        2 * cfg.runtime.sample_per_episode // policy.config.n
        if policy
        else cfg.runtime.sample_per_episode
    )


def check(cfg):
    yield from pair_problems(cfg)
    if "policy" not in cfg.models:
        return
    n = cfg.models["policy"].config.n
    if n < 2:
        yield "models.policy.n: Online DPO pairs the best and worst of a prompt's n responses; set n >= 2"
    elif cfg.runtime.sample_per_episode % n:
        yield (
            f"runtime.sample_per_episode: {cfg.runtime.sample_per_episode} is not a multiple of policy n={n} "
            "(samples per prompt); make it one"
        )


PHASES = ["generate", "reward", "reference", "old_logprobs", "train", "sync", "checkpoint", "eval"]


def train(cfg, resume: bool = False, log=print) -> dict:
    """Run Online DPO as configured; returns the last episode's metrics. Actors are stopped
    however it ends."""
    algo, rt = cfg.runtime.algorithm, cfg.runtime
    n = cfg.models["policy"].config.n
    loss_fn = partial(L.dpo_loss_fn, beta=algo.beta)

    with Run(cfg, resume, PHASES, log, records_per_episode=rt.sample_per_episode // n) as run:
        timer, metrics = run.timer, {}
        run.evaluate_start()  # episode 0: where the policy starts
        for episode in range(run.start_episode, rt.num_episode + 1):
            start = time.perf_counter()
            with timer("generate"):
                batch = run.generate(run.next_prompts())  # S = prompts * n samples, prompt-major
            with timer("reward"):
                rewards = run.score(batch)  # (S,)
            rows, weights = L.best_worst_pairs(rewards, n)  # (2P,) best_0, worst_0, best_1, ...
            pairs = batch.select(rows)
            data = pairs.trainer_inputs().replace(pair_weights=weights)
            with timer("reference"):
                # (2P, L-1)
                data = data.replace(ref_logprobs=run.forward_tokens("reference", data))
            # not in the loss: checks that vLLM sampled with the trainer's weights
            with timer("old_logprobs"):
                old = run.forward_tokens("policy_trainer", data)
            with timer("train"):
                # shuffles whole pairs
                stats = run.train("policy_trainer", data, loss_fn, group_size=2)
            with timer("sync"):
                run.sync_policy()
            # share of prompts whose responses tie
            metrics = {
                **sample_metrics(rewards, pairs, old, rt.solved_reward),
                **prefixed("policy", stats),
                "response/length": batch.response_lengths.float().mean().item(),  # of all S samples
                "pairs/no_preference": 1 - weights[0::2].mean().item(),
            }
            run.end_episode(episode, metrics, start)  # eval, checkpoint, log
    return metrics
