"""NeMo RL's VllmGeneration tests (NVIDIA-NeMo/RL 7ea279a, tests/unit/models/generation/test_vllm_generation.py)
on chatgen.compat.nemo_rl.VllmGeneration: each test here follows the peer test of its name, call for call and
check for check, with NeMo RL's surroundings replaced by CPU stand-ins (nemo_rl_cpu.py) and Qwen3-0.6B by the
tiny Qwen3 (tied embeddings, as Qwen3-0.6B). Where the peer compares with Qwen3-0.6B's own text, the test
checks the same property on the tiny model's. Items not here, and why: docs/migrating_from_nemo_rl.md.

    python -m pytest tests/peers/test_nemo_rl_vllm_generation.py      # ~2 min on 2 idle CPU cores
"""

import pytest
import torch
from helpers import completions, max_diff_vs_hf
from nemo_rl_cpu import (
    BatchedDataDict,
    Policy,
    RayVirtualCluster,
    configure_generation_config,
    get_tokenizer,
    refit_policy_generation,
)

from chatgen.compat.nemo_rl import VllmGeneration  # NeMo RL: nemo_rl.models.generation.vllm

pytestmark = pytest.mark.integration
SYNC_TOL = 1e-4  # fp32: vLLM vs transformers log-probs of the same weights


def basic_vllm_test_config(model_dir) -> dict:
    """The peer's basic_vllm_test_config, keys as NeMo RL writes them; CPU values: the tiny model, fp32,
    its 512 positions, a CPU KV cache, eager (NeMo RL's test writes enforce_eager as the string "False")."""
    return {
        "backend": "vllm",
        "model_name": str(model_dir),
        "tokenizer": {"name": str(model_dir)},
        "dtype": "bfloat16",
        "max_new_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "val_temperature": 1.0,
        "val_top_p": 1.0,
        "val_top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "vllm_cfg": {
            "precision": "float32",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.7,
            "max_model_len": 512,
            "async_engine": False,
            "skip_tokenizer_init": False,
            "load_format": "auto",
            "enforce_eager": "True",
            "kv_cache_dtype": "auto",
        },
        "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20},
    }


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir):
    return tiny_qwen3_dir


@pytest.fixture(scope="module")
def cluster():
    return RayVirtualCluster(num_gpus_per_node=2)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return get_tokenizer({"name": str(model_dir)})


@pytest.fixture
def policy(cluster, tokenizer, model_dir):
    """The peer's `policy`, per test as there (vLLM's shutdown of any engine of this process tears down
    the parallel state every engine of it uses: a shared one would not outlive the next test's)."""
    vllm_config = basic_vllm_test_config(model_dir)
    vllm_config["vllm_cfg"]["async_engine"] = False
    vllm_config = configure_generation_config(vllm_config, tokenizer)
    p = VllmGeneration(cluster, vllm_config)
    yield p
    p.shutdown()


@pytest.fixture
def test_input_data(tokenizer):
    encodings = tokenizer(
        ["Hello, my name is", "The capital of France is"],
        padding="max_length",
        max_length=20,
        truncation=True,
        return_tensors="pt",
        padding_side="right",
    )
    input_lengths = encodings["attention_mask"].sum(dim=1).to(torch.int32)
    return BatchedDataDict({"input_ids": encodings["input_ids"], "input_lengths": input_lengths})


def test_vllm_missing_required_config_key(cluster, model_dir):
    incomplete_config = basic_vllm_test_config(model_dir)
    del incomplete_config["model_name"]
    incomplete_config["skip_tokenizer_init"] = True
    incomplete_config["load_format"] = "auto"
    with pytest.raises(AssertionError) as excinfo:
        VllmGeneration(cluster, incomplete_config)
    error_message = str(excinfo.value)
    assert "Missing required keys in VllmConfig" in error_message
    assert "model_name" in error_message


def test_vllm_policy_generation(policy, test_input_data, tokenizer):
    outputs = policy.generate(test_input_data)
    for key in ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths"):
        assert key in outputs
    assert outputs["output_ids"].shape[0] == len(test_input_data["input_ids"])
    assert outputs["generation_lengths"].shape[0] == len(test_input_data["input_ids"])
    generated_texts = tokenizer.batch_decode(outputs["output_ids"], skip_special_tokens=True)
    assert all(len(text) > 0 for text in generated_texts)


