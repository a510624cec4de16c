"""LoRA on the Megatron trainer with the real megatron-core, vLLM and peft on CPU (fp32): only the adapters train
(no gradient buffer or optimizer state for the base), the merged sync makes vLLM's log-probs equal the trainer's
within 1e-4 at TP 1 and TP 2, the exported adapter gives the same log-probs under `peft.PeftModel` on the HF
base and loads back, a resumed LoRA run continues bit-exactly.

    python -m pytest tests/integration/test_lora.py
"""

import math
import os

import pytest
import torch
from helpers import SYNC_PROMPTS, batch, build, engine, generate, nll_loss, optimizer_state

from chatgen.config import ConfigError
from chatgen.param_sync import sync_weights
from chatgen.training import lora
from chatgen.training.lora_peft import export_peft

pytestmark = pytest.mark.integration

TOL = 1e-4
ALL = dict(rank=4, alpha=8.0)  # every target
SOME = dict(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def llama(make_tiny):
    return make_tiny("tiny_llama")


def vllm_vs_trainer(trainer, generated, prompts=SYNC_PROMPTS) -> float:
    return max(
        (
            trainer.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[
                0, len(prompt) - 1 :
            ]
            - torch.tensor(lp)
        )
        .abs()
        .max()
        .item()
        for prompt, (ids, lp) in zip(prompts, generated)
    )


def hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_only_the_adapters_train_and_the_merged_sync_matches_vllm(llama):
    ids = batch()
    trainer = build(llama, lr=1e-2, lora=SOME)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    adapted = [n for n in base if lora.is_adapter_param(n)]
    assert adapted and 0 < trainer.lora_stats["share"] < 0.05
    assert trainer.lora_stats["trainable"] == sum(base[n].numel() for n in adapted)  # TP 1, PP 1
    start = trainer.forward_tokens({"input_ids": ids})
    with lora.adapter_disabled(trainer.model):  # B = 0: the adapted model starts as the base
        assert torch.equal(trainer.forward_tokens({"input_ids": ids}), start)

    m1 = trainer.train_step({"input_ids": ids}, nll_loss)
    m2 = trainer.train_step({"input_ids": ids}, nll_loss)
    assert m2["loss"] < m1["loss"] and m1["grad_norm"] > 0
    for name, p in trainer.model.named_parameters():
        frozen = name not in adapted
        assert p.requires_grad != frozen and hasattr(p, "main_grad") != frozen, name
        assert torch.equal(p.detach(), base[name]) == frozen, name  # the base never moves
    # the optimizer holds fp32 masters and two moments of the adapters only
    assert sum(t.numel() for t in optimizer_state(trainer)) == 3 * trainer.lora_stats["trainable"]
    with lora.adapter_disabled(trainer.model):  # the KL reference: the base, no second copy
        assert torch.equal(trainer.forward_tokens({"input_ids": ids}), start)

    llm = engine(llama)
    try:
        report = sync_weights(trainer, llm, validate=True, bucket_bytes=300_000)
        assert report.validated and report.tensors == 21  # the base's names, merged
        after = vllm_vs_trainer(trainer, generate(llm))
        with lora.adapter_disabled(trainer.model):
            # the engine runs the adapted model
            assert vllm_vs_trainer(trainer, generate(llm)) > 1e-3
    finally:
        llm.shutdown()
    assert after < TOL, after


def test_peft_export_matches_the_trainer_and_loads_back(llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = batch()
    trainer = build(llama, lr=1e-2, lora=ALL)
    trainer.train_step({"input_ids": ids}, nll_loss)
    trainer.train_step({"input_ids": ids}, nll_loss)  # A and B both move (B = 0 at the first step)
    want = trainer.forward_tokens({"input_ids": ids})
    out = export_peft(trainer, tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # written atomically
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    assert (hf_logprobs(base, ids) - want).abs().max() > 1e-3  # the adapter matters
    peft_model = PeftModel.from_pretrained(base, out).eval()
    assert peft_model.peft_config["default"].r == 4
    assert (hf_logprobs(peft_model, ids) - want).abs().max() < TOL

    started = build(llama, lr=1e-2, lora=dict(ALL, from_peft=out))
    assert torch.equal(started.forward_tokens({"input_ids": ids}), want)
    with pytest.raises(ConfigError, match="lora.rank: 8, but .* has r=4; set it"):
        build(llama, lora=dict(ALL, rank=8, from_peft=out))


def test_a_resumed_lora_run_continues_bit_exactly(llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from chatgen.models.convert import megatron_to_hf_dir

    ids = batch()
    kw = dict(lr=1e-2, lora=ALL)
    trainer = build(llama, **kw)
    for _ in range(2):
        trainer.train_step({"input_ids": ids}, nll_loss)
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    want = trainer.forward_tokens({"input_ids": ids})
    # the checkpoint carries the adapter in PEFT's format, and `convert --to hf` merges it
    hf_dir = megatron_to_hf_dir(path, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert (hf_logprobs(merged, ids) - want).abs().max() < TOL
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, f"{path}/adapter").eval()
    assert (hf_logprobs(peft_model, ids) - want).abs().max() < TOL

    resumed = build(path, **kw)
    assert resumed.iteration == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(optimizer_state(resumed), optimizer_state(trainer), strict=True)
    )
    assert resumed.train_step({"input_ids": ids}, nll_loss) == trainer.train_step(
        {"input_ids": ids}, nll_loss
    )
    assert torch.equal(
        resumed.forward_tokens({"input_ids": ids}), trainer.forward_tokens({"input_ids": ids})
    )
    assert all(
        torch.equal(a, b) for a, b in zip(optimizer_state(resumed), optimizer_state(trainer))
    )


def _tp2_lora(model_dir, ids):
    """Each rank: a LoRA trainer at TP 2 steps once, syncs the adapter alone (gathered over TP, validated) into its
    vLLM TP 2 rank (same process) that keeps the base weights. (The merged sync from TP 2: test_check_sync_lora.)"""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from chatgen.param_sync import sync_adapter
    from chatgen.training.megatron_module import MegatronModule

    trainer = MegatronModule(
        dict(load=str(model_dir), tensor_model_parallel_size=2, lr=1e-2, lora=SOME)
    ).start()
    grad_norm = trainer.train_step({"input_ids": ids}, nll_loss)["grad_norm"]
    trainer.train_step({"input_ids": ids}, nll_loss)  # A and B both move (B = 0 at the first step)
    logprobs = trainer.forward_tokens({"input_ids": ids})
    llm = lora_engine(model_dir, tensor_parallel_size=2)
    report = sync_adapter(trainer, llm, validate=True)
    diff = vllm_vs_trainer(trainer, generate(llm))
    llm.shutdown()
    # by value: a tensor would travel as a file descriptor its rank process no longer serves once it exits
    return logprobs.tolist(), grad_norm, diff, report.validated


def test_tp2_trains_like_tp1_and_syncs_its_adapter_into_vllm_tp2(llama):
    from chatgen.training.launcher import run_distributed

    ids = batch()
    results = run_distributed(
        _tp2_lora, 2, args=(llama, ids), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    )
    tp1 = build(llama, lr=1e-2, lora=SOME)
    grad_norm = tp1.train_step({"input_ids": ids}, nll_loss)["grad_norm"]
    tp1.train_step({"input_ids": ids}, nll_loss)
    want = tp1.forward_tokens({"input_ids": ids})
    for logprobs, tp2_grad_norm, diff, validated in results:
        assert diff < TOL and validated
        # A's TP sums, shards counted once
        assert tp2_grad_norm == pytest.approx(grad_norm, rel=1e-5)
        # the same adapters, initialised and trained alike
        assert (torch.tensor(logprobs) - want).abs().max() < 1e-5


def test_grpo_with_lora_syncs_exactly_and_takes_its_kl_reference_from_the_base(
    llama, data_dir, tmp_path, monkeypatch
):
    """configs/grpo_tiny_lora.yaml for 2 episodes with kl_coef > 0 and no `reference` model: the reference is the
    trainer's base (adapters off), so KL is 0 before the first step and positive after it; every sync is exact."""
    import json
    from pathlib import Path

    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.algorithms.grpo import step as grpo_step
    from chatgen.rlhf.config import load_config

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    out = tmp_path / "run"
    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out),
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.generation_batch_size": 32,
        "runtime.eval_episode_interval": 100,
        "runtime.save_episode_interval": "null",
        "runtime.algorithm.kl_coef": 0.1,
        "policy.load": llama,
        "policy.n": 4,
        "policy_trainer.load": llama,
    }
    cfg = load_config(repo / "configs/grpo_tiny_lora.yaml", [f"{k}={v}" for k, v in items.items()])
    assert "reference" not in cfg.models and grpo_step.lora_reference(cfg)
    grpo.train(cfg, log=lambda *_: None)
    metrics = {
        r["episode"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    for episode in (1, 2):
        assert metrics[episode]["mismatch/logprob_max_abs"] < TOL  # the merged sync is exact
    assert metrics[1]["kl/reference"] == pytest.approx(0.0, abs=1e-6)  # B = 0: policy == base
    assert metrics[2]["kl/reference"] > 1e-6  # the adapters moved; the base did not


LAYOUTS = [(1, 2), (1, 1)]  # (TP, PP) of two ranks: PP 2; DP 2


def _layout_steps(model_dir, ids):
    """Each rank: at each of LAYOUTS (DP = the rest), a LoRA trainer takes one step on its share of
    `ids` (one job for both: each start of ranks is seconds of imports; each trainer starts
    afresh)."""
    results = []
    for tp, pp in LAYOUTS:
        trainer = build(
            model_dir,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            lr=1e-2,
            lora=ALL,
        )
        mine = ids[trainer.dp_rank :: trainer.dp]  # DP 2: one sample each, the same mean loss
        grad_norm = trainer.train_step({"input_ids": mine}, nll_loss)["grad_norm"]
        merged = trainer.hf_state_dict()["model.layers.1.self_attn.q_proj.weight"]
        results.append(
            (grad_norm, trainer.forward_tokens({"input_ids": ids}).tolist(), merged.tolist())
        )
    return results


def test_pp2_and_dp2_train_like_one_rank(make_tiny):
    """qwen2 (QKV bias, tied embeddings: the frozen embedding of the last stage gets no gradient exchange)."""
    from chatgen.training.launcher import run_distributed

    model_dir, ids = make_tiny("tiny_qwen2"), batch()
    one = build(model_dir, lr=1e-2, lora=ALL)
    grad_norm = one.train_step({"input_ids": ids}, nll_loss)["grad_norm"]
    want = one.forward_tokens({"input_ids": ids})
    want_q = one.hf_state_dict()["model.layers.1.self_attn.q_proj.weight"]
    one.shutdown()
    for rank in run_distributed(_layout_steps, 2, args=(model_dir, ids)):
        for layout, (norm, logprobs, merged) in zip(LAYOUTS, rank, strict=True):
            assert norm == pytest.approx(grad_norm, rel=1e-6), layout
            assert (torch.tensor(logprobs) - want).abs().max() < 1e-5, layout
            assert (torch.tensor(merged) - want_q).abs().max() < 1e-6, layout


def lora_engine(model_dir, tensor_parallel_size=1):
    """A VLLMModule on the model's own weights (the trainer's base) that takes adapters of rank <= 8."""
    from chatgen.generation.vllm.module import VLLMModule

    return VLLMModule(
        dict(
            load=str(model_dir),
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_cache_memory_bytes=32 << 20,
            temperature=0.0,
            new_token_limit=True,
            max_new_tokens=6,
            logprobs_mode="raw",
            enable_lora=True,
            max_lora_rank=8,
            tensor_parallel_size=tensor_parallel_size,
        )
    ).start()


def test_adapter_only_sync_into_vllm_matches_the_trainer(llama):
    """The engine keeps the base weights and samples with the trainer's adapter (vLLM's LoRA path on CPU, loaded
    from memory): its log-probs equal the trainer's within 1e-4, each sync swaps the adapter in place, only the
    adapter moves, and a NaN or misshapen adapter is refused with the engine unchanged."""
    from chatgen.param_sync import SyncError, sync_adapter

    ids = batch()
    trainer = build(llama, lr=1e-2, lora=SOME)
    for _ in range(2):
        trainer.train_step({"input_ids": ids}, nll_loss)
    llm = lora_engine(llama)
    plain = engine(llama)
    try:
        assert vllm_vs_trainer(trainer, generate(llm)) > 1e-3  # the base, not the adapted model
        report = sync_adapter(trainer, llm, validate=True)
        assert report.validated and report.tensors == 2 * 4 * 2  # A, B x 4 targets x 2 layers
        assert vllm_vs_trainer(trainer, generate(llm)) < TOL
        full = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
        assert report.bytes < 0.05 * full  # the adapter only
        trainer.train_step({"input_ids": ids}, nll_loss)
        assert vllm_vs_trainer(trainer, generate(llm)) > 1e-4  # stale until the next sync
        sync_adapter(trainer, llm)  # swapped in place
        assert vllm_vs_trainer(trainer, generate(llm)) < TOL
        before, version = generate(llm), llm.weight_version

        pair = lora.adapters(trainer.model)[0].pairs["q_proj"]
        kept = pair.lora_B.detach().clone()
        with torch.no_grad():
            pair.lora_B[0, 0] = float("nan")
        with pytest.raises(SyncError, match=r"NaN or inf: .*q_proj\.lora_B"):
            sync_adapter(trainer, llm)
        with torch.no_grad():
            pair.lora_B.copy_(kept)
        config, tensors = (
            trainer.adapter_weights().config,
            dict(next(trainer.adapter_weights().buckets())),
        )
        name = next(n for n in tensors if n.endswith("up_proj.lora_B.weight"))
        tensors[name] = tensors[name][:-1]  # one output row short
        with pytest.raises(SyncError, match=r"up_proj.weight: the adapter is for shape"):
            sync_adapter((config, tensors), llm)
        assert generate(llm) == before and llm.weight_version == version  # nothing changed
        with pytest.raises(SyncError, match="set enable_lora: true"):
            sync_adapter(trainer, plain)
    finally:
        llm.shutdown()
        plain.shutdown()


@pytest.mark.parametrize(
    "how, train_tp, backend",
    [("merged", "2", "vllm"), ("adapter", "1", "vllm"), ("adapter", "1", "hf")],
)
def test_check_sync_lora_both_ways(llama, tmp_path, how, train_tp, backend):
    """`chatgen check-sync --lora 4`: random adapters; merged from a TP 2 trainer (across processes) or the adapter
    only into an engine on the base weights (vLLM's LoRA path; the hf backend, the reference, merging it): the
    engine's log-probs equal the trainer's within 1e-4."""
    import json

    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in SYNC_PROMPTS))
    out = tmp_path / "check.json"
    args = ["check-sync", "--hf-checkpoint", str(llama), "--train-tp", train_tp]
    args += ["--input", str(prompts), "--output", str(out), "--max-new-tokens", "6"]
    assert main([*args, "--lora", "4", "--lora-sync", how, "--backend", backend]) == 0
    result = json.loads(out.read_text())
    assert result["max_abs_logprob_diff"] < TOL
    from chatgen import models
    from chatgen.core.checkpoint_io import read_hf_config
    from chatgen.models import layout

    spec = models.spec_from_hf_config(read_hf_config(llama))
    full = sum(4 * math.prod(s) for s in layout.hf_param_shapes(spec).values())  # fp32, merged
    assert (result["sync_bytes"] < 0.05 * full) == (how == "adapter")
    # the adapters are not zero: the base model's log-probs are elsewhere
    base = base_model_diff(llama, result["samples"])
    assert base > 1e-3


def base_model_diff(model_dir, samples) -> float:
    """The largest |base HF model - sample's engine log-prob| over the samples' generated tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["output_ids"]])
        lp = hf_logprobs(model, ids)[0, len(s["prompt_ids"]) - 1 :]
        worst = max(worst, (lp - torch.tensor(s["engine_logprobs"])).abs().max().item())
    return worst


def test_serve_lora_modules_serves_the_adapter_beside_the_base(llama, tmp_path, capsys):
    """`chatgen serve --lora-modules mine=DIR` (vLLM's flag; `--lora` too) with a trained adapter in PEFT's format:
    through the real openai client, greedy completions for `mine` are PEFT's on the HF base and those for the base
    name are the base's; a directory that is no adapter is refused before any engine starts, naming the flag."""
    import subprocess
    import sys

    import openai
    from helpers import wait_until_serving
    from peft import PeftModel
    from timeouts import scaled
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatgen.cli import main
    from chatgen.core.distributed import free_port

    trainer = build(llama, lr=1e-2, lora=ALL)
    for _ in range(2):
        trainer.train_step({"input_ids": batch()}, nll_loss)
    adapter = export_peft(trainer, tmp_path / "adapter")
    assert main(["serve", "--model", str(llama), "--lora", f"bad={tmp_path}", "--port", "0"]) != 0
    assert "--lora-modules bad: " in capsys.readouterr().err  # ... has no adapter_config.json

    port = free_port()
    args = [
        "serve",
        "--model",
        str(llama),
        "--port",
        str(port),
        "--lora-modules",
        f"mine={adapter}",
    ]
    args += [
        "enforce_eager=true",
        "seq_length=128",
        "max_new_tokens=16",
        f"kv_cache_memory_bytes={64 << 20}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatgen.cli", *args], stderr=subprocess.PIPE, text=True
    )
    try:  # what PEFT generates, while the server starts
        prompt = "the cat"
        tokenizer = AutoTokenizer.from_pretrained(llama)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
        base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
        with torch.no_grad():
            want = {str(llama): base.generate(ids, **greedy)[0, ids.shape[1] :].tolist()}
            peft_model = PeftModel.from_pretrained(base, adapter).eval()
            want["mine"] = peft_model.generate(input_ids=ids, **greedy)[0, ids.shape[1] :].tolist()
        assert want["mine"] != want[str(llama)]  # the adapter changes the greedy output
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
        )
        wait_until_serving(proc, f"http://127.0.0.1:{port}", scaled(300))
        assert {m.id for m in client.models.list()} == set(want)
        for name, tokens in want.items():
            r = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].token_ids == tokens and r.model == name, name
        with pytest.raises(openai.NotFoundError, match="'mine'"):
            client.completions.create(model="yours", prompt=prompt, max_tokens=2)
    finally:
        proc.terminate()
        assert proc.wait(timeout=scaled(60)) == 143
