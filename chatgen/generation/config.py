"""The keys every generation backend reads (`GenerationConfig`) and what they mean for a request.

A backend's own per-model config subclasses GenerationConfig with its engine keys (vLLM's:
chatgen/generation/vllm/config.py). Everything here is pure Python: prompt budgets, sampling
settings of one request (as a dict of vLLM `SamplingParams` keyword names, which every backend
reads), stop lists, the sequence length from config.json, the pad token. Unit-tested in
tests/unit/test_generation.py.
"""

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Literal, Optional

from chatgen.config import DTYPES, USER_KEYS_DOC, ConfigError, args_problem, opt


@dataclasses.dataclass(kw_only=True)
class GenerationConfig:
    load: Optional[str] = opt(None, "Hugging Face model directory to load (required)", path=True)
    tokenizer: Optional[str] = opt(
        None, "tokenizer directory; null = the `load` directory", path=True
    )
    load_format: Literal["auto", "dummy"] = opt(
        "auto",
        "auto: the weights of `load`; dummy: random weights of its shape (a policy whose weights always come "
        "from a trainer's sync first: faster start, as verl's rollout does)",
    )
    dtype: DTYPES = opt("float32", "weights and activations dtype")
    seed: int = opt(1234, "sampling seed")
    # prompts (build_dataset)
    prompt_template: Optional[str] = opt(
        None,
        "format of each text prompt before tokenizing, with {prompt}, e.g. 'Question: {prompt}\\nAnswer:'; null = as is",
    )
    chat_template: bool = opt(
        False,
        "render each text prompt as one user message with the tokenizer's chat template "
        "(instruct models), after prompt_template",
    )
    # sampling
    n: int = opt(1, "responses per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(
        1.0, "nucleus sampling: keep the smallest token set with this much probability; 1.0 = off"
    )
    top_k: int = opt(-1, "keep the k most likely tokens; -1 = off")
    min_p: float = opt(0.0, "drop tokens below min_p times the top token's probability; 0 = off")
    repetition_penalty: float = opt(
        1.0,
        "penalise tokens already in the prompt or response (positive logits divided by it, negative ones multiplied); > 1 discourages repeats, 1.0 = off",
    )
    ignore_eos: bool = opt(False, "keep generating after EOS (until the token limit)")
    use_beam_search: bool = opt(False, "beam search instead of sampling")
    eval_n: Optional[int] = opt(
        None,
        "responses per held-out prompt in evaluation, for "
        "eval/pass@k and eval/mean@k (verl: val_kwargs.n); null = "
        "n; 1 when greedy",
    )
    eval_temperature: Optional[float] = opt(None, "temperature in evaluation; null = temperature")
    eval_top_p: Optional[float] = opt(None, "top_p in evaluation; null = top_p")
    eval_top_k: Optional[int] = opt(None, "top_k in evaluation; null = top_k")
    stop_token_list: str = opt(
        "",
        "stops separated by ';', e.g. '</answer>;\\n\\n'; a special token (e.g. '</s>') stops on its id; '' = EOS only",
    )
    new_token_limit: bool = opt(
        False, "True: stop at max_new_tokens; False: generate until seq_length"
    )
    max_new_tokens: int = opt(256, "generated tokens per response when new_token_limit is true")
    seq_length: Optional[int] = opt(
        None, "prompt + response tokens at most; null = the model's max_position_embeddings"
    )
    prompt_logprobs: Optional[int] = opt(
        None, "logprobs of prompt tokens (top-N; 0 = the token only); null = off"
    )
    pad_token_id: Optional[int] = opt(
        None,
        "the id that pads token batches in and out of generate() (NeMo RL's pad_token_id, e.g. 0); null = the "
        "tokenizer's pad token, else its EOS",
    )
    logprobs_mode: Literal["raw", "processed"] = opt(
        "processed",
        "logprobs of the raw logits, or of the distribution after temperature/top-p/top-k",
    )
    generation_batch_size: Optional[int] = opt(
        None,
        "sequences generated together (vLLM: max_num_seqs per engine step; each prompt makes n); null = runtime.generation_batch_size in a run, the backend's default standalone",
    )
    args: dict[str, Any] = opt({}, USER_KEYS_DOC)

    def check(self):
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            yield (
                "prompt_template",
                (
                    f"{self.prompt_template!r} has no {{prompt}}; write where the prompt goes, e.g. "
                    "'Question: {prompt}\\nAnswer:'"
                ),
            )
        if self.temperature < 0:
            yield "temperature", f"must be >= 0, got {self.temperature}; use 0 for greedy decoding"
        if self.eval_temperature is not None and self.eval_temperature < 0:
            yield (
                "eval_temperature",
                f"must be >= 0, got {self.eval_temperature}; use 0 for greedy decoding",
            )
        for key in ("top_p", "eval_top_p"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                yield key, f"must be in (0, 1], got {value}; use 1.0 to turn top-p off"
        for key in ("top_k", "eval_top_k"):
            value = getattr(self, key)
            if value is not None and (value == 0 or value < -1):
                yield key, f"must be -1 (off) or >= 1, got {value}; use -1 to turn top-k off"
        if not 0 <= self.min_p <= 1:
            yield "min_p", f"must be in [0, 1], got {self.min_p}; use 0 to turn min-p off"
        if self.repetition_penalty <= 0:
            yield (
                "repetition_penalty",
                f"must be > 0, got {self.repetition_penalty}; use 1.0 to turn it off",
            )
        if self.n < 1:
            yield "n", f"must be >= 1, got {self.n}; set responses per prompt"
        if self.eval_n is not None and self.eval_n < 1:
            yield (
                "eval_n",
                (f"must be >= 1 or null, got {self.eval_n}; set responses per held-out prompt"),
            )
        if (self.eval_n or 1) > 1 and samples_per_prompt(self, is_eval=True) == 1:
            yield (
                "eval_n",
                (
                    f"{self.eval_n} responses per held-out prompt, but evaluation decodes "
                    "greedily (eval_temperature 0: one response); set "
                    "eval_temperature > 0 to sample them"
                ),
            )
        if self.max_new_tokens < 1:
            yield (
                "max_new_tokens",
                f"must be >= 1, got {self.max_new_tokens}; set a positive token count",
            )
        elif self.seq_length is not None and self.max_new_tokens >= self.seq_length:
            yield (
                "max_new_tokens",
                (
                    f"{self.max_new_tokens} leaves no room for a prompt in seq_length="
                    f"{self.seq_length}; raise seq_length or lower max_new_tokens"
                ),
            )
        if self.pad_token_id is not None and self.pad_token_id < 0:
            yield "pad_token_id", f"must be a token id (>= 0) or null, got {self.pad_token_id}"
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            yield (
                "prompt_logprobs",
                f"must be >= 0 or null, got {self.prompt_logprobs}; use null to turn it off",
            )
        if self.use_beam_search:
            yield (
                "use_beam_search",
                (
                    "not supported: chatgen's generation backends sample, none runs beam search "
                    "(vLLM's LLM.beam_search is a separate offline API); set it to false and use "
                    "n > 1 sampling"
                ),
            )
        if self.temperature == 0 and self.n > 1:
            yield (
                "n",
                (
                    f"n={self.n} with temperature 0 would give {self.n} identical responses (vLLM rejects it); "
                    "set temperature > 0 or n: 1"
                ),
            )
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            yield (
                "generation_batch_size",
                (
                    f"must be >= 1 or null, got {self.generation_batch_size}; use null for "
                    "the default"
                ),
            )
        if problem := args_problem(self):
            yield "args", problem


def check_config(cfg) -> None:
    """Raise one ConfigError listing every problem of a config built (or changed) in code: its
    schema's checks."""
    problems = list(cfg.check())
    if problems:
        raise ConfigError([f"{key}: {msg}" for key, msg in problems])


def prompt_budget(cfg) -> int:
    """Prompt tokens at most: seq_length - max_new_tokens, whatever new_token_limit says
    (ChatLearn's max_prompt_length). A prompt within it always leaves a response at least
    max_new_tokens: exactly that with new_token_limit: true, the rest of seq_length with false.
    The one rule of build_dataset (which cuts longer prompts), run_generation and generate (which
    refuse them)."""
    if cfg.seq_length is None:
        raise ValueError(
            "seq_length is not resolved yet: the module's setup() sets it from the model "
            "(or set seq_length in the config)"
        )
    return cfg.seq_length - cfg.max_new_tokens


def check_prompt_length(cfg, prompt_len: int, name: str) -> None:
    """ValueError naming the prompt (`name`, e.g. "generate(): row 3") when it is over
    `prompt_budget`."""
    budget = prompt_budget(cfg)
    if prompt_len > budget:
        raise ValueError(
            f"{name} has {prompt_len} prompt tokens, over the prompt budget seq_length - "
            f"max_new_tokens = {cfg.seq_length} - {cfg.max_new_tokens} = {budget}; shorten it, "
            "raise seq_length or lower max_new_tokens (build_dataset cuts text prompts to the budget)"
        )


def check_prompt_ids(ids, vocab_size: int, name: str) -> None:
    """ValueError naming the prompt when a token id is outside the model's vocabulary [0,
    vocab_size) (the embedding lookup would abort the process)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{name}: token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab_size}); the ids "
            "come from another tokenizer or model?"
        )


def check_vocab(tokenizer_size: int, vocab_size: int, tokenizer_from, model_dir) -> str | None:
    """Setup check of the tokenizer against the model. A tokenizer with more tokens than the
    model has embedding rows is a ConfigError naming both (its ids past the model's vocabulary
    would abort the process). Fewer is the usual padded vocabulary (Qwen2.5: 151665 tokens,
    151936 rows), returned as a warning: a sampled id without text cannot be detokenized."""
    where = (
        f"the tokenizer of {tokenizer_from} has {tokenizer_size} tokens, the model {model_dir}/config.json "
        f"has vocab_size={vocab_size}"
    )
    if tokenizer_size > vocab_size:
        raise ConfigError(
            [
                f"tokenizer: {where}; ids past {vocab_size - 1} have no embedding row. Use the model's "
                "own tokenizer (the `tokenizer` key, or the tokenizer files in the model directory)"
            ]
        )
    if tokenizer_size < vocab_size:
        return (
            f"{where}: ids {tokenizer_size}..{vocab_size - 1} have no text. Fine for a padded vocabulary whose "
            "extra rows are never sampled; otherwise such an id decodes to nothing, and with stop strings "
            "vLLM's detokenizer fails on it (use the model's own tokenizer)"
        )
    return None


def max_tokens(cfg, prompt_len: int) -> int:
    """Tokens a response may take: max_new_tokens (new_token_limit: true) or what seq_length
    leaves."""
    check_prompt_length(cfg, prompt_len, "a prompt")
    return cfg.max_new_tokens if cfg.new_token_limit else cfg.seq_length - prompt_len


def samples_per_prompt(cfg, is_eval: bool = False) -> int:
    """Responses per prompt of a train (or eval) call: n (eval_n where set), or 1 when it decodes
    greedily."""
    temperature = (
        cfg.eval_temperature if is_eval and cfg.eval_temperature is not None else cfg.temperature
    )
    n = cfg.eval_n if is_eval and cfg.eval_n is not None else cfg.n
    return 1 if temperature == 0 else n


def sampling_kwargs(
    cfg, prompt_len, *, is_eval=False, greedy=False, stop_strings=(), stop_token_ids=()
) -> dict:
    """Keyword arguments for `vllm.SamplingParams` for one prompt of `prompt_len` tokens.

    Train: n, temperature, top_p, top_k, min_p, repetition_penalty. Eval: eval_n /
    eval_temperature / eval_top_p / eval_top_k where set, else the train values. Greedy
    (greedy=True or an effective temperature of 0) yields one response.
    """

    def pick(key):
        value = getattr(cfg, f"eval_{key}") if is_eval else None
        return getattr(cfg, key) if value is None else value

    temperature = 0.0 if greedy else pick("temperature")
    return dict(
        n=1 if temperature == 0 else pick("n"),
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

    An entry that is one of the tokenizer's special tokens (e.g. "</s>", "<|im_end|>") stops on that
    token id: special tokens are left out of the decoded text, so a string match would never see
    them. Any other entry is a stop string matched on the decoded text.
    """
    entries = [s for s in (stop_token_list or "").split(";") if s]
    special = {}
    if tokenizer is not None:
        special = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
        special.update(tokenizer.get_added_vocab())
    return tuple(s for s in entries if s not in special), tuple(
        special[s] for s in entries if s in special
    )


def resolve_seq_length(cfg, model_dir):
    """`cfg` with `seq_length` set: null means the model's own limit (config.json
    max_position_embeddings).

    A longer seq_length than the model's positions is an error naming both (RoPE past its trained
    range gives garbage; vLLM refuses it too).
    """
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    limit = hf.get("max_position_embeddings")
    if cfg.seq_length is None:
        if limit is None:
            raise ConfigError(
                [
                    f"seq_length: {model_dir}/config.json has no max_position_embeddings; set seq_length"
                ]
            )
        cfg = dataclasses.replace(cfg, seq_length=int(limit))
    elif limit is not None and cfg.seq_length > limit:
        raise ConfigError(
            [
                f"seq_length: {cfg.seq_length} is longer than the model's max_position_embeddings="
                f"{limit} ({model_dir}/config.json); set seq_length <= {limit} or leave it null"
            ]
        )
    check_config(cfg)  # max_new_tokens against the now-known seq_length
    return cfg


def pad_token_id(tokenizer, model_dir, configured: int | None = None) -> int:
    """The id that pads token batches: `configured` (the `pad_token_id` key) when set, else the
    tokenizer's pad token, else its EOS. A token-only model (no tokenizer) uses its own:
    pad_token_id, else eos_token_id (the first of a list), from generation_config.json then
    config.json; 0 if neither file names one."""
    if configured is not None:
        return configured
    if tokenizer is not None:
        ids = [getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    else:
        files = [Path(model_dir) / name for name in ("generation_config.json", "config.json")]
        hf = [json.loads(f.read_text()) for f in files if f.exists()]
        ids = [d.get(key) for key in ("pad_token_id", "eos_token_id") for d in hf]
    ids = [i[0] if isinstance(i, list) and i else i for i in ids]
    return next((i for i in ids if isinstance(i, int)), 0)


def tokenizer_dir(cfg, model_dir):
    """Where the tokenizer comes from: the `tokenizer` key, else the model directory. A
    `tokenizer` that holds none is a ConfigError (a typo must not silently give a token-only
    model)."""
    if cfg.tokenizer and not has_tokenizer(cfg.tokenizer):
        raise ConfigError(
            [
                f"tokenizer: {cfg.tokenizer} holds no tokenizer (tokenizer.json, tokenizer.model or "
                "tokenizer_config.json); fix the path, or remove the key to use the model's own"
            ]
        )
    return cfg.tokenizer or model_dir


def has_tokenizer(directory) -> bool:
    """Whether an HF directory holds a tokenizer (else the engine runs token-only)."""
    d = Path(directory)
    return any(
        (d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
