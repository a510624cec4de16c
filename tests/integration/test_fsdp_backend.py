"""The fsdp trainer (chatgen.training.fsdp_module.FSDPModule: transformers' model under torch FSDP2)
on CPU, with the real vLLM: every family of docs/models.md syncs exactly, DP 2 trains like DP 1, a
checkpoint resumes bit for bit, and the grpo_tiny_fsdp recipe learns.

    python -m pytest tests/integration/test_fsdp_backend.py

- `chatgen check-sync --trainer-backend fsdp`: a tiny random checkpoint of each family, GPT-OSS's
  mixture of experts included (made here, head size 32, cached for the session), loads into the
  trainer, syncs by HF names into a vLLM engine on random weights (every tensor validated bit for
  bit), and the engine's greedy log-probs equal the trainer's within 1e-5 (fp32); each family also
  from 2 data-parallel ranks (the cross-process sync; Llama, GPT-OSS and Gemma 3 in the default
  suite, the others marked slow).
- DP 2 (2 spawned gloo ranks, each half the batch) takes the same steps as DP 1: loss and gradient
  norm within 1e-5 relative, weights within 1e-5 after 3 steps.
- save_checkpoint after 2 steps, then a 3rd step, equals a fresh trainer loading that checkpoint and
  taking the 3rd step: every weight bit for bit, the iteration restored; transformers loads the
  checkpoint directory as an HF model with the saved weights.
- configs/grpo_tiny_fsdp.yaml from the shipped warm start: the held-out reward rises by more than 0.3
  in 10 episodes; configs/ppo_tiny.yaml with every trainer (policy, reference, critic) on fsdp trains.
- bfloat16 mixed precision with activation checkpointing trains, fp32 weights, a bf16 sync.
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers import fsdp_train_steps, masked_batch, masked_nll
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5
SIZES = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention takes 32 and up
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
FAMILY_KEYS = {
    "gemma3_text": dict(sliding_window=64),
    "phi3": dict(head_dim=None),  # hidden_size / heads
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
}
FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "phi3",
    "olmo2",
    "smollm3",
    "gpt_oss",
]


@pytest.fixture(scope="session")
def family_root(tmp_path_factory):
    """A session directory holding one trained tokenizer, copied into each family's checkpoint."""
    from chatgen.models.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("fsdp_families")
    (root / "_tokenizer").mkdir()
    train_tokenizer(root / "_tokenizer", SIZES["vocab_size"])
    return root


