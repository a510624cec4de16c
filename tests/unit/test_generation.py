"""Pure logic of chatgen.generation (no vLLM): config -> engine/sampling arguments, token batches in and out.

.venv/bin/python -m pytest tests/unit/test_generation.py
"""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from chatgen.compat.chatlearn import model_args
from chatgen.config import ConfigError, load_model_config
from chatgen.generation import config as gc
from chatgen.generation.batching import generation_output, unpad_batch
from chatgen.generation.vllm import config as vc
from chatgen.generation.vllm.config import VLLMConfig


def config(**values) -> VLLMConfig:
    return load_model_config(None, VLLMConfig, {"load": "/m", **values})


# ---------------------------------------------------------------- config checks and mapping


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("swap_space", 4.0, "recomputes preempted requests"),
        ("sliding_window", 4096, "config.json"),
        ("use_beam_search", True, "n > 1 sampling"),
        ("block_size", 16, "multiple of 32"),
    ],
)
def test_unsupported_keys_are_rejected_with_the_fix(key, value, message):
    cfg = dataclasses.replace(config(), **{key: value})
    with pytest.raises(ConfigError, match=message) as err:
        vc.check_vllm_config(cfg, cpu=True)
    assert err.value.errors[0].startswith(f"{key}: ")


def test_all_problems_are_reported_at_once():
    cfg = dataclasses.replace(
        config(), swap_space=1.0, use_beam_search=True, temperature=0.0, n=4, top_p=0.0
    )
    with pytest.raises(ConfigError) as err:
        vc.check_vllm_config(cfg, cpu=True)
    assert sorted(e.split(":")[0] for e in err.value.errors) == [
        "n",
        "swap_space",
        "top_p",
        "use_beam_search",
    ]


def test_block_size_16_is_fine_on_gpu():
    vc.check_vllm_config(dataclasses.replace(config(), block_size=16), cpu=False)


def test_engine_kwargs_map_every_engine_key(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = config(
        load=str(tmp_path),
        dtype="bfloat16",
        seed=7,
        seq_length=512,
        max_new_tokens=64,
        tensor_parallel_size=2,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=1 << 20,
        block_size=32,
        generation_batch_size=16,
        max_num_batched_tokens=1024,
        logprobs_mode="raw",
    )
    kwargs = vc.engine_kwargs(
        cfg, str(tmp_path), cpu=True, distributed_executor_backend="external_launcher"
    )
    assert kwargs == dict(
        tokenizer=str(tmp_path),
        skip_tokenizer_init=False,
        dtype="bfloat16",
        seed=7,
        max_model_len=512,
        tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=1 << 20,
        block_size=32,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        logprobs_mode="raw_logprobs",
    )


def test_engine_kwargs_defaults_without_tokenizer_and_cpu_kv_cache(tmp_path):
    hf = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = config(load=str(tmp_path), seq_length=256, max_new_tokens=64)
    kwargs = vc.engine_kwargs(cfg, str(tmp_path), cpu=True)
    assert kwargs["skip_tokenizer_init"] is True
    assert (
        "block_size" not in kwargs
        and "max_num_seqs" not in kwargs
        and "distributed_executor_backend" not in kwargs
    )
    # K and V, 3 layers, 2 KV heads of 32 dims, fp32, for 8 sequences of 256 tokens
    assert kwargs["kv_cache_memory_bytes"] == 2 * 3 * 2 * 32 * 4 * 256 * 8
    assert "kv_cache_memory_bytes" not in vc.engine_kwargs(cfg, str(tmp_path), cpu=False)
    # a sequence length that is not a whole number of KV blocks (128 on CPU) is rounded up: one 200-token
    # sequence needs 2 blocks, else vLLM refuses to start
    short = config(load=str(tmp_path), seq_length=200, max_new_tokens=64, generation_batch_size=1)
    assert (
        vc.engine_kwargs(short, str(tmp_path), cpu=True)["kv_cache_memory_bytes"]
        == 2 * 3 * 2 * 32 * 4 * 256
    )


def test_explicit_tokenizer_without_tokenizer_files_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(dict(num_attention_heads=4, hidden_size=128, num_hidden_layers=1))
    )
    cfg = config(load=str(tmp_path), seq_length=512, tokenizer=str(tmp_path / "typo"))
    with pytest.raises(ConfigError, match=r"tokenizer: .*typo holds no tokenizer"):
        vc.engine_kwargs(cfg, str(tmp_path), cpu=True)