async def _generate_async(vllm_policy, tokenizer, test_input_data, greedy=False):
    collected = []
    for single_item_input in test_input_data.make_microbatch_iterator(microbatch_size=1):
        async for original_idx, single_item_output in vllm_policy.generate_async(
            single_item_input, greedy=greedy
        ):
            collected.append((original_idx, single_item_output))
    collected.sort(key=lambda x: x[0])
    pad_token_id = vllm_policy.cfg.get("_pad_token_id", tokenizer.pad_token_id)
    return BatchedDataDict.from_batches(
        [item for _, item in collected],
        pad_value_dict={"output_ids": pad_token_id, "logprobs": 0.0},
    )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "tensor_parallel_size,pipeline_parallel_size",
    [
        pytest.param(
            2, 1, marks=pytest.mark.skip(reason="several GPUs: one engine over 2 devices")
        ),
        (1, 2),
        (1, 1),  # not the peer's: the sequence on one device per engine
    ],
)
async def test_vllm_policy_generation_async(
    cluster, test_input_data, tokenizer, model_dir, tensor_parallel_size, pipeline_parallel_size
):
    vllm_config = configure_generation_config(basic_vllm_test_config(model_dir), tokenizer)
    vllm_config["vllm_cfg"]["async_engine"] = True
    vllm_config["vllm_cfg"]["tensor_parallel_size"] = tensor_parallel_size
    vllm_config["vllm_cfg"]["pipeline_parallel_size"] = pipeline_parallel_size
    if pipeline_parallel_size > 1:  # refused, naming why, before any engine starts
        with pytest.raises(ValueError, match="pipeline parallel"):
            VllmGeneration(cluster, vllm_config)
        return
    async_policy = VllmGeneration(cluster, vllm_config)
    try:
        async_policy.finish_generation()
        lm_policy = Policy(cluster, {"model_name": str(model_dir)}, tokenizer)
        async_policy.prepare_refit_info(lm_policy.prepare_refit_info())  # lm_head.weight: tied
        refit_policy_generation(lm_policy, async_policy, vllm_config["colocated"]["enabled"])
        outputs = await _generate_async(async_policy, tokenizer, test_input_data)
        for key in ("output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths"):
            assert key in outputs
        assert outputs["output_ids"].shape[0] == len(test_input_data["input_ids"])
        assert outputs["generation_lengths"].shape[0] == len(test_input_data["input_ids"])
        texts = tokenizer.batch_decode(outputs["output_ids"], skip_special_tokens=True)
        assert all(len(text) > 0 for text in texts)
    finally:
        async_policy.shutdown()


def test_vllm_weight_update_and_prefix_cache_reset(cluster, tokenizer, model_dir):
    """The peer's [tensor_parallel_size=1] item (fp32 for its bfloat16; fp8 and TP=2 need CUDA / 2 GPUs):
    the update is not waited on before the next generate, which must see the new weights on both workers."""
    vllm_config = configure_generation_config(
        basic_vllm_test_config(model_dir), tokenizer, is_eval=True
    )
    vllm_config["vllm_cfg"]["logprobs_mode"] = "raw_logprobs"  # compared with the trainer's
    lm_policy = Policy(cluster, {"model_name": str(model_dir)}, tokenizer)
    vllm_policy = VllmGeneration(cluster, vllm_config)
    try:
        vllm_policy.prepare_refit_info(lm_policy.prepare_refit_info())
        text = "Answer the question based on the context below. Keep the answer short. " * 3
        encodings = tokenizer([text, text], padding=True, return_tensors="pt", padding_side="right")
        input_lengths = encodings["attention_mask"].sum(dim=1).to(torch.int32)
        test_input_data = BatchedDataDict(
            {"input_ids": encodings["input_ids"], "input_lengths": input_lengths}
        )
        vllm_policy.prepare_for_generation()
        outputs1 = vllm_policy.generate(test_input_data, greedy=True)
        logprob1 = outputs1["logprobs"][0, input_lengths[0]].item()

        lm_policy.add_noise_to_weights()
        lm_policy.stream_weights_via_ipc_zmq(vllm_policy)
        update_success = vllm_policy.update_weights_via_ipc_zmq()  # not waited on, as the peer's
        assert update_success
        outputs2 = vllm_policy.generate(test_input_data, greedy=True)
        logprob2 = outputs2["logprobs"][0, input_lengths[0]].item()
        assert logprob2 != logprob1, "Logprobs should be different after weight update."
        # both rows (one per worker) generated on the trainer's new weights
        assert max_diff_vs_hf(lm_policy.model.eval(), *zip(*completions(outputs2))) < SYNC_TOL

        vllm_policy.finish_generation()
        vllm_policy.prepare_for_generation()
        outputs3 = vllm_policy.generate(test_input_data, greedy=True)
        logprob3 = outputs3["logprobs"][0, input_lengths[0]].item()
        assert logprob3 == pytest.approx(logprob2, abs=SYNC_TOL)  # the same weights, cache reset
    finally:
        vllm_policy.shutdown()


