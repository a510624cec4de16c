"""LoRA adapters entering an engine (issue 50, findings 3, 4 and 10), the real vLLM and peft on CPU with
the tiny Llama:

- a NaN adapter is refused before it is applied, naming the tensor, by every way one enters: `chatgen
  serve --lora-modules`, `VLLMModule.load_lora_adapter`, `load_lora_tensors`; the engine answers as before;
- after a full weight sync an engine holding an in-memory adapter still samples with it (it used to fail
  every later generate with LoRAAdapterNotFoundError);
- the TRL facade refuses to sync a PEFT model whose adapter is NaN and leaves the model's weights as they
  were (they used to stay NaN after the merge and unmerge).

    pytest tests/integration/test_faults_adapters.py
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from chatgen.config import ConfigError
from chatgen.models.lora_format import CONFIG_FILE, WEIGHTS_FILE, peft_config, peft_name

pytestmark = [pytest.mark.integration, pytest.mark.faults]
PROMPTS = [[1, 5, 9, 13], [1, 7, 3]]


def adapter(model_dir, nan: bool = False) -> tuple[dict, dict]:
    """A rank-4 adapter of q_proj and v_proj in every layer, large enough to change the answers."""
    hf = json.loads((model_dir / "config.json").read_text())
    hidden, heads = hf["hidden_size"], hf["head_dim"]
    out = {"q_proj": hf["num_attention_heads"] * heads, "v_proj": hf["num_key_value_heads"] * heads}
    gen, tensors = torch.Generator().manual_seed(0), {}
    for layer in range(hf["num_hidden_layers"]):
        for module, rows in out.items():
            weight = f"model.layers.{layer}.self_attn.{module}.weight"
            tensors[peft_name(weight, "lora_A")] = torch.randn(4, hidden, generator=gen)
            tensors[peft_name(weight, "lora_B")] = torch.randn(rows, 4, generator=gen)
    if nan:
        tensors[peft_name("model.layers.1.self_attn.v_proj.weight", "lora_B")][0, 0] = float("nan")
    return peft_config(4, 8.0, 0.0, out, model_dir), tensors


def write_peft(directory, config, tensors):
    directory.mkdir()
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / WEIGHTS_FILE)
    return directory


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from chatgen.generation.vllm.module import VLLMModule

    module = VLLMModule(
        dict(
            load=str(tiny_llama_dir),
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_cache_memory_bytes=32 << 20,
            temperature=0.0,
            new_token_limit=True,
            max_new_tokens=6,
            enable_lora=True,
            max_lora_rank=8,
        )
    ).start()
    yield module
    module.shutdown()


def answers(engine) -> list:
    outs = engine.finished([{"input_ids": p} for p in PROMPTS], greedy=True)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_nan_adapter_is_refused_by_every_way_in_and_the_engine_answers_as_before(
    engine, tiny_llama_dir, tmp_path
):
    from chatgen.cli.serve import lora_modules

    base = answers(engine)
    bad_dir = write_peft(tmp_path / "bad", *adapter(tiny_llama_dir, nan=True))
    with pytest.raises(ConfigError, match=r"--lora-modules bad: .*NaN or inf .*v_proj\.lora_B"):
        lora_modules([f"bad={bad_dir}"], "tiny")
    with pytest.raises(ConfigError, match=r"NaN or inf in 1 tensor\(s\): .*layers\.1.*v_proj"):
        engine.load_lora_adapter(bad_dir)
    with pytest.raises(ValueError, match=r"load_lora_tensors: the LoRA adapter holds NaN or inf"):
        engine.load_lora_tensors(*adapter(tiny_llama_dir, nan=True))
    assert answers(engine) == base and engine.engine_loop.lora_request is None


def test_a_held_adapter_survives_a_full_weight_sync(engine, tiny_llama_dir):
    from safetensors.torch import load_file

    base = answers(engine)
    engine.load_lora_tensors(*adapter(tiny_llama_dir))
    adapted = answers(engine)
    assert adapted != base  # the adapter is applied
    weights = {}
    for f in sorted(tiny_llama_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    engine.load_weights([list(weights.items())])  # the same weights, all of them
    assert answers(engine) == adapted  # still the adapter on top of the (same) base


def test_the_trl_facade_refuses_a_nan_adapter_and_leaves_the_model_as_it_was(tiny_llama_dir):
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatgen.compat.trl import VLLMGeneration
    from chatgen.param_sync import SyncError

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    generation = VLLMGeneration(
        model,
        Accelerator(cpu=True),
        False,
        AutoTokenizer.from_pretrained(tiny_llama_dir),
        max_completion_length=4,
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
    )
    try:
        lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
        with torch.no_grad():
            lora_b[0, 0] = float("nan")
        with pytest.raises(SyncError, match=r"the engine and the model are as they were.*lora_B"):
            generation.sync_weights()
        after = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        generation.shutdown()
