"""The GPU tier: what only a CUDA machine can show (NCCL, vLLM's CUDA kernels and sleep mode, megatron's DDP and
distributed optimizer on a device, the trainer's memory handoff, GRPO colocated on one GPU).

    bash scripts/gpu_smoke.sh          # a CUDA machine with the stack installed: python -m pytest tests/gpu -rs
    bash scripts/gpu_run.sh            # the offline GPU machine (docs/gpu.md): the tests that need no vLLM

Every test is marked `gpu`; without CUDA, tests/conftest.py skips them with the reason; the ones that start a
vLLM engine skip without vLLM, all without megatron-core. The last three need two GPUs and say so. docs/gpu.md
lists what ran on which GPU, and what never has.
"""

import importlib.util
import json
import os

import pytest
import torch
from helpers import optimizer_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="needs megatron-core (pip install chatgen)",
    ),
]
# vLLM is imported inside the tests that start an engine, never here: without it they skip, the rest run (the GPU
# machine lent to sessions has no vLLM; scripts/gpu_run.sh runs this file there)
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="needs vLLM (pip install 'chatgen[vllm]'; its CUDA wheel is 327 MB)",
)

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (NCCL cannot pair two ranks on one device)",
)
PROMPTS = [[5, 17, 99, 200], [1, 2, 3, 4, 5, 6, 7]]
FP32_TOL = (
    1e-3  # trainer vs engine on CUDA, fp32 (CPU: 1e-4); GPU attention and GEMM kernels differ more
)
BF16_TOL = (
    0.25  # bf16: a mantissa of 8 bits; the engine's fused kernels round differently from megatron's
)


def trainer(model_dir, **kw):
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return MegatronModule(dict(load=str(model_dir), **kw)).start()


def engine(model_dir, dtype="float32", tensor_parallel_size=1):
    """A VLLMModule on random weights (load_format dummy): only a sync makes it agree with the trainer."""
    from chatgen.generation.vllm.module import VLLMModule

    return VLLMModule(
        dict(
            load=str(model_dir),
            load_format="dummy",
            enforce_eager=True,
            dtype=dtype,
            seed=0,
            kv_cache_memory_bytes=256 << 20,
            temperature=0.0,
            new_token_limit=True,
            max_new_tokens=6,
            logprobs_mode="raw",
            tensor_parallel_size=tensor_parallel_size,
        )
    ).start()


def generate(llm, prompts=PROMPTS, tokens=6):
    """[(greedy output ids, vLLM's log-probs of them)]."""
    import dataclasses

    from chatgen.generation.batching import sample_logprobs

    llm.config = dataclasses.replace(llm.config, max_new_tokens=tokens)
    outs = llm.finished([{"input_ids": p} for p in prompts], greedy=True)
    return [(list(o.outputs[0].token_ids), sample_logprobs(o.outputs[0])) for o in outs]


def diff_vs_trainer(module, generated, prompts=PROMPTS) -> float:
    """Largest |trainer log-prob - engine log-prob| over the generated tokens (NaN stays NaN)."""
    diffs = [
        module.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[0, len(prompt) - 1 :]
        - torch.tensor(lp)
        for prompt, (ids, lp) in zip(prompts, generated)
    ]
    return torch.cat([d.abs() for d in diffs]).max().item()


def hf_logprobs(model_dir, input_ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(input_ids.cuda()).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids.cuda()[:, 1:, None])[..., 0].cpu()


