"""A ChatLearn-style model file runs unchanged but for its import (issue 11), on the real vLLM and the tiny Llama.

    .venv/bin/python -m pytest tests/integration/test_chatlearn_port.py

tests/data/chatlearn_style/vllm_policy_inference.py is written in ChatLearn v1.0's idiom and configured by the
ChatLearn-style YAML chain beside it (read with the chatlearn dialect; values through its env names).
"""

import json
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STYLE = REPO / "tests" / "data" / "chatlearn_style"
PROMPTS = ["sort: 3 1 2 =", "sort: 9 4 =", "hello"]


@pytest.fixture
def chain_env(monkeypatch, tiny_llama_dir):
    """The chain's variables as a ChatLearn launch script would export them; the style module importable."""
    for path in STYLE.glob("*.yaml"):
        for name in set(re.findall(r"\$\{(\w+)", path.read_text())):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CS_MODEL_DIR", str(tiny_llama_dir))
    monkeypatch.setenv("CS_SEQ_LEN", "128")
    monkeypatch.setenv("CS_MAX_NEW", "8")
    monkeypatch.setenv("CS_GPU_UTIL", "0.9")
    monkeypatch.syspath_prepend(str(STYLE))
    return monkeypatch


class Recording:
    """Mixin recording how the framework calls the ChatLearn hooks (the model file itself stays as written)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _add_request(self, data, is_eval=False):
        self.calls.append(("_add_request", type(data).__name__, is_eval))
        return super()._add_request(data, is_eval)

    def forward_step(self, data, iteration=0):
        self.calls.append(("forward_step", iteration))
        return super().forward_step(data, iteration)

    def eval_forward(self, data, iteration=0):
        self.calls.append(("eval_forward", iteration))
        return super().eval_forward(data, iteration)


def test_chatlearn_style_module_runs_unchanged(chain_env):
    from vllm_policy_inference import StylePolicyInference

    class Recorded(Recording, StylePolicyInference):
        pass

    module = Recorded(str(STYLE / "sampler.yaml"), config_dialect="chatlearn").start()
    try:
        args = module.model_args
        # user keys
        assert (args["samples_per_prompt"], args["shuffle_mode"], args["kl_target"]) == (
            3,
            1,
            0.05,
        )
        # typed keys, same mapping
        assert (args["seq_length"], args["max_new_tokens"], args["n"]) == (
            128,
            8,
            2,
        )
        with pytest.raises(TypeError):
            args["n"] = 4  # read-only: the config is the one place to change it
        assert module.tokenizer.tokenizer.eos_token_id == module.tokenizer.eos_token_id

        items = module.prepare_dataset(PROMPTS)
        # build_dataset repeated each prompt samples_per_prompt times
        assert len(items) == 3 * len(PROMPTS)
        out = module.run_generation(items)
        samples = 3 * len(PROMPTS) * 2  # x n
        assert out["all_tokens"].shape == (samples, 128) and out["logprobs"].shape == (samples, 127)
        assert len(out["str_outputs"]) == samples and set(out["str_prompts"]) == set(PROMPTS)
        # vLLM's log-probs of the sampled tokens sit at their positions: <= 0, and 0 only where nothing was sampled
        lengths = out["loss_mask"].sum(1)
        assert (lengths > 0).all() and (out["logprobs"] <= 0).all()
        assert out["logprobs"][out["loss_mask"][:, 1:].bool()].lt(0).float().mean() > 0.9

        train_calls = list(module.calls)
        # the dataset's collate_fn made the batch
        assert train_calls[0] == (
            "_add_request",
            "defaultdict",
            False,
        )
        steps = [c[1] for c in train_calls[1:]]
        assert [c[0] for c in train_calls[1:]] == ["forward_step"] * len(steps) and steps == list(
            range(len(steps))
        )

        module.calls.clear()
        evaluation = module.run_generation(
            module.prepare_dataset(PROMPTS, is_eval=True), is_eval=True
        )
        assert evaluation["all_tokens"].shape[0] == len(PROMPTS) * 2  # eval: no repetition
        assert module.calls[0] == ("_add_request", "defaultdict", True)
        eval_steps = module.calls[1:]
        # eval steps: eval_forward
        assert eval_steps and all(name == "eval_forward" for name, _ in eval_steps)
        # iteration counts over the module's life, as ChatLearn's does: the eval call continues the count
        assert [i for _, i in eval_steps] == list(range(len(steps), len(steps) + len(eval_steps)))
    finally:
        module.shutdown()


def test_chatgen_generate_runs_a_users_module_with_a_chatlearn_yaml(
    chain_env, tiny_llama_dir, tmp_path, capsys
):
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    rc = main(
        [
            "generate",
            "--module",
            "vllm_policy_inference:StylePolicyInference",
            "--config",
            str(STYLE / "sampler.yaml"),
            "--config-dialect",
            "chatlearn",
            "--model",
            str(tiny_llama_dir),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "enforce_eager=true",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the module's own decode_internal: one line per sample
    assert len(rows) == 3 * len(PROMPTS) * 2
    assert {"all_tokens", "str_outputs", "logprobs", "loss_mask"} <= set(rows[0])
    assert len(rows[0]["all_tokens"]) == 128 and all(
        isinstance(r["str_outputs"], str) for r in rows
    )


def test_chatgen_generate_refuses_a_class_that_is_not_a_vllm_module(
    tiny_llama_dir, tmp_path, capsys
):
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    rc = main(
        [
            "generate",
            "--module",
            "chatgen.rlhf.rewards:RuleReward",
            "--model",
            str(tiny_llama_dir),
            "--input",
            str(prompts),
            "--output",
            str(tmp_path / "out.jsonl"),
        ]
    )
    assert rc != 0 and "not a subclass of chatgen.VLLMModule" in capsys.readouterr().err


def test_vllm_starts_from_a_megatron_checkpoint(tiny_llama_dir, tmp_path):
    """`load` = a chatgen Megatron checkpoint (TP 2 x PP 2 here): same greedy tokens and log-probs as from HF."""
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.models.convert import hf_to_megatron_dir

    checkpoint = hf_to_megatron_dir(tiny_llama_dir, tmp_path / "megatron", tp=2, pp=2)
    config = dict(
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seq_length=128,
        new_token_limit=True,
        max_new_tokens=8,
        logprobs_mode="raw",
        ignore_eos=True,
        eval_temperature=0.0,
    )
    results = []
    for load in (tiny_llama_dir, checkpoint):
        module = VLLMModule({**config, "load": str(load)}).start()
        try:
            batch = module.run_generation(module.prepare_dataset(PROMPTS), is_eval=True)
            results.append((batch.input_ids, batch.infer_logprobs, module.tokenizer is not None))
            engine_dir = module._engine_dir
        finally:
            module.shutdown()
    (ids_hf, lp_hf, tok_hf), (ids_mg, lp_mg, tok_mg) = results
    assert tok_hf and tok_mg  # the checkpoint's tokenizer files came along
    assert torch.equal(ids_hf, ids_mg)
    assert (lp_hf - lp_mg).abs().max() < 1e-5
    # the temporary HF view is removed
    assert engine_dir is not None and not Path(engine_dir).exists()
