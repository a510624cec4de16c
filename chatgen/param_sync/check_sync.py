"""`chatgen check-sync`: prove that a weight sync leaves vLLM computing exactly what the trainer computes.

    chatgen check-sync --hf-checkpoint outputs/tiny-llama --train-tp 2 --train-pp 1 --infer-tp 1 \\
        --input prompts.jsonl --output check.json --max-new-tokens 16
    chatgen check-sync --hf-checkpoint outputs/tiny-qwen3-moe --train-ep 2 --input prompts.jsonl --output check.json

Loads the checkpoint into Megatron with the training layout (TP x PP ranks), starts a vLLM engine with
the inference TP and *random* weights (load_format=dummy), syncs the trainer's weights into it, generates
greedily for each `{"prompt_ids": [...]}` line of IN.jsonl, and scores the generated tokens with the
trainer. Writes {"samples": [{"prompt_ids", "output_ids", "vllm_logprobs", "trainer_logprobs"}],
"max_abs_logprob_diff", "sync_seconds", ...} and exits 1 when the diff is above --threshold. For a
mixture-of-experts model it also reads every expert weight back from the engine (vLLM's fused layout) and
reports its largest difference from the checkpoint, per HF name ("expert_weight_max_abs_diff"; the sync is
exact, so any difference fails the check).

A one-rank trainer with --infer-tp 1 runs colocated in this process; any other layout runs the trainer
ranks as child processes that stream to the engine in this process over torch.distributed (the
cross-process path of chatgen.param_sync). docs/check_sync.md explains the output.
"""
import json
import os
import sys
import time
from pathlib import Path

from chatgen.cli import positive_int
from chatgen.jsonl import is_token_ids, read_records


def add_arguments(p):
    p.add_argument("--hf-checkpoint", required=True, help="HF model directory (a family of chatgen/models)")
    p.add_argument("--train-tp", type=positive_int, default=1, help="trainer tensor-parallel size")
    p.add_argument("--train-pp", type=positive_int, default=1, help="trainer pipeline-parallel size")
    p.add_argument("--train-ep", type=positive_int, default=1, help="trainer expert-parallel size (MoE models)")
    p.add_argument("--infer-tp", type=positive_int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--input", required=True, help='JSONL of {"prompt_ids": [...]} lines')
    p.add_argument("--output", required=True, help="where to write the JSON report")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--threshold", type=float, default=1e-4, help="max |vLLM - trainer| log-prob allowed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bucket-mb", type=float, default=256, help="sync bucket size in MiB")
    p.add_argument("--validate", action="store_true", help="also compare every synced tensor bit for bit")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM KV cache size (CPU)")


def read_prompts(path) -> list:
    """The `prompt_ids` of each line of a JSONL file, or a ValueError naming the bad line."""
    def check(record):
        return None if is_token_ids(record.get("prompt_ids")) else 'needs "prompt_ids": a non-empty list of token ids'

    return [r["prompt_ids"] for r in read_records(path, check, "prompts")]


def max_abs_diff(a: list, b: list, worst: float = 0.0) -> float:
    """Largest |a_i - b_i| (and `worst`); NaN when any side is NaN, which then fails every threshold.
    (Python's max() would keep 0.0 over a NaN: a sync that wrote NaN weights must not pass.)"""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    if len(a) != len(b) or any(d != d for d in diffs):  # NaN != NaN
        return float("nan")
    return max([worst, *diffs])


def _trainer_config(args) -> dict:
    return dict(load=args.hf_checkpoint, tensor_model_parallel_size=args.train_tp,
                pipeline_model_parallel_size=args.train_pp, expert_model_parallel_size=args.train_ep, dtype=args.dtype)


def _score(trainer, sequences) -> list:
    """Trainer log-probs of each sequence's generated tokens: [(prompt, output) -> [float] * len(output)]."""
    import torch

    out = []
    for prompt, output in sequences:
        lp = trainer.forward_tokens({"input_ids": torch.tensor([prompt + output])})[0]
        out.append(lp[len(prompt) - 1:].tolist())
    return out


def _trainer_rank(config, port, bucket_bytes, validate, to_trainer, from_trainer):
    """A trainer rank of the cross-process check: sync, then score what the engine generated."""
    import torch.distributed as dist

    from chatgen.param_sync import SyncSender, sync_weights
    from chatgen.training.megatron_module import MegatronModule

    trainer = MegatronModule(config).start()
    sync_weights(trainer, SyncSender("127.0.0.1", port), bucket_bytes=bucket_bytes, validate=validate)
    box = [to_trainer.get() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    scores = _score(trainer, box[0])
    if dist.get_rank() == 0:
        from_trainer.put(scores)
    return None


def _engine(args):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from chatgen.generation import vllm_adapter

    kwargs = dict(load_format="dummy", enforce_eager=True, skip_tokenizer_init=True, dtype=args.dtype, seed=0,
                  tensor_parallel_size=args.infer_tp)
    import torch

    if not torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.infer_tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.infer_tp)))
    return vllm_adapter.build_llm(args.hf_checkpoint, **kwargs)