def test_missing_load_is_one_readable_error():
    from chatgen.generation.vllm.module import VLLMModule

    with pytest.raises(ConfigError) as err:
        VLLMModule.model_provider(SimpleNamespace(config=SimpleNamespace(load=None)))
    assert err.value.errors == [
        "load: not set; set it to the Hugging Face model directory to generate with"
    ]


def test_sampling_train_eval_and_greedy():
    cfg = config(
        n=4,
        temperature=0.8,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        eval_temperature=0.0,
        eval_top_k=5,
        new_token_limit=True,
        max_new_tokens=32,
        prompt_logprobs=1,
        seq_length=2048,
    )
    train = gc.sampling_kwargs(cfg, 10)
    assert (train["n"], train["temperature"], train["top_p"], train["top_k"], train["min_p"]) == (
        4,
        0.8,
        0.9,
        0,
        0.05,
    )
    assert train["max_tokens"] == 32 and train["logprobs"] == 0 and train["prompt_logprobs"] == 1
    evaluated = gc.sampling_kwargs(cfg, 10, is_eval=True)
    assert (evaluated["n"], evaluated["temperature"], evaluated["top_p"], evaluated["top_k"]) == (
        1,
        0.0,
        0.9,
        5,
    )
    greedy = gc.sampling_kwargs(cfg, 10, greedy=True)
    assert (greedy["n"], greedy["temperature"]) == (1, 0.0)


def test_max_tokens_follow_new_token_limit():
    assert gc.max_tokens(config(new_token_limit=True, max_new_tokens=16, seq_length=100), 30) == 16
    assert gc.max_tokens(config(new_token_limit=False, max_new_tokens=16, seq_length=100), 30) == 70
    # one prompt budget, seq_length - max_new_tokens = 84, whatever new_token_limit
    for limit in (
        True,
        False,
    ):
        cfg = config(new_token_limit=limit, max_new_tokens=16, seq_length=100)
        assert gc.prompt_budget(cfg) == 84
        assert gc.max_tokens(cfg, 84) == 16
        with pytest.raises(
            ValueError,
            match=r"a prompt has 85 prompt tokens, over the prompt budget seq_length - "
            r"max_new_tokens = 100 - 16 = 84",
        ):
            gc.max_tokens(cfg, 85)


