"""TRL's merged VLLMGeneration (trl/generation/vllm_generation.py) on chatgen: a small GRPO loop written against
TRL's class (generate, an optimizer step on the HF model, sync_weights()) runs on chatgen.compat.trl with the real
vLLM on CPU and the tiny Llama; after every sync the engine's log-probs are the updated model's.

    python -m pytest tests/integration/test_trl_merged_api.py        # ~20 s on 2 idle CPU cores
"""

import pytest
import torch
from helpers import max_diff_vs_hf

from chatgen.compat.trl import VLLMGeneration  # TRL: from trl.generation.vllm_generation import ...

pytestmark = pytest.mark.integration
SYNC_TOL = 1e-4  # fp32: vLLM vs transformers log-probs of the same weights differ by ~1e-6


def test_a_grpo_loop_written_for_trls_class(tiny_llama_dir):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    accelerator = Accelerator(cpu=True)
    generation = VLLMGeneration(
        model,
        accelerator,
        False,
        tokenizer,
        temperature=1.0,
        max_completion_length=12,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    G = 4  # noqa: N806 - TRL's num_generations
    texts = ["sort: 3 1 2 =", "Once upon a time"]
    try:
        for step in range(2):
            prompts = [tokenizer(t)["input_ids"] for t in texts for _ in range(G)]
            prompt_ids, completion_ids, logprobs, logprob_token_ids = generation.generate(
                prompts, None, G
            )
            assert prompt_ids == prompts and len(completion_ids) == len(prompts)
            assert all(
                len(lp) == len(c) and all(len(t) == 1 for t in lp)
                for lp, c in zip(logprobs, completion_ids)
            )
            assert [[t[0] for t in ids] for ids in logprob_token_ids] == completion_ids
            # the engine samples what the trainer's current weights give
            flat = [[t[0] for t in lp] for lp in logprobs]
            assert max_diff_vs_hf(model.eval(), prompt_ids, completion_ids, flat) < SYNC_TOL

            # GRPO: a reward (count of digits), advantages within each group of G, the policy-gradient step
            rewards = torch.tensor(
                [
                    float(sum(tokenizer.decode(c).count(d) for d in "0123456789")) + len(c) / 100
                    for c in completion_ids
                ]
            ).view(-1, G)
            advantages = (
                (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
            ).view(-1)
            model.train()
            loss = 0.0
            for p, c, a in zip(prompt_ids, completion_ids, advantages):
                full = torch.tensor([p + c])
                logits = model(full).logits[0, len(p) - 1 : -1]
                token_lp = torch.log_softmax(logits, -1).gather(-1, full[0, len(p) :, None]).sum()
                loss = loss - a * token_lp / len(prompt_ids)
            before = model.lm_head.weight.detach().clone()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert not torch.equal(before, model.lm_head.weight)  # the step moved the model
            generation.sync_weights()  # TRL's call: no argument, it reads the wrapped model
        assert generation.engine.module.weight_version == 2
    finally:
        generation.shutdown()


def test_what_chatgens_engine_does_not_do_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="structured_outputs_regex is not supported"):
        VLLMGeneration(object(), None, False, None, structured_outputs_regex="[0-9]+")
    with pytest.raises(ValueError, match="logprobs=5 is not supported"):
        VLLMGeneration(object(), None, False, None, logprobs=5)
    with pytest.raises(ValueError, match="name_or_path"):
        VLLMGeneration(object(), None, False, None)
