"""From a per-model `VLLMConfig` to vLLM's engine and sampling arguments (pure: imports neither vLLM nor torch).

Every key of docs/generation_keys.md is either mapped here or rejected by `check_vllm_config` with the reason
and the fix; nothing is silently ignored. Unit-tested in tests/unit/test_generation.py.
"""
import dataclasses
import functools
import json
from pathlib import Path

from chatgen.config import ConfigError

# logprobs_mode -> vLLM's: log-softmax of the model's raw logits, or of the logits after temperature/top-k/top-p
LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def platform_problems(cfg, cpu: bool):
    """(key, problem) pairs for keys this platform cannot honour (the loader's `extra_check`)."""
    if cpu and cfg.block_size is not None and cfg.block_size % 32:
        yield "block_size", (f"{cfg.block_size} does not fit vLLM's CPU attention, which needs a multiple of 32; "
                             "use 128 (vLLM's CPU default) or remove the key")


def check_vllm_config(cfg, cpu: bool) -> None:
    """Raise one ConfigError listing every problem of a config built in code: the schema's checks
    (VLLMConfig.check, which also rejects the keys vLLM V1 cannot honour) plus the platform's."""
    problems = [*cfg.check(), *platform_problems(cfg, cpu)]
    if problems:
        raise ConfigError([f"{key}: {msg}" for key, msg in problems])


def engine_kwargs(cfg, model_dir, cpu: bool, distributed_executor_backend=None) -> dict:
    """Keyword arguments for `vllm.LLM(model_dir, **kwargs)`; unset (None) keys keep vLLM's defaults."""
    tokenizer = cfg.tokenizer or model_dir
    if cfg.tokenizer and not has_tokenizer(cfg.tokenizer):  # a typo must not silently give a token-only engine
        raise ConfigError([f"tokenizer: {cfg.tokenizer} holds no tokenizer (tokenizer.json, tokenizer.model or "
                           "tokenizer_config.json); fix the path, or remove the key to use the model's own"])
    kwargs = dict(
        tokenizer=str(tokenizer),
        skip_tokenizer_init=not has_tokenizer(tokenizer),  # token-only engine for a model without one
        dtype=cfg.dtype,
        seed=cfg.seed,
        max_model_len=cfg.seq_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend=distributed_executor_backend,
        enforce_eager=cfg.enforce_eager,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        block_size=cfg.block_size,
        max_num_seqs=cfg.generation_batch_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        logprobs_mode=LOGPROBS_MODES[cfg.logprobs_mode],
        # recorded routing must cover every prompt token of every sample: no prompt served from the cache
        enable_prefix_caching=False if cfg.return_routed_experts else None,
    )
    if cpu and cfg.kv_cache_memory_bytes is None:
        kwargs["kv_cache_memory_bytes"] = default_cpu_kv_cache_bytes(model_dir, cfg)
    return {key: value for key, value in kwargs.items() if value is not None}


def prompt_budget(cfg) -> int:
    """Prompt tokens at most: seq_length - max_new_tokens, whatever new_token_limit says (ChatLearn's
    max_prompt_length). A prompt within it always leaves a response at least max_new_tokens: exactly that with
    new_token_limit: true, the rest of seq_length with false. The one rule of build_dataset (which cuts longer
    prompts), run_generation and generate (which refuse them)."""
    if cfg.seq_length is None:
        raise ValueError("seq_length is not resolved yet: VLLMModule.setup() sets it from the model "
                         "(or set seq_length in the config)")
    return cfg.seq_length - cfg.max_new_tokens


def check_prompt_length(cfg, prompt_len: int, name: str) -> None:
    """ValueError naming the prompt (`name`, e.g. "generate(): row 3") when it is over `prompt_budget`."""
    budget = prompt_budget(cfg)
    if prompt_len > budget:
        raise ValueError(f"{name} has {prompt_len} prompt tokens, over the prompt budget seq_length - "
                         f"max_new_tokens = {cfg.seq_length} - {cfg.max_new_tokens} = {budget}; shorten it, "
                         "raise seq_length or lower max_new_tokens (build_dataset cuts text prompts to the budget)")


