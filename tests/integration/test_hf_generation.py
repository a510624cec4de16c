"""The hf backend (`backend: hf`, HFGeneration) on the tiny models: against vLLM's VLLMModule, against a plain
transformers forward, and through the weight sync (with Megatron: test_hf_runs.py).

    .venv/bin/python -m pytest tests/integration/test_hf_generation.py

Both backends run the same prompts with the same keys; greedy tokens must be equal and log-probs within float
noise. Sampled tokens cannot be compared across backends (different random streams): their log-probs are checked
against the model's own forward pass instead.
"""

import asyncio
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.generation.hf.module import HFGeneration  # noqa: E402
from chatgen.param_sync import SyncError, sync_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Once upon a time",
    "The cat sat on the mat",
    "hello",
    "A tiny model learns to count: one, two,",
]
MAX_NEW = 12
TOL = 1e-4  # fp32: two implementations of the same model differ by ~1e-6


def keys(model_dir, **overrides) -> dict:
    return {
        "load": str(model_dir),
        "seq_length": 128,
        "new_token_limit": True,
        "max_new_tokens": MAX_NEW,
        "logprobs_mode": "raw",
        "seed": 0,
        **overrides,
    }


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    module = HFGeneration(keys(tiny_llama_dir)).start()
    yield module
    module.shutdown()