class Chars:
    """A tokenizer stand-in: one token per character (called on a batch, as HF tokenizers are)."""

    def __call__(self, texts, return_attention_mask=True, return_token_type_ids=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


@pytest.mark.parametrize("new_token_limit", [True, False])
def test_build_dataset_cuts_to_the_budget_keeping_the_beginning_and_counts(new_token_limit, caplog):
    from chatgen.generation.vllm.module import VLLMModule

    module = SimpleNamespace(
        tokenizer=Chars(),
        config=config(seq_length=20, max_new_tokens=12, new_token_limit=new_token_limit),
    )
    prompts = ["Instruction first, then a long context", "short", "exactly8", "123456789"]
    with caplog.at_level("WARNING", logger="chatgen.generation.vllm.module"):
        items = VLLMModule.build_dataset(module, prompts)
    # ChatLearn: p[:max]
    assert [item["input_ids"] for item in items] == [[ord(c) for c in p[:8]] for p in prompts]
    assert [item["prompt"] for item in items] == prompts
    assert [r.getMessage() for r in caplog.records] == [
        "build_dataset: cut 2 of 4 prompts to the prompt budget seq_length - max_new_tokens = 8 tokens, keeping "
        "their beginning (prompts 0, 3); raise seq_length or lower max_new_tokens to keep them whole"
    ]


@pytest.mark.parametrize("new_token_limit", [True, False])
def test_generate_refuses_a_row_over_the_budget_before_queueing(new_token_limit):
    from chatgen.generation.vllm.module import VLLMModule

    module = VLLMModule.__new__(VLLMModule)  # no engine: generate must fail before it would use one
    module.pad_token_id, module.vocab_size = 0, 100
    module.config = config(seq_length=20, max_new_tokens=12, new_token_limit=new_token_limit)
    batch = {
        "input_ids": torch.tensor([[1] * 8 + [0], [1] * 9]),
        "input_lengths": torch.tensor([8, 9]),
    }
    with pytest.raises(
        ValueError, match=r"generate\(\): row 1 has 9 prompt tokens, over the prompt budget .* = 8"
    ):
        module.generate(batch)


def test_pad_token_id_of_a_token_only_model_comes_from_its_config(tmp_path):
    write = lambda name, d: (tmp_path / name).write_text(json.dumps(d))  # noqa: E731
    assert gc.pad_token_id(None, tmp_path) == 0  # no file names one
    write("config.json", {"eos_token_id": [2, 7]})
    assert gc.pad_token_id(None, tmp_path) == 2
    write("config.json", {"pad_token_id": 3, "eos_token_id": 2})
    assert gc.pad_token_id(None, tmp_path) == 3
    write("generation_config.json", {"pad_token_id": 5})
    assert gc.pad_token_id(None, tmp_path) == 5
    # a batch padded with the model's own pad id is accepted
    assert unpad_batch(
        {"input_ids": torch.tensor([[1, 4, 5, 5]]), "input_lengths": torch.tensor([2])},
        gc.pad_token_id(None, tmp_path),
    ) == [[1, 4]]
    # with a tokenizer: its pad token, else its EOS
    assert gc.pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=9), tmp_path) == 9
    assert gc.pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=9), tmp_path) == 0


def test_stop_strings_without_a_tokenizer_say_to_add_one():
    from chatgen.generation.base import GenerationModule

    module = SimpleNamespace(
        tokenizer=None, config=config(stop_token_list="</s>", seq_length=64, max_new_tokens=8)
    )
    with pytest.raises(
        ValueError,
        match=r"need a tokenizer .* add one \(tokenizer files in the model directory, "
        r"or the `tokenizer` key\)",
    ) as err:
        GenerationModule.sampling_kwargs(module, 4)
    assert "stop on ids" not in str(err.value)


class SpecialTokens:
    """The three tokenizer methods parse_stop_list reads, on a 2-token special vocabulary + 1 added token."""

    all_special_tokens = ["<s>", "</s>"]

    def convert_tokens_to_ids(self, token):
        return {"<s>": 1, "</s>": 2}[token]

    def get_added_vocab(self):
        return {"<|im_end|>": 9}


def test_stop_list_splits_special_tokens_from_strings():
    tokenizer = SpecialTokens()
    strings, ids = gc.parse_stop_list("</s>;\n\n;<|im_end|>;Answer:", tokenizer)
    assert strings == ("\n\n", "Answer:") and ids == (2, 9)
    assert gc.parse_stop_list("", tokenizer) == ((), ())
    assert gc.parse_stop_list("</s>", None) == (("</s>",), ())


# ---------------------------------------------------------------- token batches