def nll(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


def ids(b=4, t=24, seed=0):
    return torch.randint(0, 500, (b, t), generator=torch.Generator().manual_seed(seed))


def test_cpu_shims_stay_off_on_cuda(tiny_llama_dir):
    """chatgen/training/cpu_compat.py patches nothing where CUDA exists: megatron sees real devices and torch."""
    from megatron.core.pipeline_parallel import schedules

    from chatgen.training import cpu_compat

    module = trainer(tiny_llama_dir)
    assert cpu_compat.apply() is False
    assert isinstance(torch.cuda.current_device(), int) and schedules.torch is torch
    assert next(module.model.parameters()).is_cuda and module.ddp.buffers[0].grad_data.is_cuda
    with cpu_compat.cuda_type_names():
        assert torch.zeros(1).type() == "torch.FloatTensor"  # (the CPU renaming is off too)


def test_trainer_logprobs_match_hf_transformers_on_cuda(tiny_llama_dir):
    """megatron-core on CUDA (Transformer Engine's layer spec where it is installed, else the local one) scores
    tokens as HF transformers does, fp32."""
    batch = ids()
    got = trainer(tiny_llama_dir).forward_tokens({"input_ids": batch})
    assert (
        got.shape == (4, 23) and (got - hf_logprobs(tiny_llama_dir, batch)).abs().max() < FP32_TOL
    )


@needs_vllm
def test_colocated_sync_into_vllm_is_exact_on_cuda_fp32(tiny_llama_dir):
    """Trainer and engine on one GPU, fp32: after a sync (and again after a training step) vLLM's greedy log-probs
    equal the trainer's; before it, the engine's random weights are far off."""
    from chatgen.param_sync import sync_weights

    module, llm = trainer(tiny_llama_dir, lr=1e-2), engine(tiny_llama_dir)
    try:
        assert diff_vs_trainer(module, generate(llm)) > 1e-2
        report = sync_weights(module, llm, validate=True)
        assert report.validated and report.tensors == 21
        assert diff_vs_trainer(module, generate(llm)) < FP32_TOL
        module.train_step({"input_ids": torch.tensor([PROMPTS[1] * 2])}, nll)
        assert diff_vs_trainer(module, generate(llm)) > 1e-3  # stale
        sync_weights(module, llm, bucket_bytes=300_000)
        assert diff_vs_trainer(module, generate(llm)) < FP32_TOL
    finally:
        llm.shutdown()


@needs_vllm
def test_colocated_sync_into_vllm_bf16(tiny_llama_dir):
    """bf16 on both sides (what GPUs train in): the sync moves every tensor bit for bit (validated), and the
    engine's log-probs follow the trainer's within bf16 precision."""
    from chatgen.param_sync import sync_weights

    module, llm = (
        trainer(tiny_llama_dir, dtype="bfloat16"),
        engine(tiny_llama_dir, dtype="bfloat16"),
    )
    try:
        before = diff_vs_trainer(module, generate(llm))
        assert sync_weights(module, llm, validate=True).validated
        after = diff_vs_trainer(module, generate(llm))
        assert after < BF16_TOL and after < before / 4, (before, after)
    finally:
        llm.shutdown()


@needs_vllm
def test_engine_sleep_frees_its_memory_and_wake_up_restores_it(tiny_llama_dir):
    """vLLM's sleep mode (level 1: KV cache dropped, weights to host) gives the GPU memory back, as a colocated
    trainer needs; after wake_up the engine answers as before."""
    llm = engine(tiny_llama_dir, dtype="bfloat16")
    try:
        before = generate(llm)
        torch.cuda.synchronize()
        free_awake, _ = torch.cuda.mem_get_info()
        llm.sleep(level=1)
        free_asleep, _ = torch.cuda.mem_get_info()
        # the KV cache at least
        assert free_asleep - free_awake > 0.8 * (256 << 20), (
            free_awake,
            free_asleep,
        )
        llm.wake_up()
        assert generate(llm) == before
    finally:
        llm.shutdown()


def test_trainer_offload_and_onload_round_trip(tiny_llama_dir):
    """offload() frees the GPU memory of gradients, optimizer state and weights; a forward pass or a sync brings
    back the weights only; onload() restores every tensor bit for bit, and training goes on."""
    module = trainer(tiny_llama_dir, dtype="bfloat16", lr=1e-4)
    module.train_step({"input_ids": ids()}, nll)
    weights, state = module.hf_state_dict(), optimizer_state(module)
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in module.ddp.buffers)
    param_bytes = sum(
        b.param_data.numel() * b.param_data.element_size() for b in module.ddp.buffers
    )
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    module.offload()
    assert module.memory.offloaded == ("grads", "optimizer", "params")
    freed = allocated - torch.cuda.memory_allocated()
    assert freed > 0.9 * (grad_bytes + param_bytes + state_bytes), (
        freed,
        grad_bytes,
        param_bytes,
        state_bytes,
    )
    # weights came back for it
    assert all(torch.equal(module.hf_state_dict()[k], w) for k, w in weights.items())
    assert module.memory.offloaded == ("grads", "optimizer")
    module.onload()
    assert not module.memory.offloaded
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(module), state, strict=True))
    first = module.train_step({"input_ids": ids()}, nll)["loss"]
    module.offload(params=False)  # what a run does before waking the engine for a sync
    assert module.memory.offloaded == ("grads", "optimizer")
    assert module.train_step({"input_ids": ids()}, nll)["loss"] < first  # train_step onloads itself