def _generate(llm, prompts, max_new_tokens):
    from chatgen.generation.vllm_adapter import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def check_sync(args) -> dict:
    if not (Path(args.hf_checkpoint) / "config.json").exists():
        raise ValueError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there; point it at an HF model "
                         "directory (e.g. one from `chatgen make-tiny-model`)")
    from chatgen import models
    from chatgen.models import layout

    spec = models.spec_from_hf_config(json.loads((Path(args.hf_checkpoint) / "config.json").read_text()))
    layout.check_layout(spec, args.train_tp, args.train_pp, args.train_ep)  # here, once: not in every rank's traceback
    from chatgen.generation import vllm_adapter

    prompts = read_prompts(args.input)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    config = _trainer_config(args)
    world = args.train_tp * args.train_pp * args.train_ep
    if world == 1 and args.infer_tp == 1:
        mode = "colocated"
        from chatgen.param_sync import sync_weights
        from chatgen.training.megatron_module import MegatronModule

        trainer = MegatronModule(config).start()
        llm = _engine(args)
        try:
            report = sync_weights(trainer, llm, bucket_bytes=bucket_bytes, validate=args.validate)
            experts = expert_weight_diffs(llm, spec, args.hf_checkpoint)
            generated = _generate(llm, prompts, args.max_new_tokens)
            scores = _score(trainer, [(p, g[0]) for p, g in zip(prompts, generated)])
        finally:
            vllm_adapter.shutdown(llm)
    else:
        mode = "cross-process"
        from chatgen.param_sync import SyncReceiver
        from chatgen.training.launcher import DistributedJob, ctx_queue

        llm = _engine(args)
        rx = SyncReceiver()
        to_trainer, from_trainer = ctx_queue(), ctx_queue()
        job = DistributedJob(_trainer_rank, world, args=(config, rx.port, bucket_bytes, args.validate, to_trainer,
                                                         from_trainer))
        try:
            report = rx.receive_into(llm, alive=job.poll)
            experts = expert_weight_diffs(llm, spec, args.hf_checkpoint)
            generated = _generate(llm, prompts, args.max_new_tokens)
            to_trainer.put([(p, g[0]) for p, g in zip(prompts, generated)])
            scores = from_trainer.get(timeout=600)
            job.join()
        finally:
            job.stop()
            vllm_adapter.shutdown(llm)
    samples, worst = [], 0.0
    for prompt, (output, vllm_lp), trainer_lp in zip(prompts, generated, scores):
        worst = max_abs_diff(vllm_lp, trainer_lp, worst)
        samples.append(dict(prompt_ids=prompt, output_ids=output, vllm_logprobs=vllm_lp, trainer_logprobs=trainer_lp))
    result = dict(samples=samples, max_abs_logprob_diff=worst, sync_seconds=report.seconds, sync_bytes=report.bytes,
                  sync_bytes_per_s=report.bytes_per_s, sync_tensors=report.tensors, sync_buckets=report.buckets,
                  validated=report.validated, mode=mode, train_tp=args.train_tp, train_pp=args.train_pp,
                  train_ep=args.train_ep, infer_tp=args.infer_tp, dtype=args.dtype, threshold=args.threshold)
    if experts:
        worst_expert = float("nan") if any(d != d for d in experts.values()) else max(experts.values())  # NaN fails
        result.update(expert_weight_max_abs_diff=experts, max_abs_expert_weight_diff=worst_expert)
    return result


def expert_weight_diffs(llm, spec, hf_checkpoint) -> dict:
    """{HF name of an expert weight: max |engine - checkpoint|} over every expert of every MoE layer ({} for a dense
    model): the engine's fused weights (w13 = [gate; up], w2 = down per expert) read back and split by the layout
    kind of the family's mapping, against the checkpoint cast to the engine's dtype. What the sync wrote, exactly."""
    from chatgen.checkpoint_io import read_hf_safetensors
    from chatgen.generation import vllm_adapter
    from chatgen.models import layout

    if not spec.is_moe:
        return {}
    params = [sp for sp in layout.stage_params(spec, 1, 0) if sp.expert is not None]
    ckpt = read_hf_safetensors(hf_checkpoint, spec.tie_word_embeddings, names={n for sp in params for n in sp.hf_names})
    per_layer = len(params) // spec.num_layers  # a layer's expert weights, in layer order
    out = {}
    for layer, (w13, w2) in enumerate(vllm_adapter.expert_weights(llm)):
        for sp in params[layer * per_layer:(layer + 1) * per_layer]:
            held = w13[sp.expert].chunk(2) if sp.kind == "gate_up" else (w2[sp.expert],)
            for name, engine in zip(sp.hf_names, held):
                out[name] = float((engine.double() - ckpt[name].to(engine.dtype).double()).abs().max())
    return out


def run(args) -> int:
    start = time.perf_counter()
    result = check_sync(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    ok = result["max_abs_logprob_diff"] <= args.threshold and result.get("max_abs_expert_weight_diff", 0.0) == 0.0
    print(f"check-sync {result['mode']} train TP={args.train_tp} PP={args.train_pp}"
          + (f" EP={args.train_ep}" if args.train_ep > 1 else "") + f" -> infer TP={args.infer_tp}: "
          f"max |dlogprob| {result['max_abs_logprob_diff']:.3g} (threshold {args.threshold:g}), "
          f"sync {result['sync_seconds'] * 1e3:.1f} ms for {result['sync_bytes'] / 1e6:.1f} MB, "
          + (f"max |dweight| over {len(result['expert_weight_max_abs_diff'])} expert weights "
             f"{result['max_abs_expert_weight_diff']:.3g}, " if "max_abs_expert_weight_diff" in result else "")
          + f"{len(result['samples'])} samples, {time.perf_counter() - start:.1f} s total -> {out}: "
          f"{'OK' if ok else 'FAILED'}", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1
