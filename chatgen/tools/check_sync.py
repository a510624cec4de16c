"""`chatgen check-sync`: prove that a weight sync leaves a generation engine computing exactly what the trainer
computes.

    chatgen check-sync --hf-checkpoint outputs/tiny-llama --train-tp 2 --train-pp 1 --infer-tp 1 \\
        --input prompts.jsonl --output check.json --max-new-tokens 16 [--backend vllm|hf]
    chatgen check-sync --hf-checkpoint outputs/tiny-qwen3-moe --train-ep 2 --input prompts.jsonl --output check.json
    chatgen check-sync --trainer-backend fsdp --train-dp 2 --hf-checkpoint DIR --input prompts.jsonl --output check.json

Loads the checkpoint into Megatron with the training layout (TP x PP ranks; or, --trainer-backend
fsdp, into transformers' model sharded by FSDP2 over --train-dp ranks: any family transformers has),
starts a generation engine (a backend of chatgen.generation: vLLM by default; `hf`, transformers,
the reference) with the inference TP and *random* weights (load_format: dummy), syncs the trainer's
weights into it, generates greedily for each `{"prompt_ids": [...]}` line of IN.jsonl, and scores
the generated tokens with the trainer. Writes {"samples": [{"prompt_ids", "output_ids",
"engine_logprobs", "trainer_logprobs"}], "max_abs_logprob_diff", "sync_seconds" (the trainer's send,
from its first collective to the engine's receipt), "trainer_start_seconds" (cross-process: what the
engine waited for the trainer ranks to start, before the sync), ...} and exits 1 when the diff is
above --threshold. For a mixture-of-experts model on the vllm backend it also reads every expert
weight back from the engine (vLLM's fused layout) and reports its largest difference from the
checkpoint, per HF name ("expert_weight_max_abs_diff"; the sync is exact, so any difference fails
the check).

A one-rank trainer with --infer-tp 1 runs colocated in this process; any other layout runs the
trainer ranks as child processes that stream to the engine in this process over torch.distributed
(the cross-process path of chatgen.param_sync). docs/check_sync.md explains the output.
"""

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from chatgen import models
from chatgen.core.checkpoint_io import read_hf_safetensors
from chatgen.core.imports import import_class
from chatgen.core.jsonl import is_token_ids, read_records
from chatgen.generation.base import load_backend
from chatgen.generation.batching import iter_samples, sample_logprobs
from chatgen.generation.config import check_prompt_ids
from chatgen.models import layout
from chatgen.param_sync import GroupReceiver, GroupSender, sync_adapter, sync_weights
from chatgen.training import fsdp_lora, lora
from chatgen.training.config import hf_family_problem
from chatgen.training.fsdp_module import FSDPModule
from chatgen.training.launcher import DistributedJob, ctx_queue
from chatgen.training.megatron_module import MegatronModule


def read_prompts(path, vocab_size: int) -> list:
    """The `prompt_ids` of each line of a JSONL file, or a ValueError naming the bad line (also
    an id outside the model's vocabulary [0, vocab_size): the embedding lookup would fail deep in
    the engine or the trainer)."""

    def check(record):
        if not is_token_ids(record.get("prompt_ids")):
            return 'needs "prompt_ids": a non-empty list of token ids'
        try:
            check_prompt_ids(record["prompt_ids"], vocab_size, '"prompt_ids"')
        except ValueError as e:
            return str(e)
        return None

    return [r["prompt_ids"] for r in read_records(path, check, "prompts")]


def max_abs_diff(a: list, b: list, worst: float = 0.0) -> float:
    """Largest |a_i - b_i| (and `worst`); NaN when any side is NaN, which then fails every
    threshold. (Python's max() would keep 0.0 over a NaN: a sync that wrote NaN weights must not
    pass.)"""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    if len(a) != len(b) or any(d != d for d in diffs):  # NaN != NaN
        return float("nan")
    return max([worst, *diffs])


def _trainer_config(args) -> dict:
    # the trainer renormalises over the engine's top-k / top-p set, as an RLHF run's does
    truncation = dict(logits_top_k=args.top_k or None, logits_top_p=args.top_p)
    lora = dict(lora=dict(rank=args.lora, alpha=2.0 * args.lora)) if args.lora else {}
    if args.trainer_backend == "fsdp":
        return dict(load=args.hf_checkpoint, dtype=args.dtype, **truncation, **lora)
    return dict(
        **truncation,
        load=args.hf_checkpoint,
        tensor_model_parallel_size=args.train_tp,
        pipeline_model_parallel_size=args.train_pp,
        expert_model_parallel_size=args.train_ep,
        dtype=args.dtype,
        **lora,
    )


def _score(trainer, sequences) -> list:
    """Trainer log-probs of each sequence's generated tokens: [(prompt, output) -> [float] *
    len(output)]."""
    out = []
    for prompt, output in sequences:
        lp = trainer.forward_tokens({"input_ids": torch.tensor([prompt + output])})[0]
        out.append(lp[len(prompt) - 1 :].tolist())
    return out