def test_ddp_and_distributed_optimizer_on_one_gpu_step_fp32_masters(tiny_llama_dir):
    """megatron's DDP (fp32 grad buffers) and distributed optimizer on a GPU, bf16 weights: masters and moments are
    fp32, updates far below a bf16 step still land (lr 1e-5), the reported grad norm is the main grads' norm."""
    module = trainer(tiny_llama_dir, dtype="bfloat16", lr=1e-5, clip_grad=0.0)
    params = [p for p in module.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    for _ in range(3):
        metrics = module.train_step({"input_ids": ids()}, nll)
    norm = torch.sqrt(sum(p.main_grad.double().pow(2).sum() for p in params)).item()
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert all(t.dtype == torch.float32 for t in optimizer_state(module))
    assert all(p.main_grad.dtype == torch.float32 for p in params)
    bf16 = [(p, s) for p, s in zip(params, start) if p.dtype == torch.bfloat16]
    changed = sum(int((p != s).sum()) for p, s in bf16) / sum(p.numel() for p, _ in bf16)
    assert changed > 0.2, changed


def test_distributed_checkpoint_resumes_exactly_on_gpu(tiny_llama_dir, tmp_path):
    """A checkpoint written from the GPU (each rank its shards, through host memory) loads back with every weight,
    fp32 master and Adam moment bit for bit, and the LR schedule's position."""
    kw = dict(dtype="bfloat16", lr=1e-4, lr_warmup_iters=10)
    module = trainer(tiny_llama_dir, **kw)
    for _ in range(2):
        module.train_step({"input_ids": ids()}, nll)
    path = module.save_checkpoint(tmp_path / "ckpt")
    weights, state = module.hf_state_dict(), optimizer_state(module)
    resumed = trainer(path, **kw)
    assert resumed.iteration == 2
    assert all(torch.equal(resumed.hf_state_dict()[k], w) for k, w in weights.items())
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(resumed), state, strict=True))
    # warm-up step 3 of 10
    assert resumed.train_step({"input_ids": ids()}, nll)["lr"] == pytest.approx(3e-5)


def test_memory_stats_report_the_phases_on_gpu(tiny_llama_dir):
    """memory/* on GPU: the trainer's peak while it held its state, the peak while it was offloaded, the device's
    use now; each call starts the counting anew."""
    module = trainer(tiny_llama_dir, dtype="bfloat16")
    module.memory_stats()
    module.train_step({"input_ids": ids()}, nll)
    module.offload()
    # 64 MiB "engine" while the trainer is out
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del held
    module.onload()
    stats = module.memory_stats()
    assert set(stats) == {
        "memory/trainer_peak_gib",
        "memory/offloaded_peak_gib",
        "memory/device_used_gib",
    }
    assert stats["memory/trainer_peak_gib"] > 0 and stats["memory/device_used_gib"] > 0
    assert stats["memory/offloaded_peak_gib"] >= 64 / 1024
    assert set(module.memory_stats()) == {"memory/trainer_peak_gib", "memory/device_used_gib"}


def test_shared_prefix_packing_on_gpu(tiny_llama_dir):
    """Shared-prefix packing on CUDA gives the unpacked loss (megatron's attention reads the packed mask); with
    Transformer Engine's attention it stays off (its fused kernels were not verified to honour that mask)."""
    from chatgen.core.rollout import RolloutBatch, Sample

    module = trainer(tiny_llama_dir, lr=1e-12, clip_grad=0.0)
    if not module.packing.packs:
        pytest.skip("Transformer Engine's layer spec: shared-prefix packing is off by design")
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g in range(2):
        prompt = torch.randint(0, 500, (5 + g,), generator=gen).tolist()
        for i in range(3):
            response = torch.randint(0, 500, (2 + i,), generator=gen).tolist()
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=response,
                    response_logprobs=[0.0] * len(response),
                )
            )
    data = RolloutBatch.from_samples(samples, pad_token_id=0).trainer_inputs()

    def masked(logprobs, mb):
        mask = mb["loss_mask"]
        return -(logprobs * mask).sum() / mask.sum(), {}

    packed = module.train_step(data, masked)["loss"]
    module.packing.packs = False
    assert module.train_step(data, masked)["loss"] == pytest.approx(packed, rel=1e-5)


