"""`chatgen.VLLMGeneration` in colocate mode on CPU with the real vLLM and transformers: generate's layout, its
prompts as token ids, strings or chats and its per-call sampling, sync_weights from a transformers model (log-probs equal a transformers forward pass within 1e-4, fp32), the
prefix cache reset after a sync, and refused syncs that leave the engine's weights alone.

    python -m pytest tests/integration/test_vllm_generation.py
"""

import pytest
import torch
from helpers import TOL, max_diff_vs_hf, perturbed, quick_warm_start

pytestmark = pytest.mark.integration

BLOCK = 32  # KV block size: prompts longer than a block hit vLLM's prefix cache on a repeat
PROMPTS = [list(range(10, 10 + 2 * BLOCK + 5)), [5, 17, 99, 200, 301, 7]]


@pytest.fixture(scope="module")
def gen(chat_model_dir):  # the tiny Llama with a chat template
    from chatgen import VLLMGeneration

    g = VLLMGeneration(
        chat_model_dir,
        max_completion_length=8,
        max_model_length=128,
        enforce_eager=True,
        block_size=BLOCK,
        kv_cache_memory_bytes=16 << 20,
        seed=0,
    )
    yield g
    g.shutdown()


@pytest.fixture()
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_generate_is_prompt_major_with_a_logprob_per_token(gen):
    prompt_ids, completion_ids, logprobs = gen.generate(PROMPTS, num_generations=3)
    assert prompt_ids == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len(completion_ids) == len(logprobs) == 6
    for completion, lps in zip(completion_ids, logprobs):
        assert 1 <= len(completion) <= 8 and len(lps) == len(completion)
        assert all(lp <= 0 for lp in lps)
    greedy = gen.generate(PROMPTS, greedy=True)
    assert greedy == gen.generate(PROMPTS, greedy=True)  # deterministic
    assert [len(x) for x in greedy] == [2, 2, 2]


def test_bad_calls_name_the_argument(gen):
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty list of token ids"):
        gen.generate([[1, 2], []])
    with pytest.raises(
        ValueError, match=r"prompts\[0\] is a chat whose messages need 'role' and 'content'"
    ):
        gen.generate([[{"content": "hi"}]])
    with pytest.raises(ValueError, match="greedy decoding gives one completion per prompt"):
        gen.generate(PROMPTS, num_generations=2, greedy=True)
    with pytest.raises(ValueError, match="generate: temperature=0 decodes greedily"):
        gen.generate(PROMPTS, num_generations=2, temperature=0)
    with pytest.raises(ValueError, match=r"generate: top_p=0; use a value in \(0, 1\]"):
        gen.generate(PROMPTS, top_p=0)
    with pytest.raises(
        ValueError, match="generate: max_completion_length=0; ask for at least 1 token"
    ):
        gen.generate(PROMPTS, max_completion_length=0)


def test_prompts_as_strings_or_chats_and_sampling_per_call(gen):
    tokenizer = gen.module.tokenizer
    chat = [{"role": "user", "content": "Say something"}]
    text_ids = tokenizer.encode("Once upon a time")
    chat_ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    mixed = gen.generate(["Once upon a time", chat, PROMPTS[1]], greedy=True)
    assert mixed[0] == [text_ids, chat_ids, PROMPTS[1]]
    assert mixed == gen.generate([text_ids, chat_ids, PROMPTS[1]], greedy=True)
    # this call's settings, then the constructor's again (temperature 1, 8 tokens)
    assert gen.generate(PROMPTS, temperature=0) == gen.generate(PROMPTS, greedy=True)
    short = gen.generate(PROMPTS, greedy=True, max_completion_length=3)
    assert [len(c) for c in short[1]] == [3, 3] and all(
        c[:3] == s for c, s in zip(mixed[1][2:], short[1][1:])
    )
    assert [len(c) for c in gen.generate(PROMPTS, greedy=True)[1]] == [8, 8]
    assert gen.module.config.temperature == 1.0 and gen.module.config.max_new_tokens == 8