def _start_trainer(config, temperature: float, backend: str = "megatron"):
    """The trainer (MegatronModule, or FSDPModule for backend fsdp), scoring logits / temperature
    when the engine samples at one (as an RLHF run's trainer does)."""
    if temperature > 0:
        config = {**config, "logits_temperature": temperature}
    trainer = (FSDPModule if backend == "fsdp" else MegatronModule)(config).start()
    if config.get("lora"):  # B = 0 would leave the base: random adapters, the same at every layout
        (fsdp_lora if backend == "fsdp" else lora).randomize(trainer, seed=1)
    return trainer


def _trainer_rank(
    config, temperature, port, token, bucket_bytes, validate, to_trainer, from_trainer, backend
):
    """A trainer rank of the cross-process check: sync, then score what the engine generated."""
    trainer = _start_trainer(config, temperature, backend)
    report = GroupSender.to("127.0.0.1", port, token).send(trainer, validate, bucket_bytes)
    box = [to_trainer.get() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    scores = _score(trainer, box[0])
    if dist.get_rank() == 0:
        from_trainer.put((scores, report.seconds))
    return None


def _engine(args):
    """The backend's generation module on random weights (the sync must write every one): greedy
    with raw log-probs, or (--temperature T > 0) sampling at T with the tempered log-probs."""
    backend = load_backend(args.backend)
    keys = {f.name for f in dataclasses.fields(backend.Config)}
    config = dict(
        load=args.hf_checkpoint,
        load_format="dummy",
        dtype=args.dtype,
        seed=0,
        temperature=args.temperature,
        top_k=args.top_k or -1,
        top_p=args.top_p,
        new_token_limit=True,
        max_new_tokens=args.max_new_tokens,
        logprobs_mode="processed" if args.temperature > 0 else "raw",
    )
    engine = dict(
        tensor_parallel_size=args.infer_tp,
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
    )
    if args.infer_tp > 1 and "tensor_parallel_size" not in keys:
        raise ValueError(
            f"--infer-tp {args.infer_tp}: the {args.backend} backend runs in one process; use --infer-tp 1"
        )
    config.update({key: value for key, value in engine.items() if key in keys})
    if getattr(args, "lora_sync", "merged") == "adapter":  # the engine keeps the base weights
        config.update(load_format="auto", enable_lora=True)
        if "max_lora_rank" in keys:  # vllm: the engine's adapter slots
            config["max_lora_rank"] = next((r for r in (8, 16, 32, 64, 128) if r >= args.lora), 128)
    return import_class(backend.MODULE)(config, name="engine").start()


def _generate(module, prompts, temperature: float = 0.0) -> list:
    """[(generated ids, their log-probs)] of responses to `prompts`: greedy, or sampled at
    `temperature` > 0."""
    outputs = module.finished([{"input_ids": list(p)} for p in prompts], greedy=temperature == 0)
    return [
        (list(sample.token_ids), sample_logprobs(sample)) for _, sample in iter_samples(outputs)
    ]


def check_sync(args) -> dict:
    if not (Path(args.hf_checkpoint) / "config.json").exists():
        raise ValueError(
            f"--hf-checkpoint {args.hf_checkpoint}: no config.json there; point it at an HF model "
            "directory (e.g. one from `chatgen make-tiny-model`)"
        )
    if (args.top_k > 0 or args.top_p < 1) and args.temperature <= 0:
        raise ValueError(
            f"--top-k {args.top_k} / --top-p {args.top_p}: greedy decoding keeps no sampling set; "
            "add --temperature T > 0 (1.0: the model's own) or drop them"
        )
    hf_config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text())
    fsdp = args.trainer_backend == "fsdp"
    spec = None if fsdp else models.spec_from_hf_config(hf_config)
    # here, once: not in every rank's traceback
    if fsdp:
        _check_fsdp_args(args)
    else:
        layout.check_layout(spec, args.train_tp, args.train_pp, args.train_ep)
        if args.train_dp > 1:
            raise ValueError(
                "--train-dp: the data-parallel ranks of --trainer-backend fsdp; a Megatron trainer "
                "here runs TP x PP x EP ranks: drop --train-dp"
            )
    prompts = read_prompts(args.input, hf_config["vocab_size"])
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    config = _trainer_config(args)
    world = args.train_dp if fsdp else args.train_tp * args.train_pp * args.train_ep
    if args.lora and args.lora_sync == "adapter" and (world, args.infer_tp) != (1, 1):
        raise ValueError(
            "--lora-sync adapter: check-sync runs a multi-rank trainer in processes of its own, and the "
            "adapter-only sync needs the engine in the trainer's process (colocated; a TP 2 trainer into a TP 2 "
            "engine is tested in tests/integration/test_lora.py); drop --train-tp/--train-pp/--train-ep/"
            "--infer-tp or use --lora-sync merged"
        )
    if world == 1 and args.infer_tp == 1:
        mode = "colocated"
        trainer = _start_trainer(config, args.temperature, args.trainer_backend)
        engine = _engine(args)
        try:
            report = (
                sync_adapter(trainer, engine, validate=args.validate)
                if args.lora and args.lora_sync == "adapter"
                else sync_weights(
                    trainer, engine, bucket_bytes=bucket_bytes, validate=args.validate
                )
            )
            experts = expert_weight_diffs(engine, spec, args.hf_checkpoint)
            generated = _generate(engine, prompts, args.temperature)
            scores = _score(trainer, [(p, g[0]) for p, g in zip(prompts, generated)])
        finally:
            engine.shutdown()
    else:
        mode = "cross-process"
        engine = _engine(args)
        rx = GroupReceiver.listen()
        to_trainer, from_trainer = ctx_queue(), ctx_queue()
        rank_args = (
            config,
            args.temperature,
            rx.port,
            rx.token,
            bucket_bytes,
            args.validate,
            to_trainer,
            from_trainer,
            args.trainer_backend,
        )
        job = DistributedJob(_trainer_rank, world, args=rank_args)
        try:
            report = rx.receive_into(engine, alive=job.poll)
            experts = expert_weight_diffs(engine, spec, args.hf_checkpoint)
            generated = _generate(engine, prompts, args.temperature)
            to_trainer.put([(p, g[0]) for p, g in zip(prompts, generated)])
            scores, sent_seconds = from_trainer.get(timeout=600)
            job.join()
        finally:
            job.stop()
            engine.shutdown()
        # the engine starts waiting before the trainer ranks exist: its clock holds their start-up
        # (spawn, imports, model build: 18 s of the 18.2 s once reported as "sync 18171 ms for 2.0
        # MB"); the sync is the sender's
        waited = report.seconds - sent_seconds
        report = dataclasses.replace(report, seconds=sent_seconds)
    samples, worst = [], 0.0
    for prompt, (output, engine_lp), trainer_lp in zip(prompts, generated, scores):
        worst = max_abs_diff(engine_lp, trainer_lp, worst)
        samples.append(
            dict(
                prompt_ids=prompt,
                output_ids=output,
                engine_logprobs=engine_lp,
                trainer_logprobs=trainer_lp,
            )
        )
    result = dict(
        samples=samples,
        max_abs_logprob_diff=worst,
        sync_seconds=report.seconds,
        sync_bytes=report.bytes,
        sync_bytes_per_s=report.bytes_per_s,
        sync_tensors=report.tensors,
        sync_buckets=report.buckets,
        validated=report.validated,
        mode=mode,
        backend=args.backend,
        trainer_backend=args.trainer_backend,
        train_dp=args.train_dp,
        train_tp=args.train_tp,
        train_pp=args.train_pp,
        train_ep=args.train_ep,
        infer_tp=args.infer_tp,
        dtype=args.dtype,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        threshold=args.threshold,
    )
    if mode == "cross-process":
        result["trainer_start_seconds"] = waited  # the engine's wait for the trainer ranks
    if experts:
        # NaN fails
        worst_expert = (
            float("nan") if any(d != d for d in experts.values()) else max(experts.values())
        )
        result.update(expert_weight_max_abs_diff=experts, max_abs_expert_weight_diff=worst_expert)
    return result