def test_unpad_batch_and_errors_name_the_row():
    ids = torch.tensor([[1, 5, 6, 0], [1, 7, 0, 0]])
    assert unpad_batch({"input_ids": ids, "input_lengths": torch.tensor([3, 2])}, 0) == [
        [1, 5, 6],
        [1, 7],
    ]
    left = torch.tensor([[1, 5, 6, 0], [0, 0, 1, 7]])
    with pytest.raises(ValueError, match=r"row 1 is not right-padded: input_lengths\[1\]=2"):
        unpad_batch({"input_ids": left, "input_lengths": torch.tensor([3, 2])}, 0)
    with pytest.raises(ValueError, match=r"row 0: input_lengths\[0\]=0 is outside 1..4"):
        unpad_batch({"input_ids": ids, "input_lengths": torch.tensor([0, 2])}, 0)
    with pytest.raises(ValueError, match="must be \\(B, T\\)"):
        unpad_batch({"input_ids": ids[0], "input_lengths": torch.tensor([3])}, 0)
    with pytest.raises(ValueError, match=r"one entry per row \(2\)"):
        unpad_batch(
            {"input_ids": ids, "input_lengths": torch.tensor([3, 2]), "stop_strings": [["x"]]}, 0
        )
    stop_ids = {"input_ids": ids, "input_lengths": torch.tensor([3, 2])}
    assert unpad_batch({**stop_ids, "stop_token_ids": [[2, 9], None]}, 0) == [[1, 5, 6], [1, 7]]
    with pytest.raises(
        ValueError, match=r"stop_token_ids must be a list with one entry per row \(2\)"
    ):
        # one list for all rows: say which rows
        unpad_batch({**stop_ids, "stop_token_ids": [2, 9]}, 0)
    with pytest.raises(
        ValueError, match=r"stop_token_ids\[1\] = \[True\]; give a list of token ids"
    ):
        unpad_batch({**stop_ids, "stop_token_ids": [None, [True]]}, 0)


def test_the_pad_token_id_key_wins_over_the_tokenizers():
    tokenizer = SimpleNamespace(pad_token_id=3, eos_token_id=2)
    assert gc.pad_token_id(tokenizer, "/m") == 3
    # NeMo RL's batches, right-padded with 0
    assert gc.pad_token_id(tokenizer, "/m", configured=0) == 0
    assert unpad_batch(
        {
            "input_ids": torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]),
            "input_lengths": torch.tensor([3, 5]),
        },
        gc.pad_token_id(tokenizer, "/m", 0),
    ) == [[1, 2, 3], [1, 2, 3, 4, 5]]
    with pytest.raises(
        ConfigError, match=r"pad_token_id: must be a token id \(>= 0\) or null, got -1"
    ):
        gc.check_config(config(pad_token_id=-1))


@pytest.mark.faults
def test_unpad_batch_refuses_inputs_that_used_to_give_silently_wrong_results():
    """A string where a list of stop strings belongs used to be split into characters (stopping after a token);
    a bool tensor of ids was accepted and came back as bool outputs."""
    ids, lengths = torch.tensor([[1, 5, 6, 0], [1, 7, 0, 0]]), torch.tensor([3, 2])
    with pytest.raises(
        ValueError, match=r"stop_strings\[1\] = 'abc'; give a list of non-empty strings .*\['abc'\]"
    ):
        unpad_batch({"input_ids": ids, "input_lengths": lengths, "stop_strings": [None, "abc"]}, 0)
    with pytest.raises(ValueError, match="stop_strings must be a list with one entry per row"):
        # len("ab") == B
        unpad_batch({"input_ids": ids, "input_lengths": lengths, "stop_strings": "ab"}, 0)
    with pytest.raises(
        ValueError, match="input_ids is a torch.bool tensor; pass token ids .* integer tensor"
    ):
        unpad_batch({"input_ids": ids.bool(), "input_lengths": lengths}, 0)
    with pytest.raises(ValueError, match="input_lengths is a torch.float32 tensor"):
        unpad_batch({"input_ids": ids, "input_lengths": lengths.float()}, 0)
    assert unpad_batch(
        {"input_ids": ids, "input_lengths": lengths, "stop_strings": [["ab"], None]}, 0
    ) == [[1, 5, 6], [1, 7]]


