# .venv/bin/python benchmarks/bench_eval_phase.py --output /tmp/bench_eval_phase.json [--rounds 6] [--evals 5] [--variants after,no_fast_step,no_fast_schedule,hf]
"""The main job's held-out evaluation (configs/grpo_tiny.yaml: 256 greedy prompts, one engine call)
against TRL's (its GRPOTrainer evaluates, in benchmarks/bench_vs_trl.py, with HF transformers'
`model.generate`, greedy, of the same left-padded token ids), and before and after the evaluation
stopped asking for log-probs: "after", "before" and "hf" alternate in one process so that the
machine's load hits them alike. Both sides load the policy's `load` (the warm start); with
POLICY_LOAD=<an HF export of a trained checkpoint> (`chatgen convert --to hf`) both load that:
the weights the main job's later evaluations run, whose answers are longer.

"before" is `evaluate_policy` as it was: the held-out items generated with their sampled tokens'
log-probs (gathered every engine step, one list per sample), which the evaluation never reads;
"after" is the shipped `evaluate_policy`: items marked "logprobs": False, so vLLM computes none.
"no_fast_step" is the shipped `evaluate_policy` with vLLM's own per-step code instead of
chatgen's exact shortcuts through it (adapter/fast_step.py); "no_fast_schedule" without only the
one through vLLM's `Scheduler.schedule`; "no_hold" with every step's output of every request
handed to vLLM's output processor (fast_step's held outputs off); "one_thread" with the engine
thread's OpenMP team at one thread instead of the cores' (two here); "torch_linear" (and
"train_torch_linear") with the small linear layers on torch's linear (MKL) instead of their
bucketed oneDNN matmul (small_linears.bucketed_small_linears; the numbers differ at float noise,
so the variant's own metrics are not compared). All give the same tokens (the script asserts the
metrics are equal). "train", "train_no_fast_step" and "train_no_fast_schedule" are a training generation
call instead (32 prompts x the policy's n samples, sampled, with log-probs), with and without the
shortcuts (their tokens are not compared: the samples differ call to call). "hf" is
`model.generate(max_new_tokens, do_sample=False)` of the warm start, what the TRL worker of
bench_vs_trl runs. Writes {"<variant>_s": [wall s per call], "cpu_s": {variant: [process CPU s
per call]}, "ratio": median after / median before, "after_over_hf", "fast_step_ratio" (after /
no_fast_step), "fast_schedule_ratio" (after / no_fast_schedule), "threads_ratio" (after /
one_thread), "hold_ratio" (after / no_hold), "onednn_ratio" (after / torch_linear),
"train_onednn_ratio", "train_fast_step_ratio" and
"train_fast_schedule_ratio" (the same of train), each also as "cpu_<ratio>" of the CPU time (the
less load-sensitive figure on a shared machine), "engine_cpu_<ratio>" (but against hf) of the
engine thread's own CPU clock (the steadiest: no other thread's waiting in it), "load": the
1-minute load average at start and end} to --output (the ratios of the variants run).
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def evaluate_before(run) -> dict:
    """evaluate_policy before the evaluation dropped log-probs (kept here for the comparison)."""
    from chatgen.rlhf.metrics import eval_metrics

    rt, index, metrics = run.cfg.runtime, list(range(len(run.eval_records))), {}
    for greedy, prefix in [(False, "eval"), (True, "eval/greedy")][: 1 + rt.eval_greedy]:
        batch = run.generate(index, is_eval=True, greedy=greedy)
        samples = len(batch) // len(index)
        rewards = run.score(batch, f"{prefix}/reward/")
        metrics.update(eval_metrics(rewards, samples, rt.solved_reward, prefix))
    return metrics


def hf_generate(cfg, prompts: list):
    """TRL's held-out evaluation as bench_vs_trl's TRL worker runs it: the policy's weights in HF
    transformers, greedy `model.generate` of the left-padded prompts, max_new_tokens and EOS as
    the policy's; returns a function that runs it once (texts decoded, as the worker does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = cfg.models["policy"].config  # the VLLMConfig the run's engine was built from
    tokenizer = AutoTokenizer.from_pretrained(policy.load)
    model = AutoModelForCausalLM.from_pretrained(policy.load, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    inputs = {
        "input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
        "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
    }

    def run() -> list:
        with torch.no_grad():
            ids = model.generate(
                **inputs,
                max_new_tokens=policy.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        return tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)

    return run


def engine_loop():
    """The in-process policy engine's loop (started by the first generation call)."""
    from chatgen.generation.vllm import engine_loop

    (loop,) = [loop for loop in engine_loop._loops.values() if not loop._stopped]
    return loop


def fast_step_switch(loop):
    """A function setting which of fast_step's shortcuts the engine's scheduler takes (a set of
    the methods they replace; each is installed on the instance: removing it leaves vLLM's own
    method)."""
    from chatgen.generation.vllm.adapter.split_step import engine_core

    scheduler = engine_core(loop.llm).scheduler
    shortcuts = {m: vars(scheduler)[m] for m in ("update_from_output", "schedule")}

    def use(methods: set) -> None:
        for method, shortcut in shortcuts.items():
            if method in methods:
                setattr(scheduler, method, shortcut)
            else:
                vars(scheduler).pop(method, None)

    return lambda methods: loop.call(lambda: use(methods))


def keep_torch_weights():
    """From here on every bucketed small layer also keeps a copy of its weight (for the
    torch_linear variants); returns a function setting which of the two each small layer runs."""
    import torch

    from chatgen.generation.vllm.adapter import small_linears
    from chatgen.generation.vllm.adapter.split_step import engine_core

    bucketed = small_linears.bucketed_onednn_linear

    def keeping(weight):
        linear = bucketed(weight)
        linear.torch_weight = weight.detach().clone()
        return linear

    small_linears.bucketed_onednn_linear = keeping

    def use(loop, torch_linear: bool) -> None:
        model = engine_core(loop.llm).model_executor.driver_worker.worker.model_runner.model

        def switch():
            for layer in model.modules():
                linear = getattr(layer, "cpu_linear", None)
                bucketed = getattr(linear, "bucketed", linear)
                if getattr(bucketed, "torch_weight", None) is None:
                    continue
                if torch_linear:
                    weight = bucketed.torch_weight
                    layer.cpu_linear = lambda x, _w, bias, weight=weight: (
                        torch.nn.functional.linear(x, weight, bias)
                    )
                    layer.cpu_linear.bucketed = bucketed
                else:
                    layer.cpu_linear = bucketed

        loop.call(switch)

    return use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--evals", type=int, default=5, help="evaluations per round and variant")
    parser.add_argument(
        "--variants",
        default="after,before,hf",
        help="comma-separated: after, before, no_fast_step, no_fast_schedule, no_hold, one_thread, "
        "torch_linear, train_torch_linear, "
        "train, train_no_fast_step, train_no_fast_schedule, hf",
    )
    args = parser.parse_args()

    import torch

    from chatgen.cli.config import checked_run_config
    from chatgen.generation.vllm.adapter.split_step import engine_core
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.run import Run, evaluate_policy

    out_dir = tempfile.mkdtemp(prefix="bench_eval_phase_")
    cfg, _ = checked_run_config(
        "configs/grpo_tiny.yaml",
        [f"runtime.output_dir={out_dir}/run", "runtime.save_episode_interval=null"],
    )
    times = {name: [] for name in args.variants.split(",")}
    cpu = {name: [] for name in times}
    engine_cpu = {name: [] for name in times}  # the engine thread's own CPU clock
    results = {}
    load = [os.getloadavg()[0]]
    torch_linear = keep_torch_weights() if any(n.endswith("torch_linear") for n in times) else None
    try:
        with Run(cfg, False, grpo.PHASES, print, records_per_episode=32) as run:
            hf = hf_generate(cfg, [item["input_ids"] for item in run.data.eval_items])
            run.evaluate()  # warm-up
            hf()
            loop = engine_loop()
            fast_step = fast_step_switch(loop)
            scheduler = engine_core(loop.llm).scheduler
            threads = loop.call(torch.get_num_threads)  # the engine thread's OpenMP team
            for _ in range(args.rounds):
                for name in times:
                    run._evaluate = evaluate_before if name == "before" else evaluate_policy
                    fast_step(
                        set()
                        if name.endswith("no_fast_step")
                        else {"update_from_output"}
                        if name.endswith("no_fast_schedule")
                        else {"update_from_output", "schedule"}
                    )
                    # torch._C's: vLLM's CPU worker replaces torch.set_num_threads by a no-op
                    team = 1 if name == "one_thread" else threads
                    scheduler.chatgen_hold_outputs = name != "no_hold"  # for requests added now
                    if torch_linear is not None:
                        torch_linear(loop, name.endswith("torch_linear"))
                    loop.call(functools.partial(torch._C.set_num_threads, team))
                    for _ in range(args.evals):
                        start_engine = loop.call(time.thread_time)
                        start, start_cpu = time.perf_counter(), time.process_time()
                        if name == "hf":
                            hf()
                        elif name.startswith("train"):
                            run.generate(list(range(32)))
                        else:
                            results[name] = run.evaluate()
                        times[name].append(time.perf_counter() - start)
                        cpu[name].append(time.process_time() - start_cpu)
                        engine_cpu[name].append(loop.call(time.thread_time) - start_engine)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    load.append(os.getloadavg()[0])
    # same tokens, scored (torch's linear differs from oneDNN's at float noise: not compared)
    assert all(r == results["after"] for n, r in results.items() if n != "torch_linear"), results
    median = {name: statistics.median(values) for name, values in times.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    median_engine = {name: statistics.median(values) for name, values in engine_cpu.items()}
    report = {
        **{f"{name}_s": values for name, values in times.items()},
        "cpu_s": cpu,
        **{f"median_{name}_s": value for name, value in median.items()},
        "median_cpu_s": median_cpu,
        "engine_cpu_s": engine_cpu,
        "median_engine_cpu_s": median_engine,
        "load": load,
        "cpus": os.cpu_count(),
    }
    for key, one, other in (
        ("ratio", "after", "before"),
        ("after_over_hf", "after", "hf"),
        ("fast_step_ratio", "after", "no_fast_step"),
        ("fast_schedule_ratio", "after", "no_fast_schedule"),
        ("threads_ratio", "after", "one_thread"),
        ("hold_ratio", "after", "no_hold"),
        ("onednn_ratio", "after", "torch_linear"),
        ("train_onednn_ratio", "train", "train_torch_linear"),
        ("train_fast_step_ratio", "train", "train_no_fast_step"),
        ("train_fast_schedule_ratio", "train", "train_no_fast_schedule"),
    ):
        if one in median and other in median:
            report[key] = median[one] / median[other]
            report[f"cpu_{key}"] = median_cpu[one] / median_cpu[other]
            if "hf" not in (one, other):  # HF's generate runs on the main thread
                report[f"engine_cpu_{key}"] = median_engine[one] / median_engine[other]
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_s")}, indent=1))
    print(
        "median per evaluation, wall s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in median.items())
        + "; CPU s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in median_cpu.items())
        + "; engine thread CPU s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in median_engine.items() if k != "hf")
    )
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
