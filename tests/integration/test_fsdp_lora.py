"""LoRA through PEFT on the fsdp trainer (chatgen/training/fsdp_lora.py, docs/fsdp_backend.md#lora),
on CPU with the real PEFT and vLLM.

    python -m pytest tests/integration/test_fsdp_lora.py

- A `lora:` fsdp trainer trains only its adapters (the base forward stays the starting model's), a
  checkpoint resumes bit for bit, its `adapter/` loads in PEFT's PeftModel on the HF base with the
  trainer's log-probs (1e-4), and a checkpoint of other `lora:` keys is refused.
- At DP 2 (2 spawned gloo ranks, each half the batch) it takes DP 1's steps: loss and gradient norm
  within 1e-5 relative, merged weights within 1e-5.
- `chatgen check-sync --trainer-backend fsdp --lora 4`: random adapters synced merged (every
  tensor validated) give the engine's log-probs the trainer's within 1e-5; adapter-only (vLLM's LoRA
  path, the engine on its base weights) within 1e-4.
"""

import json

import pytest
from helpers import fsdp_train_steps, masked_batch, masked_nll
import torch

pytestmark = pytest.mark.integration

LORA = dict(rank=4, alpha=8.0)


def test_lora_on_fsdp_trains_the_adapter_and_resumes_bit_for_bit(tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from chatgen.training.fsdp_module import FSDPModule

    config = dict(load=str(tiny_llama_dir), lr=1e-2, lr_decay_iters=4, lora=LORA)
    batch = masked_batch(vocab=200)
    plain = FSDPModule(dict(load=str(tiny_llama_dir))).start()
    start = plain.forward_tokens(batch)
    plain.shutdown()

    trainer = FSDPModule(config).start()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    losses = [trainer.train_step(batch, masked_nll)["loss"] for _ in range(2)]
    assert losses[1] < losses[0]
    assert torch.equal(trainer.base_forward_tokens(batch), start)  # the base is frozen
    trainer.save_checkpoint(tmp_path / "ckpt")
    saved = trainer.forward_tokens(batch)
    straight = trainer.train_step(batch, masked_nll)
    weights = trainer.hf_state_dict()
    trainer.shutdown()

    resumed = FSDPModule({**config, "load": str(tmp_path / "ckpt")}).start()
    assert resumed.iteration == 2 and resumed.train_step(batch, masked_nll) == straight
    other = resumed.hf_state_dict()
    resumed.shutdown()
    assert weights.keys() == other.keys() and all(
        torch.equal(weights[k], other[k]) for k in weights
    )

    # the checkpoint's adapter/ is PEFT's: PeftModel on the HF base scores as the trainer did
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "ckpt" / "adapter").eval()
    with torch.no_grad():
        logits = peft(input_ids=batch["input_ids"]).logits[:, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    assert (ref - saved).abs().max() < 1e-4

    with pytest.raises(ValueError, match="holds a trainer with lora"):
        FSDPModule({**config, "load": str(tmp_path / "ckpt"), "lora": dict(rank=8)}).start()


@pytest.mark.parametrize("mode, tol", [("merged", 1e-5), ("adapter", 1e-4)])
def test_check_sync_fsdp_lora(tiny_llama_dir, tmp_path, mode, tol):
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 17, 99, 200], [1, 2, 3, 4, 5]))
    )
    out = tmp_path / "check.json"
    args = ["check-sync", "--trainer-backend", "fsdp", "--lora", "4", "--lora-sync", mode]
    args += ["--validate", "--hf-checkpoint", str(tiny_llama_dir), "--input", str(prompts)]
    args += ["--output", str(out), "--max-new-tokens", "6", "--threshold", str(tol)]
    args += ["--kv-cache-bytes", str(32 << 20)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["max_abs_logprob_diff"] <= tol and result["validated"]
    # merged: every HF weight; adapter-only: A and B of 7 targets x 2 layers
    assert result["sync_tensors"] == (28 if mode == "adapter" else 21)


def test_lora_at_dp2_trains_like_dp1(tiny_llama_dir, tmp_path):
    """2 spawned gloo ranks, each half the batch, take DP 1's steps: loss, gradient norm (of the
    adapters: all that trains) within 1e-5 relative, merged weights within 1e-5 after 3 steps."""
    from safetensors.torch import load_file

    from chatgen.training.launcher import run_distributed

    config = dict(lr=1e-2, lora=LORA)
    one = fsdp_train_steps(tiny_llama_dir, 3, tmp_path / "dp1.safetensors", config)
    args = (tiny_llama_dir, 3, tmp_path / "dp2.safetensors", config)
    two = run_distributed(fsdp_train_steps, 2, args=args)[0]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
    assert one[2]["loss"] < one[0]["loss"]  # it trained: the equality is of something that moved
    w1, w2 = load_file(tmp_path / "dp1.safetensors"), load_file(tmp_path / "dp2.safetensors")
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