@pytest.mark.faults
def test_tokenizer_and_model_vocabulary_are_checked_against_each_other():
    from chatgen.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"tokenizer of /tok has 512 tokens, the model /m/config.json has "
        r"vocab_size=256; ids past 255 have no embedding row",
    ):
        gc.check_vocab(512, 256, "/tok", "/m")
    assert "ids 512..1023 have no text" in gc.check_vocab(512, 1024, "/tok", "/m")
    assert gc.check_vocab(512, 512, "/tok", "/m") is None
    with pytest.raises(
        ValueError, match=r"item 3: token id\(s\) \[-1, 9\] outside the model's vocabulary \[0, 9\)"
    ):
        gc.check_prompt_ids([1, -1, 9], 9, "item 3")


def sample(index, tokens, logprobs, finish):
    steps = [
        {t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=-99.0)}
        for t, lp in zip(tokens, logprobs)
    ]
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=steps, finish_reason=finish)


def test_generation_output_layout():
    requests = [
        SimpleNamespace(
            prompt_token_ids=[1, 5, 6],
            prompt_logprobs=None,
            outputs=[
                sample(1, [9], [-0.5], "stop"),
                sample(0, [7, 8, 2], [-1.0, -2.0, -3.0], "stop"),
            ],
        ),
        SimpleNamespace(
            prompt_token_ids=[1, 4],
            prompt_logprobs=None,
            outputs=[sample(0, [3, 3, 3, 3], [-0.1] * 4, "length"), sample(1, [], [], "length")],
        ),
    ]
    out = generation_output(requests, input_width=3, pad_token_id=0)
    assert out["output_ids"].tolist() == [
        [1, 5, 6, 7, 8, 2, 0],
        [1, 5, 6, 9, 0, 0, 0],
        [1, 4, 3, 3, 3, 3, 0],
        [1, 4, 0, 0, 0, 0, 0],
    ]
    assert out["logprobs"][0].tolist() == [0, 0, 0, -1.0, -2.0, -3.0, 0]
    assert out["logprobs"][1].tolist() == [0, 0, 0, -0.5, 0, 0, 0]
    assert torch.allclose(out["logprobs"][2], torch.tensor([0, 0, -0.1, -0.1, -0.1, -0.1, 0]))
    assert out["generation_lengths"].tolist() == [3, 1, 4, 0]
    assert out["unpadded_sequence_lengths"].tolist() == [6, 4, 6, 2]
    assert out["truncated"].tolist() == [False, False, True, True]
    assert "prompt_logprobs" not in out


def test_generation_output_prompt_logprobs():
    steps = [None, {5: SimpleNamespace(logprob=-1.5)}, {6: SimpleNamespace(logprob=-2.5)}]
    request = SimpleNamespace(
        prompt_token_ids=[1, 5, 6],
        prompt_logprobs=steps,
        outputs=[sample(0, [7], [-0.5], "length")],
    )
    out = generation_output([request], input_width=4, pad_token_id=0)
    assert out["prompt_logprobs"].tolist() == [[0.0, -1.5, -2.5, 0.0, 0.0]]


# ---------------------------------------------------------------- chatgen generate input


def test_cli_input_errors_name_the_line(tmp_path):
    from chatgen.cli.generate import read_prompts

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_ids": [1, 2]}\n\n{"prompt": "hi"}\n')
    assert read_prompts(good, 512) == [([1, 2], None), (None, "hi")]
    for text, message in [
        ('{"prompt_ids": [1, 2]}\n{"text": "x"}\n', "bad.jsonl:2: needs"),
        ('{"prompt_ids": []}\n', "bad.jsonl:1: \"prompt_ids\" must be a non-empty list"),
        (
            '{"prompt_ids": [1]}\n\n{"prompt_ids": [1, 512]}\n',
            r"bad.jsonl:3: \"prompt_ids\": token id\(s\) \[512\] outside the model's vocabulary \[0, 512\)",
        ),
        ("not json\n", "bad.jsonl:1: not JSON"),
        ("\n", "no prompts"),
    ]:
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            read_prompts(tmp_path / "bad.jsonl", 512)