def _check_fsdp_args(args) -> None:
    """What an fsdp trainer cannot take (every rank shards the whole model), and a family it
    cannot sync (chatgen.training.config.hf_family_problem), before anything starts."""
    for flag in ("train_tp", "train_pp", "train_ep"):
        if getattr(args, flag) > 1:
            raise ValueError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: a Megatron-only layout; "
                "--trainer-backend fsdp shards over data-parallel ranks: use --train-dp"
            )
    if problem := hf_family_problem(args.hf_checkpoint):
        raise ValueError(f"--hf-checkpoint {problem}")


def expert_weight_diffs(engine, spec, hf_checkpoint) -> dict:
    """{HF name of an expert weight: max |engine - checkpoint|} over every expert of every MoE
    layer ({} for a dense model, or an engine that cannot read its experts back): the engine's
    fused weights (w13 = [gate; up], w2 = down per expert, `VLLMModule.expert_weights`) split by
    the layout kind of the family's mapping, against the checkpoint cast to the engine's dtype.
    What the sync wrote, exactly."""
    if spec is None or not spec.is_moe or not hasattr(engine, "expert_weights"):
        return {}
    params = [sp for sp in layout.stage_params(spec, 1, 0) if sp.expert is not None]
    ckpt = read_hf_safetensors(
        hf_checkpoint, spec.tie_word_embeddings, names={n for sp in params for n in sp.hf_names}
    )
    per_layer = len(params) // spec.num_layers  # a layer's expert weights, in layer order
    out = {}
    for layer, (w13, w2) in enumerate(engine.expert_weights()):
        for sp in params[layer * per_layer : (layer + 1) * per_layer]:
            held = w13[sp.expert].chunk(2) if sp.kind == "gate_up" else (w2[sp.expert],)
            for name, weight in zip(sp.hf_names, held):
                out[name] = float(
                    (weight.double() - ckpt[name].to(weight.dtype).double()).abs().max()
                )
    return out