def _grpo_config(model_dir, data_dir, out, *extra):
    from chatgen.rlhf.config import load_config

    return load_config(
        "configs/grpo_tiny.yaml",
        [
            f"runtime.data_path={data_dir}/train.jsonl",
            f"runtime.eval_data_path={data_dir}/eval.jsonl",
            f"runtime.output_dir={out}",
            "runtime.num_episode=2",
            "runtime.sample_per_episode=32",
            "runtime.train_micro_batch_size=16",
            "runtime.train_global_batch_size=16",
            "runtime.eval_episode_interval=1",
            "runtime.save_episode_interval=2",
            "models.policy.num_gpu=1",
            "models.policy_trainer.num_gpu=1",
            f"policy.load={model_dir}",
            f"policy_trainer.load={model_dir}",
            "policy.n=4",
            "policy.dtype=bfloat16",
            "policy_trainer.dtype=bfloat16",
            "runtime.algorithm.old_logprobs=recompute",
            *extra,
        ],
    )


def _check_gpu_run(out, metrics):
    """What any GRPO run colocated on one GPU must show: finite figures, the engine and the trainer taking turns
    (the trainer was offloaded while the engine generated), a checkpoint."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert all(v == v for v in r.values() if isinstance(v, float))  # no NaN
        assert r["memory/trainer_peak_gib"] > 0 and r["memory/device_used_gib"] > 0
        assert r["memory/offloaded_peak_gib"] >= 0  # present: the trainer handed the GPU over
        # bf16 engine vs bf16 trainer on the sampled tokens
        assert r["mismatch/logprob_mean_abs"] < 0.1
    assert (
        out / "checkpoints" / "episode_000002" / "policy_trainer" / "chatgen_megatron.json"
    ).exists()
    # An episode whose every group got equal rewards has zero advantages, so a zero gradient (about 1 run in 10
    # for the last episode of the tiny model): only a run that saw different rewards must have trained somewhere
    norms = [r["policy/grad_norm"] for r in records[1:]]
    assert all(n >= 0 for n in norms), norms
    assert max(norms) > 0 or all(r["reward/std"] == 0 for r in records[1:]), (norms, metrics)


@needs_vllm
def test_grpo_tiny_colocated_on_one_gpu(tiny_llama_dir, tmp_path, monkeypatch):
    """GRPO with engine and trainer on one GPU in one process, bf16: the engine sleeps after generating, the trainer
    offloads before it wakes; two episodes, evaluation, a checkpoint."""
    from chatgen.rlhf import tasks
    from chatgen.rlhf.algorithms import grpo

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    tasks.main(["--output", str(tmp_path / "data"), "--n-train", "64", "--n-eval", "8"])
    metrics = grpo.train(
        _grpo_config(tiny_llama_dir, tmp_path / "data", tmp_path / "run"), log=lambda *_: None
    )
    _check_gpu_run(tmp_path / "run", metrics)


@needs_vllm
def test_grpo_smollm2_colocated_on_one_gpu(smollm2_dir, tmp_path, monkeypatch):
    """The same on SmolLM2-135M-Instruct (the real model of configs/grpo_smollm2.yaml), arithmetic task."""
    from chatgen.rlhf import tasks
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    data = tmp_path / "data"
    tasks.main(["--output", str(data), "--task", "arithmetic", "--n-train", "64", "--n-eval", "8"])
    cfg = load_config(
        "configs/grpo_smollm2.yaml",
        [
            f"runtime.data_path={data}/train.jsonl",
            f"runtime.eval_data_path={data}/eval.jsonl",
            f"runtime.output_dir={tmp_path / 'run'}",
            "runtime.num_episode=2",
            "runtime.sample_per_episode=16",
            "runtime.train_micro_batch_size=16",
            "runtime.train_global_batch_size=16",
            "runtime.eval_episode_interval=1",
            "runtime.save_episode_interval=2",
            "models.policy.num_gpu=1",
            "models.policy_trainer.num_gpu=1",
            f"policy.load={smollm2_dir}",
            f"policy_trainer.load={smollm2_dir}",
            "policy.dtype=bfloat16",
            "policy_trainer.dtype=bfloat16",
            "runtime.algorithm.old_logprobs=recompute",
        ],
    )
    metrics = grpo.train(cfg, log=lambda *_: None)
    _check_gpu_run(tmp_path / "run", metrics)
    assert 0 <= metrics["eval/reward"] <= 1


def _nccl_sender(model_dir, port):
    """The trainer process (GPU 1): one validated sync over the NCCL channel into the engine's process."""
    from chatgen.param_sync import GroupSender, sync_weights

    module = trainer(model_dir, dtype="bfloat16")
    return sync_weights(module, GroupSender.to("127.0.0.1", port), validate=True).tensors