def test_shipped_policy_yaml_is_accepted_by_the_generation_module():
    from pathlib import Path

    cfg = load_model_config(
        Path(__file__).resolve().parents[2] / "configs" / "policy_inference.yaml", VLLMConfig
    )
    vc.check_vllm_config(cfg, cpu=True)
    assert (cfg.n, cfg.eval_temperature, cfg.logprobs_mode) == (4, 0.0, "raw")


def test_seq_length_defaults_to_the_models_positions_and_longer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    assert gc.resolve_seq_length(config(load=str(tmp_path)), tmp_path).seq_length == 512
    assert (
        gc.resolve_seq_length(config(load=str(tmp_path), seq_length=300), tmp_path).seq_length
        == 300
    )
    with pytest.raises(
        ConfigError,
        match=r"seq_length: 1024 is longer than the model's max_position_embeddings=512",
    ):
        gc.resolve_seq_length(config(load=str(tmp_path), seq_length=1024), tmp_path)
    with pytest.raises(ConfigError, match="max_new_tokens: 600 leaves no room"):
        gc.resolve_seq_length(config(load=str(tmp_path), max_new_tokens=600), tmp_path)


# ---------------------------------------------------------------- every VLLMConfig key goes somewhere

# key: (where it goes, a non-default value). "engine" = an argument of vllm.LLM (engine_kwargs), "sampling" =
# vllm.SamplingParams (sampling_kwargs, train or eval) or the prompt budget, "stop list" = the module's
# sampling_params (parse_stop_list -> stop / stop_token_ids), "model" = model_provider(), "rejected" =
# VLLMConfig.check / platform_problems refuse the value. A new key must be added here with where it goes.
KEY_DESTINATIONS = {
    "load": ({"model"}, "/other"),
    "prompt_template": ({"dataset"}, "Q: {prompt} A:"),
    "chat_template": ({"dataset"}, True),
    "tokenizer": ({"engine"}, "OTHER_TOKENIZER"),
    "load_format": ({"engine"}, "dummy"),
    "dtype": ({"engine"}, "bfloat16"),
    "seed": ({"engine"}, 7),
    "n": ({"sampling"}, 2),
    "temperature": ({"sampling"}, 0.5),
    "top_p": ({"sampling"}, 0.5),
    "top_k": ({"sampling"}, 5),
    "min_p": ({"sampling"}, 0.1),
    "repetition_penalty": ({"sampling"}, 1.3),
    "ignore_eos": ({"sampling"}, True),
    "use_beam_search": ({"rejected"}, True),
    "eval_n": ({"sampling"}, 3),
    "eval_temperature": ({"sampling"}, 0.5),
    "eval_top_p": ({"sampling"}, 0.5),
    "eval_top_k": ({"sampling"}, 5),
    "stop_token_list": ({"stop list"}, "</s>;\n\n"),
    "new_token_limit": ({"sampling"}, True),
    "max_new_tokens": ({"sampling"}, 32),
    "seq_length": ({"engine", "sampling"}, 256),
    "prompt_logprobs": ({"sampling"}, 1),
    "pad_token_id": ({"pad"}, 5),
    "logprobs_mode": ({"engine"}, "raw"),
    "max_num_batched_tokens": ({"engine"}, 1024),
    "generation_batch_size": ({"engine"}, 16),
    "max_paddings": ({"rejected"}, 8),
    "block_size": ({"engine"}, 64),
    "gpu_memory_utilization": ({"engine"}, 0.5),
    "swap_space": ({"rejected"}, 4.0),
    "sliding_window": ({"rejected"}, 4096),
    "kv_cache_memory_bytes": ({"engine"}, 1 << 20),
    "tensor_parallel_size": ({"engine"}, 2),
    "return_routed_experts": (
        {"engine"},
        True,
    ),  # prefix caching off (and setup() records the routing)
    "enforce_eager": ({"engine"}, True),
    "enable_lora": ({"engine"}, True),
    "release_during_training": ({"links"}, True),  # the run's WeightLinks releases the engine
    "max_lora_rank": ({"rejected"}, 32),  # read only with enable_lora
    "args": (
        {"user"},
        {"prompt_key": "question"},
    ),  # the user's keys: chatgen reads none; model_args has them
}