@pytest.fixture(scope="module")
def vllm(tiny_llama_dir):
    from chatgen.generation.vllm.module import VLLMModule

    module = VLLMModule(
        keys(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, enforce_eager=True)
    ).start()
    yield module
    module.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def padded(module, prompts=PROMPTS, stop_strings=None) -> dict:
    """Right-padded (B, T) input_ids and (B,) input_lengths of the tokenized prompts."""
    ids = [item["input_ids"] for item in module.build_dataset(prompts)]
    input_ids = torch.full((len(ids), max(map(len, ids))), module.pad_token_id, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    batch = {"input_ids": input_ids, "input_lengths": torch.tensor([len(r) for r in ids])}
    return {**batch, "stop_strings": stop_strings} if stop_strings else batch


def model_logprobs(model, tokens) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one unpadded forward of a transformers model."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def assert_same_generation(ours, theirs):
    """Equal tokens, lengths and truncation; generated-token log-probs within TOL."""
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert ours[key].equal(theirs[key]), key
    # 0 on prompt and padding only
    assert ours["logprobs"].lt(0).sum() == ours["generation_lengths"].sum()
    diff = (ours["logprobs"] - theirs["logprobs"]).abs().max().item()
    assert diff <= TOL, f"max |dlogprob| hf vs vLLM = {diff:.2e}"


# ---------------------------------------------------------------- hf == vLLM


def test_greedy_tokens_and_logprobs_equal_vllms(hf, vllm, monkeypatch):
    batch = padded(hf)
    assert_same_generation(hf.generate(batch, greedy=True), vllm.generate(batch, greedy=True))
    for module in (hf, vllm):
        monkeypatch.setattr(module.config, "prompt_logprobs", 0)
    ours, theirs = hf.generate(batch, greedy=True), vllm.generate(batch, greedy=True)
    assert (ours["prompt_logprobs"] - theirs["prompt_logprobs"]).abs().max().item() <= TOL
    assert ours["prompt_logprobs"][:, 1].lt(0).all()  # real values, not zeros on both sides
    # a repetition penalty (on the prompt's tokens and the output's so far) changes the greedy path the same way
    for module in (hf, vllm):
        monkeypatch.setattr(module.config, "repetition_penalty", 1.5)
    ours = hf.generate(batch, greedy=True)
    assert_same_generation(ours, vllm.generate(batch, greedy=True))
    assert not ours["output_ids"].equal(theirs["output_ids"])


def test_stop_strings_and_a_stop_token_equal_vllms(hf, vllm, monkeypatch):
    """Per-row stop strings (two letters from the second half of each row's greedy text) cut the same tokens and
    text; with ignore_eos, EOS written in stop_token_list still stops (a stop token id)."""
    batch = padded(hf)
    greedy = [
        row[p:].tolist()
        for row, p in zip(hf.generate(batch, greedy=True)["output_ids"], batch["input_lengths"])
    ]
    texts = hf.tokenizer.batch_decode(greedy, skip_special_tokens=True)
    # letters only: the tiny model also writes byte tokens that are no valid UTF-8, whose text vLLM's
    # incremental detokenizer and a whole decode render differently
    stops = [[re.findall(r"[a-z]{2}", text[len(text) // 2 :])[0]] for text in texts]
    batch = padded(hf, stop_strings=stops)
    ours = hf.generate(batch, greedy=True)
    assert_same_generation(ours, vllm.generate(batch, greedy=True))
    assert not ours["truncated"].any() and (ours["generation_lengths"] < MAX_NEW).all()
    items = [
        {"input_ids": ids, "stop_strings": stop}
        for ids, stop in zip([item["input_ids"] for item in hf.build_dataset(PROMPTS)], stops)
    ]
    for request, stop in zip(hf.finished(items, greedy=True), stops):
        sample = request.outputs[0]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", stop[0]) and stop[
            0
        ] not in sample.text

    # Make EOS the greedy choice wherever row 0 chose its 5th token (EOS's LM-head row: 1.01 x that token's
    # row) in both engines, with ignore_eos on and EOS listed as a stop token.
    head = hf.model.lm_head.weight.detach().clone()
    target, eos = greedy[0][4], hf.tokenizer.eos_token_id
    steered = head.clone()
    steered[eos] = 1.01 * head[target]
    batch = padded(hf, PROMPTS[:1])
    try:
        for module in (hf, vllm):
            module.update_weights([("lm_head.weight", steered)])
            monkeypatch.setattr(module.config, "ignore_eos", True)
            monkeypatch.setattr(module.config, "stop_token_list", hf.tokenizer.eos_token)
        ours = hf.generate(batch, greedy=True)
        assert_same_generation(ours, vllm.generate(batch, greedy=True))
        assert (
            ours["generation_lengths"].tolist() == [greedy[0].index(target) + 1]
            and ours["output_ids"][0, -1] == eos
        )
        sample = hf.finished([{"input_ids": batch["input_ids"][0].tolist()}], greedy=True)[
            0
        ].outputs[0]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", eos)
    finally:
        for module in (hf, vllm):
            module.update_weights([("lm_head.weight", head)])


# ---------------------------------------------------------------- sampling


def test_sampled_logprobs_are_the_models_own(hf, reference, monkeypatch):
    """raw: the log-softmax of the untempered model (what a trainer computes), for every sample of n."""
    monkeypatch.setattr(hf.config, "n", 3)
    batch = padded(hf, PROMPTS[:2])
    out = hf.generate(batch)
    assert out["output_ids"].shape[0] == 6
    # temperature 1: six different samples
    assert len({tuple(row) for row in out["output_ids"].tolist()}) == 6
    for row in range(6):
        p, n = batch["input_lengths"][row // 3].item(), out["unpadded_sequence_lengths"][row].item()
        # prompt-major rows
        assert out["output_ids"][row, :p].equal(batch["input_ids"][row // 3, :p])
        expected = model_logprobs(reference, out["output_ids"][row, :n].tolist())[p - 1 :]
        assert (out["logprobs"][row, p:n] - expected).abs().max().item() <= TOL


def test_processed_logprobs_follow_temperature_and_top_k(tiny_llama_dir, reference):
    module = HFGeneration(
        keys(tiny_llama_dir, logprobs_mode="processed", temperature=0.7, top_k=5)
    ).start()
    item = module.build_dataset(PROMPTS[:1])[0]
    sample = module.finished([item])[0].outputs[0]
    tokens = item["input_ids"] + sample.token_ids
    with torch.no_grad():
        logits = (
            reference(torch.tensor([tokens])).logits[0, len(item["input_ids"]) - 1 : -1].float()
            / 0.7
        )
    kth = logits.topk(5).values[:, -1:]
    expected = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)
    expected = expected.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    ours = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)])
    assert (ours - expected).abs().max().item() <= TOL


def test_same_seed_same_samples(hf, tiny_llama_dir):
    items = hf.build_dataset(PROMPTS[:2])

    def tokens(module):
        return [s.token_ids for r in module.finished(items) for s in r.outputs]

    runs = [tokens(HFGeneration(keys(tiny_llama_dir, seed=seed)).start()) for seed in (11, 11, 12)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_eval_keys_and_batches(hf, monkeypatch):
    """is_eval uses eval_temperature (0: greedy, one sample); prompts split over batches of
    generation_batch_size sequences give the same greedy results as one batch."""
    monkeypatch.setattr(hf.config, "n", 4)
    monkeypatch.setattr(hf.config, "eval_temperature", 0.0)
    items = hf.build_dataset(PROMPTS)
    one_batch = hf.run_generation(items, is_eval=True)
    assert len(one_batch) == len(PROMPTS) and hf.metrics["samples"] == len(PROMPTS)
    monkeypatch.setattr(hf.config, "generation_batch_size", 1)
    split = hf.run_generation(items, is_eval=True)
    assert split.input_ids.equal(one_batch.input_ids) and split.texts == one_batch.texts
    assert hf.metrics["engine_steps"] > MAX_NEW  # several batches ran
    # whole prompts per batch: 4 + 4 > 5 sequences
    monkeypatch.setattr(hf.config, "generation_batch_size", 5)
    sampled = hf.run_generation(items)
    assert sampled.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(4)]


def test_generate_async_streams_what_generate_returns(hf):
    batch = padded(hf)

    async def collect():
        return {i: row async for i, row in hf.generate_async(batch, greedy=True)}

    rows, whole = asyncio.run(collect()), hf.generate(batch, greedy=True)
    assert sorted(rows) == list(range(len(PROMPTS)))
    for i, row in rows.items():
        n = whole["unpadded_sequence_lengths"][i]
        assert row["output_ids"][0, :n].equal(whole["output_ids"][i, :n])
        assert torch.allclose(row["logprobs"][0, :n], whole["logprobs"][i, :n])


# ---------------------------------------------------------------- weights


def test_sync_from_a_transformers_model_sets_the_weights_and_the_version(tiny_llama_dir, reference):
    module = HFGeneration(keys(tiny_llama_dir, load_format="dummy")).start()
    batch = padded(module, PROMPTS[:2])
    greedy_ref = HFGeneration(keys(tiny_llama_dir)).start().generate(batch, greedy=True)
    before = module.generate(batch, greedy=True)
    assert not before["output_ids"].equal(greedy_ref["output_ids"])  # random weights
    assert module.weight_version == 0 and before["weight_versions"].max() == 0
    report = sync_weights(reference, module, bucket_bytes=100_000, validate=True)
    assert report.buckets > 1 and module.weight_version == 1
    after = module.generate(batch, greedy=True)
    assert after["output_ids"].equal(greedy_ref["output_ids"]) and after["logprobs"].equal(
        greedy_ref["logprobs"]
    )
    generated = after["weight_versions"] != -1
    assert generated.any() and after["weight_versions"][generated].eq(1).all()


def test_failed_writes_and_needs_resync(tiny_llama_dir, reference, monkeypatch):
    from chatgen.param_sync import LocalWeights

    module = HFGeneration(keys(tiny_llama_dir, load_format="dummy")).start()
    batch = padded(module, PROMPTS[:2])
    sync_weights(reference, module)
    good = module.generate(batch, greedy=True)

    # refused before any tensor is written: old weights kept, no resync needed
    with pytest.raises(ValueError, match="no parameter 'model.layers.9.mlp.up_proj.weight'"):
        module.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    with pytest.raises(
        ValueError, match=r"model.norm.weight has shape \(3,\), the model's is \(128,\)"
    ):
        module.update_weights([("model.norm.weight", torch.zeros(3))])
    assert module.needs_resync is None and module.weight_version == 1
    assert module.generate(batch, greedy=True)["output_ids"].equal(good["output_ids"])

    # a stream that breaks after two buckets: partially written, generation refused
    real = LocalWeights.buckets

    def broken(self):
        for i, bucket in enumerate(real(self)):
            if i == 2:
                raise ConnectionError("peer went away")
            yield bucket

    monkeypatch.setattr(LocalWeights, "buckets", broken)
    scrambled = {name: torch.randn_like(p) for name, p in reference.named_parameters()}
    with pytest.raises(
        SyncError, match=r"PARTIALLY updated \(\d+ tensors written\).*peer went away"
    ):
        sync_weights(scrambled, module, bucket_bytes=100_000)
    monkeypatch.undo()
    assert "needs a re-sync" in module.needs_resync
    with pytest.raises(
        RuntimeError, match="refuses to generate until all weights are written again"
    ):
        module.generate(batch, greedy=True)
    # a part is not enough
    module.update_weights([("model.norm.weight", reference.model.norm.weight)])
    assert module.needs_resync is not None
    sync_weights(reference, module)  # every weight: repaired
    assert module.needs_resync is None and module.weight_version == 3
    assert module.generate(batch, greedy=True)["output_ids"].equal(good["output_ids"])


def test_tied_embeddings_qwen2(make_tiny):
    """qwen2: tied LM head (the embedding; an lm_head.weight sent for it is skipped) and QKV biases."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny("tiny_qwen2")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    module = HFGeneration(keys(model_dir, load_format="dummy")).start()
    assert "lm_head.weight" not in module.weight_manifest()
    sync_weights(reference, module)
    # skipped
    module.update_weights([("lm_head.weight", torch.zeros_like(reference.lm_head.weight))])
    batch = padded(module, PROMPTS[:2])
    out = module.generate(batch, greedy=True)
    for row, p in enumerate(batch["input_lengths"].tolist()):
        n = out["unpadded_sequence_lengths"][row].item()
        expected = model_logprobs(reference, out["output_ids"][row, :n].tolist())[p - 1 :]
        assert (out["logprobs"][row, p:n] - expected).abs().max().item() <= TOL


def test_a_huge_prompt_is_cut_before_it_is_tokenized(hf, monkeypatch):
    """Issue 50, finding 14: a 10 MB prompt was tokenized whole before build_dataset cut it to the
    prompt budget. Now the tokenizer sees at most what the budget's tokens can span, and the item is
    the same as the cut of the whole text would be."""
    huge, short = "3 1 2 " * 1_750_000, "3 1 2 " * 200  # 10.5 MB; 1200 characters, over budget too
    (want,) = hf.build_dataset([short])
    seen, tokenize = [], type(hf.tokenizer).__call__

    def spy(self, texts, *args, **kwargs):
        seen.extend([texts] if isinstance(texts, str) else texts)
        return tokenize(self, texts, *args, **kwargs)

    monkeypatch.setattr(type(hf.tokenizer), "__call__", spy)
    (item,) = hf.build_dataset([huge])
    assert item["prompt_cut"] and want["prompt_cut"]
    assert item["input_ids"] == want["input_ids"]
    budget = 128 - MAX_NEW
    assert max(map(len, seen)) <= budget * max(map(len, hf.tokenizer.get_vocab()))