@needs_vllm
@two_gpus
def test_nccl_weight_channel_between_processes(tiny_llama_dir, monkeypatch):
    """Trainer on GPU 1 in its own process, engine on GPU 0 in this one: the weights cross over a private NCCL
    group, each tensor checked by its fingerprint on arrival."""
    from chatgen.param_sync import GroupReceiver
    from chatgen.training.launcher import DistributedJob

    torch.cuda.set_device(0)
    llm = engine(tiny_llama_dir, dtype="bfloat16")
    rx = GroupReceiver.listen()
    # The child's CUDA must see GPU 1 only from its first CUDA call, which importing this module makes
    # (torch.cuda.device_count above): it inherits this process's environment when it is spawned.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    job = DistributedJob(_nccl_sender, 1, args=(tiny_llama_dir, rx.port))
    monkeypatch.undo()  # this process's CUDA started long ago; vLLM may read the variable again
    try:
        reference = hf_logprobs(tiny_llama_dir, torch.tensor([PROMPTS[1] + [9, 10, 11]]))[
            0, len(PROMPTS[1]) - 1 :
        ]
        stale = generate(llm, [PROMPTS[1]], tokens=3)
        report = rx.receive_into(llm, alive=job.poll)
        assert report.validated and report.tensors == 21
        assert job.join() == [21]
        import dataclasses

        llm.config = dataclasses.replace(llm.config, prompt_logprobs=0, max_new_tokens=1)
        (out,) = llm.finished([{"input_ids": PROMPTS[1] + [9, 10, 11]}], greedy=True)
        synced = torch.tensor(
            [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[len(PROMPTS[1]) :]]
        )
        llm.config = dataclasses.replace(llm.config, prompt_logprobs=None)
        assert (synced - reference).abs().max() < BF16_TOL and stale != generate(
            llm, [PROMPTS[1]], tokens=3
        )
    finally:
        job.stop()
        llm.shutdown()


def _colocated_tp2(model_dir):
    """Each of 2 ranks (GPU = rank): Megatron TP=2 and its vLLM TP=2 rank (external_launcher) in one process."""
    from chatgen.param_sync import sync_weights

    module = trainer(model_dir, dtype="bfloat16", tensor_model_parallel_size=2)
    # WORLD_SIZE=2: external_launcher
    llm = engine(model_dir, dtype="bfloat16", tensor_parallel_size=2)
    try:
        before = diff_vs_trainer(module, generate(llm))
        tensors = sync_weights(module, llm, validate=True).tensors
        return before, diff_vs_trainer(module, generate(llm)), tensors
    finally:
        llm.shutdown()


@needs_vllm
@two_gpus
def test_colocated_tp2_on_two_gpus(tiny_llama_dir):
    from chatgen.training.launcher import run_distributed

    for before, after, tensors in run_distributed(_colocated_tp2, 2, args=(tiny_llama_dir,)):
        assert tensors == 21 and after < BF16_TOL and after < before / 4, (before, after)


def _data_parallel(model_dir, data):
    module = trainer(model_dir, lr=1e-3, micro_batch_size=2, global_batch_size=4)
    half = slice(2 * module.dp_rank, 2 * module.dp_rank + 2)
    return [module.train_step({"input_ids": data[half]}, nll)["loss"] for _ in range(3)]


@two_gpus
def test_dp2_on_two_gpus_trains_like_one(tiny_llama_dir):
    """DP = 2 over NCCL (grads reduce-scattered, weights all-gathered) gives one GPU's loss trajectory, fp32."""
    from chatgen.training.launcher import run_distributed

    data = ids(b=4, seed=3)
    one = trainer(tiny_llama_dir, lr=1e-3, micro_batch_size=2, global_batch_size=4)
    ref = [one.train_step({"input_ids": data}, nll)["loss"] for _ in range(3)]
    for losses in run_distributed(_data_parallel, 2, args=(tiny_llama_dir, data)):
        assert losses == pytest.approx(ref, rel=1e-4)
