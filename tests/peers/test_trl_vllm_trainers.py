"""TRL's vLLM trainer tests (huggingface/trl f2cd577: tests/test_grpo_trainer.py::test_train_vllm,
test_train_vllm_and_peft; tests/test_rloo_trainer.py's) on chatgen's TRL facade: TRL 1.16's own GRPOTrainer and
RLOOTrainer with use_vllm=True (colocate, TRL's default) and TRL's defaults, the one change being the import
(trl's trainers bind `VLLMGeneration`; here chatgen.compat.trl's, with the CPU's KV-cache size). The hub's
Qwen2.5-0.5B, zen dataset and reward model are replaced by the tiny models, a few local prompts and a reward
function; the checks are TRL's: a loss logged, every trainable parameter changed (PEFT: the base unchanged).

    python -m pytest tests/peers/test_trl_vllm_trainers.py      # ~1 min on 2 idle CPU cores
"""

import functools

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl==1.16.0)")

from chatgen.compat.trl import VLLMGeneration  # noqa: E402 - TRL: trl.generation.vllm_generation

pytestmark = pytest.mark.integration
PROMPTS = ["sort: 3 1 2 =", "Once upon a time", "The cat", "hello", "1 2 3", "a b c"]


@pytest.fixture
def facade(monkeypatch):
    """TRL's trainers generate with chatgen's VLLMGeneration (eager, a 32 MiB CPU KV cache)."""
    from trl.trainer import grpo_trainer, rloo_trainer

    cpu = functools.partial(VLLMGeneration, enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    made = []

    def build(*args, **kwargs):
        made.append(cpu(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", build)
    monkeypatch.setattr(rloo_trainer, "VLLMGeneration", build)
    yield made
    for generation in made:
        generation.shutdown()


def digits(completions, **kwargs):
    return [float(sum(c.count(d) for d in "0123456789")) + len(c) / 100 for c in completions]


def train(kind, model, tmp_path, peft_config=None):
    from datasets import Dataset

    config_cls = getattr(trl, f"{kind}Config")
    trainer_cls = getattr(trl, f"{kind}Trainer")
    args = config_cls(
        output_dir=str(tmp_path),
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        report_to="none",
        use_vllm=True,
        max_steps=2,
        use_cpu=True,  # the CPU fixture: TRL's CI trains on a GPU (bf16 there)
        bf16=False,
    )
    return trainer_cls(
        model=model,
        reward_funcs=digits,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config,
    )


@pytest.mark.parametrize("kind", ["GRPO", "RLOO"])
def test_train_vllm(kind, facade, tiny_llama_dir, tmp_path):
    trainer = train(kind, str(tiny_llama_dir), tmp_path)
    assert facade and trainer.vllm_generation is facade[0]
    assert trainer.vllm_generation.llm.llm_engine.model_config.max_model_len == 512
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous.items():
        assert not torch.equal(param, trainer.model.get_parameter(n)), f"{n} has not changed."


@pytest.mark.parametrize("kind", ["GRPO", "RLOO"])
def test_train_vllm_and_peft_tied_embeddings(kind, facade, tiny_qwen3_dir, tmp_path):
    """TRL's PEFT test (LoRA on every linear layer) on a model with tied embeddings (as Qwen2.5-0.5B):
    the sync sends the merged weights; the tied lm_head.weight is the engine's embedding."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype="float32")
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    trainer = train(kind, model, tmp_path, LoraConfig(target_modules="all-linear"))
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n and "original_module" not in n:
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