class CharTokenizer:
    """Stand-in tokenizer: one id per character; a chat turn is wrapped in markers (a batch of chats, as HF)."""

    def __call__(self, texts, return_attention_mask=True, return_token_type_ids=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}

    def apply_chat_template(self, chats, add_generation_prompt, tokenize, return_dict):
        return [[ord(c) for c in f"<user>{chat[0]['content']}</user><assistant>"] for chat in chats]


def test_build_dataset_applies_prompt_template_then_chat_template():
    from chatgen.generation.vllm.module import VLLMModule

    module = SimpleNamespace(
        config=config(
            load="/m",
            seq_length=64,
            max_new_tokens=8,
            prompt_template="Q: {prompt} A:",
            chat_template=True,
        ),
        tokenizer=CharTokenizer(),
    )
    (item,) = VLLMModule.build_dataset(module, ["2+2 {x}"])
    assert item["prompt"] == "2+2 {x}"  # as given: what rewards and logs see
    assert "".join(map(chr, item["input_ids"])) == "<user>Q: 2+2 {x} A:</user><assistant>"
    with pytest.raises(ConfigError, match=r"prompt_template: 'Q:' has no \{prompt\}"):
        config(load="/m", prompt_template="Q:")


def releasing_engines(policy_config) -> list:
    """The engines a run's WeightLinks frees while their colocated trainer trains, for a CPU
    policy with `policy_config` (fakes for the actor handles: the choice is WeightLinks' own)."""
    from chatgen.rlhf.weight_links import WeightLinks

    group = object()
    handles = {
        name: SimpleNamespace(group=group, entry=SimpleNamespace(num_gpu=0, config=cfg))
        for name, cfg in [("trainer", SimpleNamespace()), ("policy", policy_config)]
    }
    return WeightLinks(handles, {"trainer": "policy"}).releasing


def test_every_config_key_is_passed_on_or_rejected(tmp_path):
    """Changing any VLLMConfig key changes what vLLM receives, or is refused: no key is silently ignored."""
    from chatgen.generation.vllm.module import VLLMModule

    fields = {f.name for f in dataclasses.fields(VLLMConfig)}
    assert fields == set(KEY_DESTINATIONS), (
        f"VLLMConfig keys without a destination here: "
        f"{sorted(fields - set(KEY_DESTINATIONS))}; listed but gone: "
        f"{sorted(set(KEY_DESTINATIONS) - fields)}"
    )
    for d in (tmp_path / "model", tmp_path / "tok"):
        d.mkdir()
        (d / "tokenizer.json").write_text("{}")
    probes = {
        "engine": lambda c: vc.engine_kwargs(c, str(tmp_path / "model"), cpu=False),
        "sampling": lambda c: (
            gc.sampling_kwargs(c, 10),
            gc.sampling_kwargs(c, 10, is_eval=True),
            gc.prompt_budget(c),
        ),
        "stop list": lambda c: gc.parse_stop_list(c.stop_token_list, SpecialTokens()),
        "model": lambda c: VLLMModule.model_provider(SimpleNamespace(config=c)),
        "dataset": lambda c: VLLMModule.build_dataset(
            SimpleNamespace(config=c, tokenizer=CharTokenizer()), ["hi"]
        ),
        "user": model_args,
        "pad": lambda c: gc.pad_token_id(None, tmp_path / "model", c.pad_token_id),
        "links": releasing_engines,
    }
    base = config(load=str(tmp_path / "model"), seq_length=512, max_new_tokens=64)
    vc.check_vllm_config(base, cpu=True)
    for key, (destinations, value) in KEY_DESTINATIONS.items():
        value = str(tmp_path / "tok") if value == "OTHER_TOKENIZER" else value
        assert value != getattr(base, key), key
        changed = dataclasses.replace(base, **{key: value})
        if destinations == {"rejected"}:
            with pytest.raises(ConfigError, match=f"{key}: "):
                vc.check_vllm_config(changed, cpu=True)
            continue
        vc.check_vllm_config(changed, cpu=False)
        for where in destinations:
            assert probes[where](changed) != probes[where](base), (
                f"{key}={value!r} does not reach the {where}"
            )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="remote"), "mode='remote' is not one of"),
        (dict(logprobs=5), r"logprobs=5; only 0 \(the sampled token's log-prob\)"),
        (dict(top_k=-1), "use 0 to turn top-k off"),
        (dict(mode="server"), "needs server_base_url"),
        (
            dict(
                mode="server",
                server_base_url="http://127.0.0.1:1",
                max_model_length=64,
                enforce_eager=True,
            ),
            r"enforce_eager, max_model_length configure the engine, which the server owns",
        ),
        (
            dict(mode="server", server_base_url="http://127.0.0.1:1", weight_transport="nccl"),
            r"weight_transport='nccl' is not one of \('auto', 'shm', 'group'\)",
        ),
        (dict(weight_transport="shm"), "weight_transport='shm' is for mode='server'"),
        (
            dict(mode="server", server_base_url="http://127.0.0.1:1", request_timeout=0),
            "request_timeout=0; give",
        ),
    ],
)
def test_vllm_generation_refuses_bad_arguments_before_starting_an_engine(kwargs, message):
    from chatgen import VLLMGeneration

    with pytest.raises(ValueError, match=message):
        VLLMGeneration("/no/such/model", **kwargs)


