# .venv/bin/python benchmarks/bench_async.py --output outputs/bench_async.json
"""Synchronous vs one-step overlap vs asynchronous GRPO (k = 2, with and without a handover), alternating.

The async modes: max_staleness: 2 (async2), and the same with handover_step: 4 (async2_handover).

Each case runs the four modes in turn, --runs rounds of them (so machine noise hits all alike), on the tiny
sort-digits task with a warm-started tiny Llama (--model, or a quick SFT warm start made here):
- `tiny`: configs/grpo_tiny.yaml's policy (up to 16 new tokens, stop at EOS).
- `longtail`: one prompt in 8 asks to sort 40-48 digits instead of 3-6, and its samples generate to the
  112-token limit (`LongTailPolicy`: min_tokens for long prompts; the others stop at EOS near 10 tokens,
  so ~10x shorter): the straggler case, where partial rollouts pay most.
Every mode: one optimizer step per episode, old_logprobs: recompute with importance_sampling_cap 2.0
(the same loss for all three; the async run's correction is then decoupled PPO), held-out evaluation every
--eval-every episodes on the training prompts.

Per run: median time/episode over episodes >= 2, wall time of the episodes, trainer idle fraction (the
share of the episode the trainer waited for samples: time/generate / time/episode for sync and overlap,
async/trainer_idle_fraction for async), engine idle fraction (sync: 1 - time/generate / time/episode; async:
async/engine_idle_fraction; overlap: not measured), async staleness figures, the held-out reward after equal
steps (the last evaluation) and after equal wall time (the last evaluation each run had reached when the
fastest of its round finished). Ratios: async / overlap and async / sync time per episode.

Everything runs in one process (runtime.launcher: local) on this machine's CPU cores, which generation and
training share: read the figures with the load average written beside them (docs/async_rl.md says why
async cannot win much here). A smoke run: --runs 1 --episodes 3 --cases tiny.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_generation import tiny_model  # noqa: E402

MODES = {
    "sync": {},
    "overlap": {"runtime.algorithm.overlap_generation": True},
    "async2": {"runtime.algorithm.max_staleness": 2},
    # the batches ahead wait for the next weights after 4 engine steps (docs/async_rl.md)
    "async2_handover": {"runtime.algorithm.max_staleness": 2, "runtime.algorithm.handover_step": 4},
}


def warm_model(base: Path, work: Path, steps: int) -> Path:
    """A few plain-torch SFT steps so that the tiny model writes digits (rewards then vary)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatgen import tasks
    from chatgen.core.jsonl import read_prompt_records
    from examples.sft_warm_start import sft_batch

    tasks.write_task_data(str(work / "sft"), n_train=64, n_eval=8)
    records = read_prompt_records(work / "sft" / "sft.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        b = sft_batch(tokenizer, [records[(step * 32 + i) % len(records)] for i in range(32)])
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        loss = -(logprobs * b["loss_mask"]).sum() / b["loss_mask"].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = work / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def long_tail_policy():
    """The policy class of the longtail case (made on first use: importing vLLM is slow)."""
    from chatgen import VLLMModule

    class LongTailPolicy(VLLMModule):
        """Samples of a long prompt (over LONG_PROMPT tokens) generate to the token limit."""

        def _add_request(self, data, is_eval=False):
            request_ids = []
            for item in data:
                params = self.sampling_params(
                    len(item["input_ids"]), is_eval=is_eval, greedy=item.get("greedy", False)
                )
                if len(item["input_ids"]) > LONG_PROMPT:
                    params.min_tokens = params.max_tokens
                request_ids.append(
                    self.add_request(item["input_ids"], params, prompt_text=item.get("prompt"))
                )
            return request_ids

    return LongTailPolicy


LONG_PROMPT = 40  # tokens: the 40-48-digit prompts are over it, the 3-6-digit ones far below


def __getattr__(name):  # `bench_async:LongTailPolicy`, as the policy's model_class imports it
    if name == "LongTailPolicy":
        return long_tail_policy()
    raise AttributeError(name)


def write_data(work: Path, prompts: int) -> dict:
    """{case: data directory}: the tiny task's prompts; for longtail one prompt in 8 with 40-48 digits."""
    from chatgen import tasks

    tasks.write_task_data(str(work / "tiny"), n_train=prompts, n_eval=8)
    long = max(1, prompts // 8)
    tasks.write_task_data(str(work / "short"), n_train=prompts - long, n_eval=8)
    tasks.write_task_data(str(work / "long"), n_train=long, n_eval=8, min_digits=40, max_digits=48)
    (work / "longtail").mkdir()
    (work / "longtail" / "train.jsonl").write_text(
        (work / "short" / "train.jsonl").read_text() + (work / "long" / "train.jsonl").read_text()
    )
    return {"tiny": work / "tiny", "longtail": work / "longtail"}


def case_overrides(case: str) -> dict:
    if case == "longtail":
        return {
            "models.policy.model_class": "bench_async:LongTailPolicy",
            "policy.max_new_tokens": 112,
            "policy.seq_length": 256,
            "policy_trainer.seq_length": 256,
        }
    return {}


def one_run(model: Path, data: Path, out: Path, episodes: int, extra: dict, args) -> dict:
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    samples = args.prompts * 4
    items = {
        "runtime.data_path": f"{data}/train.jsonl",
        "runtime.eval_data_path": f"{data}/train.jsonl",
        "runtime.output_dir": str(out),
        "runtime.num_episode": episodes,
        "runtime.sample_per_episode": samples,
        "runtime.train_micro_batch_size": samples,
        "runtime.train_global_batch_size": samples,
        "runtime.eval_episode_interval": args.eval_every,
        "runtime.save_episode_interval": "null",
        "runtime.algorithm.old_logprobs": "recompute",
        "runtime.algorithm.importance_sampling_cap": 2.0,
        "policy.load": model,
        "policy.n": 4,
        "policy_trainer.load": model,
        **extra,
    }
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [f"{k}={v}" for k, v in items.items()])
    grpo.train(cfg, log=lambda *_: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["episode"] >= 1]
    elapsed, curve = 0.0, []
    for r in records:
        elapsed += r.get("time/episode", 0.0)
        if "eval/reward" in r:
            curve.append((elapsed, r["eval/reward"]))

    def mean(key):
        values = [r[key] for r in timed if key in r]
        return statistics.mean(values) if values else None

    generate_share = statistics.mean(r.get("time/generate", 0.0) / r["time/episode"] for r in timed)
    result = {
        "median_episode_s": statistics.median(
            r["time/episode"] for r in timed if r["episode"] >= 2
        ),
        "wall_s": elapsed,
        "eval_curve": curve,
        "response_length_mean": mean("response/length"),
        "trainer_idle_fraction": mean("async/trainer_idle_fraction")
        if "async/trainer_idle_fraction" in timed[-1]
        else generate_share,
        "engine_idle_fraction": mean("async/engine_idle_fraction")
        if "async/engine_idle_fraction" in timed[-1]
        else (1 - generate_share if "overlap_generation" not in str(extra) else None),
    }
    for key in ("async/staleness_mean", "async/staleness_max", "async/samples_spanning_versions"):
        if key in timed[-1]:
            result[key] = mean(key)
    return result


def reward_at(curve: list, seconds: float) -> float:
    """The last evaluation reached within `seconds` of the run's episodes."""
    reached = [reward for elapsed, reward in curve if elapsed <= seconds + 1e-9]
    return reached[-1] if reached else curve[0][1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--output", required=True, help="JSON file to write")
    parser.add_argument("--model", help="a warm-started HF model (default: made here)")
    parser.add_argument("--runs", type=int, default=2, help="rounds of the three modes, per case")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per episode (x4 samples)")
    parser.add_argument("--cases", default="tiny,longtail")
    parser.add_argument("--warm-steps", type=int, default=100)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    model = (
        Path(args.model)
        if args.model
        else warm_model(tiny_model(REPO / "outputs" / "bench-tiny-llama"), work, args.warm_steps)
    )
    data = write_data(work, args.prompts)
    result = {"args": vars(args), "cases": {}}
    for case in args.cases.split(","):
        load_before, runs = os.getloadavg(), {mode: [] for mode in MODES}
        for round_ in range(args.runs):
            for mode, extra in MODES.items():
                out = work / f"{case}_{mode}_{round_}"
                run = one_run(
                    model, data[case], out, args.episodes, {**extra, **case_overrides(case)}, args
                )
                runs[mode].append(run)
                print(
                    f"{case} round {round_} {mode}: {run['median_episode_s']:.2f} s/episode, "
                    f"eval {run['eval_curve'][-1][1]:.3f}, trainer idle "
                    f"{run['trainer_idle_fraction']:.2f}",
                    flush=True,
                )
            fastest = min(runs[m][-1]["wall_s"] for m in MODES)
            for mode in MODES:
                runs[mode][-1]["eval_at_equal_wall"] = reward_at(
                    runs[mode][-1]["eval_curve"], fastest
                )
        median = {
            mode: statistics.median(r["median_episode_s"] for r in runs[mode]) for mode in MODES
        }
        result["cases"][case] = {
            "runs": runs,
            "median_episode_s": median,
            "async_over_overlap": median["async2"] / median["overlap"],
            "async_over_sync": median["async2"] / median["sync"],
            "handover_over_overlap": median["async2_handover"] / median["overlap"],
            "eval_equal_steps": {
                m: statistics.mean(r["eval_curve"][-1][1] for r in runs[m]) for m in MODES
            },
            "eval_equal_wall": {
                m: statistics.mean(r["eval_at_equal_wall"] for r in runs[m]) for m in MODES
            },
            "loadavg_before_after": [load_before, os.getloadavg()],
        }
        c = result["cases"][case]
        print(
            f"{case}: s/episode {json.dumps({m: round(v, 3) for m, v in median.items()})}; async/overlap "
            f"{c['async_over_overlap']:.2f}, async/sync {c['async_over_sync']:.2f}; eval (equal steps) "
            f"{json.dumps({m: round(v, 3) for m, v in c['eval_equal_steps'].items()})}; eval (equal "
            f"wall) {json.dumps({m: round(v, 3) for m, v in c['eval_equal_wall'].items()})}; load "
            f"{c['loadavg_before_after']}",
            flush=True,
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