@pytest.mark.parametrize("is_eval", [True, False])
def test_vllm_generation_with_stop(cluster, test_input_data, tokenizer, model_dir, is_eval):
    """The peer stops Qwen3-0.6B's answers at 'Ġcapital' (id 6722) and "I'm" and compares the texts; here
    the stops are a token and a string the tiny model generates greedily, in generate and generate_text."""
    lm_policy = Policy(cluster, {"model_name": str(model_dir)}, tokenizer)
    lengths = test_input_data["input_lengths"].tolist()
    greedy = [
        lm_policy.model.generate(row[None, :n], do_sample=False, max_new_tokens=8)[0, n:].tolist()
        for row, n in zip(test_input_data["input_ids"], lengths)
    ]
    row0 = greedy[0]
    k = next((i for i in range(1, len(row0)) if row0[i] not in row0[:i]), 0)
    stop_token = row0[
        k
    ]  # row 0's first token unlike those before it (the tiny model repeats itself)
    prompt1 = test_input_data["input_ids"][1, : lengths[1]].tolist()

    def text1(n):  # row 1's first n generated tokens as text, decoded after its prompt
        return tokenizer.decode(prompt1 + greedy[1][:n])[len(tokenizer.decode(prompt1)) :]

    stop_string = text1(len(greedy[1])).strip()[:2]
    n1 = next(n for n in range(1, len(greedy[1]) + 1) if stop_string in text1(n))
    vllm_config = basic_vllm_test_config(model_dir)
    vllm_config["stop_token_ids"] = [stop_token]
    vllm_config["stop_strings"] = [stop_string]
    vllm_config["max_new_tokens"] = 8
    vllm_config = configure_generation_config(vllm_config, tokenizer, is_eval=is_eval)
    vllm_generation = VllmGeneration(cluster, vllm_config)
    try:
        if not is_eval:
            vllm_generation.finish_generation()
            vllm_generation.prepare_refit_info(lm_policy.prepare_refit_info())
            refit_policy_generation(lm_policy, vllm_generation, vllm_config["colocated"]["enabled"])
        outputs = vllm_generation.generate(test_input_data, greedy=True)
        out0 = outputs["output_ids"][0, lengths[0] : outputs["unpadded_sequence_lengths"][0]]
        assert out0.tolist() == row0[: k + 1]  # stopped at the config's stop token, which is kept
        assert outputs["generation_lengths"][1] == n1  # stopped at the config's stop string
        output = vllm_generation.generate_text(
            BatchedDataDict({"prompts": ["Hello, my name is", "The capital of France is"]}),
            greedy=True,
        )
        assert output["texts"] == [tokenizer.decode(row0[: k + 1]), text1(n1)]
    finally:
        vllm_generation.shutdown()


def test_vllm_non_divisible_batch_handling(policy):
    empty_batch = BatchedDataDict(
        {
            "input_ids": torch.zeros((1, 1), dtype=torch.long),
            "input_lengths": torch.ones(1, dtype=torch.long),
        }
    )
    outputs = policy.generate(empty_batch)
    required_keys = ["output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths"]
    assert all(key in outputs for key in required_keys)
    assert all(outputs[key].shape[0] == 1 for key in required_keys)


def test_vllm_refit_non_colocated_update_weights(tokenizer, test_input_data, model_dir):
    """The peer's [sync engine, TP=1, dtensor] item (the peer needs 2 devices, one each side; its expected
    text is Qwen3-0.6B's): the trainer's broadcast loaded, then greedy rows are the trainer's own; a
    non-colocated finish_generation only resets the prefix cache, so generating goes on."""
    vllm_config = configure_generation_config(
        basic_vllm_test_config(model_dir), tokenizer, is_eval=True
    )
    vllm_config["colocated"]["enabled"] = False
    vllm_config["vllm_cfg"]["logprobs_mode"] = "raw_logprobs"  # compared with the trainer's
    lm_policy = Policy(RayVirtualCluster(1), {"model_name": str(model_dir)}, tokenizer)
    lm_policy.add_noise_to_weights()
    vllm_generation = VllmGeneration(RayVirtualCluster(1), vllm_config)
    try:
        vllm_generation.prepare_refit_info(lm_policy.prepare_refit_info())
        refit_policy_generation(lm_policy, vllm_generation, False)
        vllm_generation.finish_generation()
        outputs = vllm_generation.generate(test_input_data, greedy=True)
        assert max_diff_vs_hf(lm_policy.model.eval(), *zip(*completions(outputs))) < SYNC_TOL
    finally:
        vllm_generation.shutdown()


def test_vllm_deferred_model_load(cluster, tokenizer, model_dir, test_input_data):
    """The peer's deferred start, without its HTTP server (chatgen's facade refuses expose_http_server, naming
    chatgen's EmbeddedServer): nothing loaded until load_and_start(), then the engines' devices known."""
    generation_config = configure_generation_config(
        basic_vllm_test_config(model_dir), tokenizer, is_eval=True
    )
    generation_config["temperature"] = 0.0
    vllm_generation = VllmGeneration(cluster, generation_config, defer_model_load=True)
    try:
        assert len(vllm_generation.dp_openai_server_base_urls) == cluster.num_gpus_per_node
        assert vllm_generation.device_uuids is None
        with pytest.raises(RuntimeError, match="load_and_start"):
            vllm_generation.generate(test_input_data)
        vllm_generation.load_and_start()
        assert len(vllm_generation.device_uuids) == cluster.num_gpus_per_node
        assert vllm_generation.generate(test_input_data)["output_ids"].shape[0] == 2
    finally:
        vllm_generation.shutdown()
