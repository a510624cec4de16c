"""Llama-3.1 "llama3" RoPE scaling end to end on CPU (fp32), real megatron-core, HF transformers and vLLM.

A tiny Llama gets Llama-3.1-8B-Instruct's rope block (factor 8, low/high freq factor 1/4, original context
8192; megatron-core fixes all but the factor) and its rope_theta 500000. The scaling rewrites the inverse
frequencies whose wavelength exceeds 8192 / 4 tokens (11 of the 16 here), independently of the sequence
length, so it changes log-probs at every length. A random tiny model barely attends by position, so its q/k
weights are scaled up (attention scores x64); the tests first check that the scaling then moves log-probs
far beyond the tolerance (scaled vs plain model), then that Megatron equals HF transformers and that vLLM,
reading the same config.json itself, equals the trainer after a chatgen sync.

    python -m pytest tests/integration/test_rope_scaling.py
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.integration

TOL = 1e-4
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
SEQ = torch.Generator().manual_seed(0)
IDS = torch.randint(4, 512, (1, 300), generator=SEQ)  # (1, T) random tokens of the tiny vocab


def with_rope(src, dst, rope: dict):
    """A copy of the tiny model whose config.json carries `rope` (transformers 5 spelling: rope_parameters),
    with q/k weights x8 so that attention, hence RoPE, matters."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    # > original context, as in Llama-3.1
    cfg.update(rope_parameters=rope, max_position_embeddings=16384)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = load_file(dst / "model.safetensors")
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * 8
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {
        "llama3": with_rope(tiny_llama_dir, root / "llama3", LLAMA31_ROPE),
        "plain": with_rope(
            tiny_llama_dir, root / "plain", {"rope_type": "default", "rope_theta": 500000.0}
        ),
    }


def hf_logprobs(model_dir, ids):
    """(B, T) -> (B, T-1): log p(ids[:, t+1] | ids[:, :t+1]) from HF transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def trainer(models):
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return MegatronModule(dict(load=str(models["llama3"]))).start()


def test_megatron_matches_hf_with_llama3_rope_scaling(models, trainer):
    assert trainer.model.rotary_pos_emb.inv_freq.shape == (16,)
    scaled, plain = hf_logprobs(models["llama3"], IDS), hf_logprobs(models["plain"], IDS)
    assert (scaled - plain).abs().max() > 100 * TOL  # the scaling really changes the model
    megatron = trainer.forward_tokens({"input_ids": IDS})
    assert (megatron - scaled).abs().max() < TOL


def test_vllm_after_sync_matches_trainer_with_llama3_rope_scaling(models, trainer):
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.param_sync import sync_weights

    llm = VLLMModule(
        dict(
            load=str(models["llama3"]),
            load_format="dummy",
            enforce_eager=True,
            dtype="float32",
            seed=0,
            seq_length=512,
            kv_cache_memory_bytes=32 << 20,
            new_token_limit=True,
            max_new_tokens=6,
            logprobs_mode="raw",
        )
    ).start()
    try:  # shutting the engine down tears down torch.distributed: the trainer's forward comes first
        sync_weights(trainer, llm)
        prompt = IDS[0, :250].tolist()
        (request,) = llm.finished([{"input_ids": prompt}], greedy=True)
        out = request.outputs[0]
        new = list(out.token_ids)
        full = torch.tensor([prompt + new])
        ref = trainer.forward_tokens({"input_ids": full})[0, len(prompt) - 1 :]
    finally:
        llm.shutdown()
    vllm_lp = torch.tensor([lp[t].logprob for t, lp in zip(new, out.logprobs)])
    unscaled = hf_logprobs(models["plain"], full)[0, len(prompt) - 1 :]
    # an engine ignoring the scaling would be caught
    assert (ref - unscaled).abs().max() > 100 * TOL
    assert (ref - vllm_lp).abs().max() < TOL
