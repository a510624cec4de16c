"""`chatgen import-gguf` on SmolLM2-135M-Instruct (the `smollm2_dir` fixture): the fp32 directory it writes
answers a chat question greedily in vLLM (through VLLMModule and the model's chat template) exactly as
HF transformers does.

    .venv/bin/python -m pytest tests/integration/test_smollm2.py
"""

import json

import pytest
import torch
from safetensors import safe_open

from chatgen.generation.vllm.module import VLLMModule
from chatgen.serving.embedded import EmbeddedServer

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


def test_imported_smollm2_answers_like_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and len(names) == 2 + 9 * config["num_hidden_layers"]

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(**prompt, max_new_tokens=24, do_sample=False)
    hf_answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    del hf

    module = VLLMModule(
        dict(
            load=str(smollm2_dir),
            kv_cache_memory_bytes=128 << 20,
            enforce_eager=True,
            seq_length=256,
            new_token_limit=True,
            max_new_tokens=24,
            chat_template=True,
            seed=0,
        )
    ).start()
    try:
        assert module.build_dataset([QUESTION])[0]["input_ids"] == prompt["input_ids"][0].tolist()
        [answer] = module.generate_text([QUESTION], greedy=True)
    finally:
        module.shutdown()
    assert answer == hf_answer
    assert "Paris" in answer


def test_smollm2_over_the_openai_server(smollm2_dir):
    """SmolLM2 behind chatgen's OpenAI server (its own ChatML template), with the official `openai` client: the
    greedy answer names Paris, streaming gives the same text, and a second turn that carries the first turn's
    token ids gets a prompt that begins with exactly those ids (token-exact multi-turn on a real template)."""
    import openai

    module = VLLMModule(
        dict(
            load=str(smollm2_dir),
            kv_cache_memory_bytes=128 << 20,
            enforce_eager=True,
            seq_length=512,
            temperature=1.0,
            seed=0,
        )
    ).start()
    server = None
    try:
        server = EmbeddedServer(module, api_key="k", model_name="smollm2")
        client = openai.OpenAI(base_url=server.url, api_key="k")
        messages = [{"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        message = first.choices[0].message
        assert "Paris" in message.content
        extra = message.model_extra
        ids = module.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        assert extra["prompt_token_ids"] == list(ids)  # rendered with SmolLM2's own chat template
        assert len(extra["generation_token_ids"]) == len(extra["generation_log_probs"]) > 0

        streamed = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            == message.content
        )

        follow = [
            *messages,
            {
                "role": "assistant",
                "content": message.content,
                "prompt_token_ids": extra["prompt_token_ids"],
                "generation_token_ids": extra["generation_token_ids"],
            },
            {"role": "user", "content": "And of Italy?"},
        ]
        second = client.chat.completions.create(
            model="smollm2", messages=follow, max_tokens=16, temperature=0
        )
        prefix = extra["prompt_token_ids"] + extra["generation_token_ids"]
        assert second.choices[0].message.model_extra["prompt_token_ids"][: len(prefix)] == prefix
        assert "Rome" in second.choices[0].message.content
    finally:
        if server is not None:
            server.close()
        module.shutdown()