def check_prompt_ids(ids, vocab_size: int, name: str) -> None:
    """ValueError naming the prompt when a token id is outside the model's vocabulary [0, vocab_size) (the
    embedding lookup would abort the process)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab_size}); the ids "
                         "come from another tokenizer or model?")


def check_vocab(tokenizer_size: int, vocab_size: int, tokenizer_from, model_dir) -> str | None:
    """Setup check of the tokenizer against the model. A tokenizer with more tokens than the model has
    embedding rows is a ConfigError naming both (its ids past the model's vocabulary would abort the process).
    Fewer is the usual padded vocabulary (Qwen2.5: 151665 tokens, 151936 rows), returned as a warning: a sampled
    id without text cannot be detokenized."""
    where = f"the tokenizer of {tokenizer_from} has {tokenizer_size} tokens, the model {model_dir}/config.json " \
            f"has vocab_size={vocab_size}"
    if tokenizer_size > vocab_size:
        raise ConfigError([f"tokenizer: {where}; ids past {vocab_size - 1} have no embedding row. Use the model's "
                           "own tokenizer (the `tokenizer` key, or the tokenizer files in the model directory)"])
    if tokenizer_size < vocab_size:
        return (f"{where}: ids {tokenizer_size}..{vocab_size - 1} have no text. Fine for a padded vocabulary whose "
                "extra rows are never sampled; otherwise such an id decodes to nothing, and with stop strings "
                "vLLM's detokenizer fails on it (use the model's own tokenizer)")
    return None


def max_tokens(cfg, prompt_len: int) -> int:
    """Tokens a response may take: max_new_tokens (new_token_limit: true) or what seq_length leaves."""
    check_prompt_length(cfg, prompt_len, "a prompt")
    return cfg.max_new_tokens if cfg.new_token_limit else cfg.seq_length - prompt_len


def sampling_kwargs(cfg, prompt_len, *, is_eval=False, greedy=False, stop_strings=(), stop_token_ids=()) -> dict:
    """Keyword arguments for `vllm.SamplingParams` for one prompt of `prompt_len` tokens.

    Train: n, temperature, top_p, top_k, min_p, repetition_penalty. Eval: eval_temperature / eval_top_p / eval_top_k where set,
    else the train values. Greedy (greedy=True or an effective temperature of 0) yields one response.
    """
    def pick(key):
        value = getattr(cfg, f"eval_{key}") if is_eval else None
        return getattr(cfg, key) if value is None else value

    temperature = 0.0 if greedy else pick("temperature")
    return dict(
        n=1 if temperature == 0 else cfg.n,
        temperature=temperature,
        top_p=pick("top_p"),
        top_k=max(pick("top_k"), 0),  # chatgen (ChatLearn) -1 = off; vLLM 0 = off
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        ignore_eos=cfg.ignore_eos,
        max_tokens=max_tokens(cfg, prompt_len),
        stop=list(stop_strings),
        stop_token_ids=list(stop_token_ids),
        logprobs=0,  # the sampled token's logprob only
        prompt_logprobs=cfg.prompt_logprobs,
    )


@functools.lru_cache(maxsize=16)
def parse_stop_list(stop_token_list: str, tokenizer) -> tuple:
    """Split `stop_token_list` ("a;b;c") into (stop strings, stop token ids).

    An entry that is one of the tokenizer's special tokens (e.g. "</s>", "<|im_end|>") stops on that token id:
    special tokens are left out of the decoded text, so a string match would never see them. Any other entry
    is a stop string matched on the decoded text.
    """
    entries = [s for s in (stop_token_list or "").split(";") if s]
    special = {}
    if tokenizer is not None:
        special = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
        special.update(tokenizer.get_added_vocab())
    return tuple(s for s in entries if s not in special), tuple(special[s] for s in entries if s in special)


def resolve_seq_length(cfg, model_dir):
    """`cfg` with `seq_length` set: null means the model's own limit (config.json max_position_embeddings).

    A longer seq_length than the model's positions is an error naming both (RoPE past its trained range
    gives garbage; vLLM refuses it too).
    """
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    limit = hf.get("max_position_embeddings")
    if cfg.seq_length is None:
        if limit is None:
            raise ConfigError([f"seq_length: {model_dir}/config.json has no max_position_embeddings; set seq_length"])
        cfg = dataclasses.replace(cfg, seq_length=int(limit))
    elif limit is not None and cfg.seq_length > limit:
        raise ConfigError([f"seq_length: {cfg.seq_length} is longer than the model's max_position_embeddings="
                           f"{limit} ({model_dir}/config.json); set seq_length <= {limit} or leave it null"])
    check_vllm_config(cfg, cpu=False)  # max_new_tokens against the now-known seq_length
    return cfg


def pad_token_id(tokenizer, model_dir) -> int:
    """The id that pads token batches: the tokenizer's pad token, else its EOS. A token-only model (no
    tokenizer) uses its own: pad_token_id, else eos_token_id (the first of a list), from generation_config.json
    then config.json; 0 if neither file names one."""
    if tokenizer is not None:
        ids = [getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    else:
        files = [Path(model_dir) / name for name in ("generation_config.json", "config.json")]
        hf = [json.loads(f.read_text()) for f in files if f.exists()]
        ids = [d.get(key) for key in ("pad_token_id", "eos_token_id") for d in hf]
    ids = [i[0] if isinstance(i, list) and i else i for i in ids]
    return next((i for i in ids if isinstance(i, int)), 0)


def has_tokenizer(directory) -> bool:
    """Whether an HF directory holds a tokenizer (else the engine runs token-only)."""
    d = Path(directory)
    return any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM 0.32's CPU attention default


def default_cpu_kv_cache_bytes(model_dir, cfg) -> int:
    """KV cache for (generation_batch_size or 8) sequences of seq_length tokens, each rounded up to whole
    KV blocks (vLLM refuses a cache that cannot hold one full-length sequence). vLLM's own CPU default
    reserves most of the machine's RAM."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[cfg.dtype]
    block = cfg.block_size or CPU_DEFAULT_BLOCK_SIZE
    tokens_per_sequence = -(-cfg.seq_length // block) * block
    return per_token * tokens_per_sequence * (cfg.generation_batch_size or 8)