def test_sync_from_transformers_matches_a_transformers_forward_pass(gen, hf_model):
    # fills the prefix cache with KV of the current weights
    before = gen.generate(PROMPTS, greedy=True)
    model = perturbed(hf_model, seed=1)
    report = gen.sync_weights(model)
    assert report.tensors == len(list(model.parameters()))
    after = gen.generate(PROMPTS, greedy=True)
    assert after[2] != before[2]  # the weights changed
    # including the long prompt, whose cached KV was reset
    assert max_diff_vs_hf(model, *after) < TOL
    # sampled, temperature 1
    assert max_diff_vs_hf(model, *gen.generate(PROMPTS, num_generations=2)) < TOL
    # every linear layer of the tiny model is under SMALL_LINEAR_MAX_BYTES: each ran the bucketed oneDNN
    # matmul (small_linears.bucketed_small_linears), and the sync's reload built it again on the new weights (the
    # outputs above match HF's)
    bucketed = gen.module.engine.collective_rpc(_bucketed_linears)[0]
    assert bucketed and all(bucketed.values()), bucketed


def _bucketed_linears(worker) -> dict:
    """In the vLLM worker: {layer name: runs the bucketed oneDNN matmul} for every layer with a CPU GEMM
    dispatch."""
    return {
        name: getattr(m.cpu_linear, "chatgen_bucketed", False)
        for name, m in worker.model_runner.get_model().named_modules()
        if hasattr(m, "cpu_linear")
    }


def test_vllm_reload_alone_keeps_the_stale_prefix_cache(gen, hf_model):
    """Why a sync resets the prefix cache (engine_loop): vLLM 0.32's reload does not. If this starts failing,
    vLLM resets it itself and chatgen's reset is redundant."""
    llm, on_engine_thread = gen.module.engine, gen.module.engine_loop.call
    model = perturbed(hf_model, seed=2)
    gen.generate(PROMPTS, greedy=True)  # cache the long prompt's KV under the current weights
    on_engine_thread(
        lambda: llm.collective_rpc(
            "reload_weights",
            kwargs=dict(weights_iterator=list(model.named_parameters()), is_checkpoint_format=True),
        )
    )
    stale = gen.generate([PROMPTS[0]], greedy=True)
    assert max_diff_vs_hf(model, *stale) > 10 * TOL
    on_engine_thread(llm.reset_prefix_cache)
    assert max_diff_vs_hf(model, *gen.generate([PROMPTS[0]], greedy=True)) < TOL


@pytest.mark.parametrize("fault", ["wrong name", "wrong shape"])
def test_refused_sync_keeps_the_old_weights(gen, hf_model, fault):
    from chatgen.param_sync import SyncError

    before = gen.generate(PROMPTS, greedy=True)
    state = dict(perturbed(hf_model, seed=3).named_parameters())
    if fault == "wrong name":
        state["model.layers.0.mlp.gate.weight"] = state.pop("model.layers.0.mlp.gate_proj.weight")
        expected = "model.layers.0.mlp.gate.weight: trainer sends shape .* has no such parameter"
    else:
        state["model.norm.weight"] = torch.ones(7)
        expected = r"model.norm.weight: trainer sends shape \(7,\), the engine expects"
    with pytest.raises(SyncError, match=expected):
        gen.sync_weights(list(state.items()))
    assert gen.generate(PROMPTS, greedy=True) == before


def test_grpo_with_hf_trainer_example_runs(tiny_llama_dir, tmp_path):
    """examples/grpo_with_hf_trainer.py, two short steps: rewards computed, weights synced (after a sync the
    engine's log-probs equal the trained model's), held-out reward measured."""
    from chatgen import tasks
    from chatgen.core.jsonl import read_prompt_records
    from examples.grpo_with_hf_trainer import main

    data = tmp_path / "data"
    tasks.write_task_data(str(data), n_train=64, n_eval=8)
    model = quick_warm_start(
        tiny_llama_dir, read_prompt_records(data / "sft.jsonl"), tmp_path / "model"
    )
    history = main(
        [
            "--model",
            str(model),
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts",
            "4",
            "--group",
            "4",
            "--eval-every",
            "1",
            "--eval-prompts",
            "8",
            "--output",
            str(tmp_path / "m.jsonl"),
        ]
    )
    assert [r["step"] for r in history] == [0, 1, 2]
    assert all(0 <= r["eval_reward"] <= 1 for r in history)
    for r in history[:2]:
        assert 0 <= r["reward"] <= 1 and r["synced_tensors"] == 21
    assert history[0]["loss"] != 0  # the rewards varied: step 0 changed the model ...
    # ... and its sync reached the engine (without it: ~1)
    assert history[1]["logprob_mismatch"] < TOL
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