@pytest.mark.parametrize(
    "url, weight_transport, expected",
    [
        ("http://127.0.0.1:8000", "auto", "shm"),
        ("http://localhost:8000/", "auto", "shm"),
        ("http://[::1]:8000", "auto", "shm"),
        ("http://10.1.2.3:8000", "auto", "group"),
        ("http://127.0.0.1:8000", "group", "group"),
        ("http://10.1.2.3:8000", "shm", "shm"),
    ],
)
def test_vllm_generation_picks_shared_memory_for_a_loopback_server(
    url, weight_transport, expected, monkeypatch
):
    from chatgen import VLLMGeneration

    gen = VLLMGeneration(
        "/no/such/model", "server", server_base_url=url, weight_transport=weight_transport
    )
    assert gen._transport == expected  # no request is sent before the first sync
    # on GPUs auto leaves the weights to NCCL
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gen = VLLMGeneration(
        "/no/such/model", "server", server_base_url=url, weight_transport=weight_transport
    )
    assert gen._transport == ("group" if weight_transport == "auto" else expected)


@pytest.mark.faults
def test_a_stalled_server_raises_a_timeout_instead_of_hanging_the_trainer():
    """Server mode's HTTP calls had no timeout: a server that accepts and never answers hung the trainer."""
    import socket
    import threading
    import time

    from chatgen import VLLMGeneration

    with socket.socket() as stalled:  # accepts connections (the kernel's backlog) and never answers
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        gen = VLLMGeneration(
            "/no/such/model",
            "server",
            server_base_url=f"http://127.0.0.1:{stalled.getsockname()[1]}",
            request_timeout=1,
            weight_transport="group",
        )
        errors = []

        def call(fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the test looks at it
                errors.append(e)

        start = time.monotonic()
        calls = [
            threading.Thread(target=call, args=(fn,), daemon=True)
            for fn in (
                lambda: gen.generate([[1, 2, 3]]),
                lambda: gen.sync_weights([("w", torch.ones(2))]),
            )
        ]
        for t in calls:
            t.start()
        for t in calls:
            t.join(30)
        assert not any(t.is_alive() for t in calls) and time.monotonic() - start < 15
    assert len(errors) == 2 and all(isinstance(e, TimeoutError) for e in errors), errors
    assert "/v1/completions: no answer within 1 s (VLLMGeneration's request_timeout)" in str(
        errors[0]
    ) + str(errors[1])
    assert "/control/weights/begin: no answer within 1 s" in str(errors[0]) + str(errors[1])