def tiny_family(root: Path, family: str) -> Path:
    """A tiny random checkpoint of `family` (transformers' own config class and model), norms and biases
    perturbed so that they matter; made once per session."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / family
    if out.exists():
        return out
    keys = {k: v for k, v in {**SIZES, **FAMILY_KEYS.get(family, {})}.items() if v is not None}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(family, **keys), dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias") or name.endswith(".sinks"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    shutil.copytree(root / "_tokenizer", out)
    model.save_pretrained(out)
    return out


def check_sync(model_dir, tmp_path, dp: int) -> dict:
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 17, 99, 200], [1, 2, 3, 4, 5]))
    )
    out = tmp_path / "check.json"
    args = ["check-sync", "--trainer-backend", "fsdp", "--train-dp", str(dp), "--validate"]
    args += ["--hf-checkpoint", str(model_dir), "--input", str(prompts), "--output", str(out)]
    args += ["--max-new-tokens", "6", "--threshold", str(TOL), "--kv-cache-bytes", str(32 << 20)]
    assert main(args) == 0
    return json.loads(out.read_text())


# DP 2 (the cross-process sync from 2 spawned ranks) costs ~20 s a family on this CPU: llama, one
# MoE and one family with its own attention (sliding window, soft-capping) in the default suite
DP2_DEFAULT = ("llama", "gpt_oss", "gemma3_text")


def _dp2(family: str):
    marks = () if family in DP2_DEFAULT else (pytest.mark.slow,)
    return pytest.param(family, 2, marks=marks, id=f"{family}-2")


@pytest.mark.parametrize(
    "family, dp",
    [pytest.param(f, 1, id=f"{f}-1") for f in FAMILIES] + [_dp2(f) for f in FAMILIES],
)
def test_check_sync_fsdp_is_exact_for_every_family(family_root, tmp_path, family, dp):
    result = check_sync(tiny_family(family_root, family), tmp_path, dp)
    assert result["max_abs_logprob_diff"] <= TOL and result["validated"]
    assert result["mode"] == ("colocated" if dp == 1 else "cross-process")
    assert all(len(s["output_ids"]) == 6 for s in result["samples"])


def test_check_sync_refuses_tensor_parallel_and_an_unservable_family(family_root, tmp_path, capsys):
    from chatgen.cli import main

    model = tiny_family(family_root, "llama")
    args = ["check-sync", "--trainer-backend", "fsdp", "--hf-checkpoint", str(model)]
    args += ["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.json")]
    assert main([*args, "--train-tp", "2"]) == 2
    assert "--train-tp 2: a Megatron-only layout" in capsys.readouterr().err
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    args[args.index(str(model))] = str(deepseek)
    assert main(args) == 2
    assert "'deepseek_v3' is refused" in capsys.readouterr().err


def test_dp2_trains_like_dp1(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from chatgen.training.launcher import run_distributed

    one = fsdp_train_steps(tiny_llama_dir, 3, tmp_path / "dp1.safetensors")  # a one-rank world
    args = (tiny_llama_dir, 3, tmp_path / "dp2.safetensors")
    two = run_distributed(fsdp_train_steps, 2, args=args)[0]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=TOL), key
    assert one[2]["loss"] < one[0]["loss"]  # it trained: the equality is of something that moved
    w1, w2 = load_file(tmp_path / "dp1.safetensors"), load_file(tmp_path / "dp2.safetensors")
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < TOL


def test_a_checkpoint_resumes_bit_for_bit(tiny_llama_dir, tmp_path):
    from chatgen.training.fsdp_module import FSDPModule

    batch = masked_batch(left_padded=True)
    trainer = FSDPModule(dict(load=str(tiny_llama_dir), lr=1e-3, lr_decay_iters=4)).start()
    for _ in range(2):
        trainer.train_step(batch, masked_nll)
    trainer.save_checkpoint(tmp_path / "ckpt")
    saved = trainer.hf_state_dict()
    straight = trainer.train_step(batch, masked_nll)
    weights = trainer.hf_state_dict()
    trainer.shutdown()
    assert not (tmp_path / ".ckpt.tmp").exists()

    resumed = FSDPModule(dict(load=str(tmp_path / "ckpt"), lr=1e-3, lr_decay_iters=4)).start()
    assert resumed.iteration == 2
    again = resumed.train_step(batch, masked_nll)
    assert again == straight
    other = resumed.hf_state_dict()
    resumed.shutdown()
    assert all(torch.equal(weights[k], other[k]) for k in weights)
    # the checkpoint is an HF directory too: transformers loads the saved weights from it
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert all(torch.equal(p, saved[name]) for name, p in hf.named_parameters())


def test_grpo_tiny_fsdp_learns_from_the_warm_start(tiny_llama_dir, tmp_path, monkeypatch):
    from helpers import shipped_warm_start

    from chatgen import tasks
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    warm, data, out, episodes = shipped_warm_start(tiny_llama_dir), tmp_path / "task", tmp_path, 10
    tasks.write_task_data(str(data), n_train=256, n_eval=32, seed=1)
    items = {
        "runtime.data_path": f"{data}/train.jsonl",
        "runtime.eval_data_path": f"{data}/eval.jsonl",
        "runtime.output_dir": str(out / "run"),
        "runtime.num_episode": episodes,
        "runtime.eval_episode_interval": episodes,
        "runtime.save_episode_interval": episodes,
        "policy.load": warm,
        "policy_trainer.load": warm,
        # the rate decays over the run's 2 steps an episode, so the last evaluation is not a swing
        "policy_trainer.lr_decay_iters": 2 * episodes,
        "policy_trainer.min_lr": 2e-5,
    }
    cfg = load_config(REPO / "configs/grpo_tiny_fsdp.yaml", [f"{k}={v}" for k, v in items.items()])
    grpo.train(cfg, log=lambda *_: None)
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = {r["episode"]: r for r in map(json.loads, lines)}
    assert sorted(metrics) == list(range(episodes + 1))
    assert metrics[episodes]["eval/reward"] > metrics[0]["eval/reward"] + 0.3
    assert (out / "run" / "checkpoints").exists()


def test_ppo_with_every_trainer_on_fsdp(tiny_llama_dir, tmp_path, monkeypatch):
    """configs/ppo_tiny.yaml with policy trainer, reference and critic (FSDPCriticModule) on fsdp, in one
    process: the critic learns (its loss falls), the reference is the starting policy (KL 0 before the
    first update, > 0 after), the sync stays exact."""
    from helpers import shipped_warm_start

    from chatgen import tasks
    from chatgen.rlhf.algorithms import ppo
    from chatgen.rlhf.config import load_config

    monkeypatch.chdir(REPO)
    warm, data, out = shipped_warm_start(tiny_llama_dir), tmp_path / "task", tmp_path / "run"
    tasks.write_task_data(str(data), n_train=64, n_eval=8, seed=1)
    items = {
        "runtime.data_path": f"{data}/train.jsonl",
        "runtime.eval_data_path": "null",
        "runtime.eval_episode_interval": "null",
        "runtime.output_dir": str(out),
        "runtime.num_episode": 2,
        "runtime.save_episode_interval": "null",
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 32,
        "runtime.colocation": "[[policy, reward, policy_trainer, reference, value_trainer]]",
        "models.value_trainer.model_class": "chatgen.training.critic:FSDPCriticModule",
        "policy.load": warm,
    }
    for name in ("policy_trainer", "reference", "value_trainer"):
        items.update({f"models.{name}.backend": "fsdp", f"{name}.load": warm})
    cfg = load_config(REPO / "configs/ppo_tiny.yaml", [f"{k}={v}" for k, v in items.items()])
    ppo.train(cfg, log=lambda *_: None)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = {r["episode"]: r for r in map(json.loads, lines)}
    assert metrics[2]["value/loss"] < metrics[1]["value/loss"]
    assert metrics[1]["kl/reference"] < 1e-6 < metrics[2]["kl/reference"]
    assert max(metrics[e]["mismatch/logprob_max_abs"] for e in (1, 2)) < 1e-4


def test_bf16_mixed_precision_with_activation_checkpointing(tiny_llama_dir):
    """dtype bfloat16 is mixed precision (fp32 weights and Adam state, bf16 compute, the sync in bf16) and
    activation_recompute: full checkpoints every layer; both train (on CPU here, as on GPU)."""
    from chatgen.training.fsdp_module import FSDPModule

    config = dict(load=str(tiny_llama_dir), dtype="bfloat16", lr=1e-3, activation_recompute="full")
    trainer = FSDPModule(config).start()
    losses = [
        trainer.train_step(masked_batch(left_padded=True), masked_nll)["loss"] for _ in range(3)
    ]
    assert losses[2] < losses[0]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    weights = trainer.hf_weights()
    assert weights.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for _, t in next(iter(weights.buckets())))
    trainer.shutdown()
