"""`chatgen.VLLMModule`: vLLM generation that the framework drives one engine step at a time, in this process.

    from chatgen import VLLMModule
    module = VLLMModule({"load": "outputs/tiny-llama", "new_token_limit": True, "max_new_tokens": 16})
    module.setup()                                                   # builds the vLLM engine
    out = module.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)   # token in / token out
    texts = module.generate_text(["Once upon a time"])              # text in / text out (demos)

Subclass it and override the hooks to shape what a generation call returns; docs/vllm_module.md walks through
examples/policy_inference.py. The framework owns the loop (`run_generation`):

    _add_request(batch) -> while requests remain: schedule -> forward_step -> collect finished -> decode_internal

The vLLM engine stays in this process (no engine subprocess), so a trainer in the same process can write new
weights into it in place (`load_weights`) and put it to sleep between episodes (`sleep` / `wake_up`).
Everything that touches vLLM internals is in `chatgen.generation.vllm_adapter`.
"""
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from chatgen.config import ConfigError, VLLMConfig, load_model_config
from chatgen.generation import vllm_adapter as adapter

_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


class VLLMModule:
    """A vLLM generation model. Construct with its per-model config, call `setup()`, then generate.

    config: a `VLLMConfig`, a dict of its keys, or the path of a per-model YAML (docs/generation_keys.md).
    distributed_executor_backend: vLLM's executor; "external_launcher" runs one engine rank in each process
        of an existing torch.distributed job (colocation with a Megatron TP group, env RANK/WORLD_SIZE set);
        None = vLLM's default (one process for TP=1).

    Attributes after `setup()`: `engine` (the `vllm.LLM`), `tokenizer` (None for a model without one),
    `pad_token_id`, `metrics` (figures of the last generation call).
    """

    def __init__(self, config, *, distributed_executor_backend=None):
        if isinstance(config, (str, Path)):
            config = load_model_config(config, VLLMConfig)
        elif isinstance(config, dict):  # through the loader: unknown keys and types are checked the same way
            config = load_model_config(None, VLLMConfig, [f"{k}={json.dumps(v)}" for k, v in config.items()])
        elif not isinstance(config, VLLMConfig):
            raise TypeError(f"VLLMModule(config): expected a VLLMConfig, dict or YAML path, got {type(config).__name__}")
        check_vllm_config(config)
        self.config = config
        self.distributed_executor_backend = distributed_executor_backend
        self.engine = None
        self.tokenizer = None
        self.pad_token_id = 0
        self.metrics = {}
        self._request_ids = itertools.count()

    # ------------------------------------------------------------------ user hooks

    def model_provider(self) -> str:
        """Which model vLLM runs. Called once by `setup()`.

        Returns the Hugging Face model directory (config.json + safetensors; the architecture is read from
        config.json). Default: the `load` key. Override to pick the model in code.
        """
        if not self.config.load:
            raise ConfigError("load: not set; set it to the Hugging Face model directory vLLM should run")
        return self.config.load

    def setup(self) -> None:
        """Build the engine. Called once, before the first generation call.

        Default: starts `vllm.LLM(self.model_provider(), **self.engine_kwargs())` in this process and reads
        the tokenizer. Override to add work around it (load a checkpoint, ...) and call `super().setup()`.
        """
        self.engine = adapter.build_llm(self.model_provider(), **self.engine_kwargs())
        if not self.engine.llm_engine.model_config.skip_tokenizer_init:
            self.tokenizer = self.engine.get_tokenizer()
        tok = self.tokenizer
        self.pad_token_id = next((t for t in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None))
                                  if t is not None), 0)

    def build_dataset(self, prompts, is_eval=False) -> list:
        """Turn prompt strings into dataset items. The framework calls it on the train / eval prompts.

        prompts: list[str]. Returns list[dict], one per prompt: {"input_ids": list[int] (tokenized with the
        model's tokenizer, BOS included), "prompt": str}. Prompt budget: seq_length - max_new_tokens tokens.
        An empty prompt is an error; a longer prompt is cut to the budget when new_token_limit is false
        (ChatLearn's rule: seq_length bounds prompt + response) and is an error when it is true.
        """
        if self.tokenizer is None:
            raise RuntimeError("build_dataset needs a tokenizer; this model has none: pass token ids to generate()")
        budget = self.config.seq_length - self.config.max_new_tokens
        items = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"build_dataset: prompt {i} is empty or not a string ({prompt!r}); drop it")
            ids = self.tokenizer.encode(prompt)
            if len(ids) > budget:
                if self.config.new_token_limit:
                    raise ValueError(
                        f"build_dataset: prompt {i} has {len(ids)} tokens, over the budget seq_length - "
                        f"max_new_tokens = {budget}; shorten it, raise seq_length, or set new_token_limit: false "
                        f"to cut prompts to the budget")
                ids = ids[:budget]
            items.append({"input_ids": ids, "prompt": prompt})
        return items

    def _add_request(self, data, is_eval=False) -> list:
        """Queue a batch in the engine with the train (or eval) sampling parameters.

        Called by `run_generation` at the start of a call. data: list of dataset items (dicts with
        "input_ids": list[int], optional "prompt": str and "stop_strings": list[str]). Returns the request
        ids (in batch order). Override to set per-item sampling; call `self.add_request` for each item.
        """
        return self._queue(data, is_eval=is_eval)

    def forward_step(self, data, iteration):
        """Run one engine step on the batch the scheduler picked. Called once per step by the framework.

        data: `vllm_adapter.ScheduledBatch` (`request_ids`, `num_tokens` {request id: tokens this step},
        `total_tokens`); iteration: step number within this call, from 0. Must call
        `self.execute_step(data)` exactly once and return its result (the `RequestOutput`s that finished).
        """
        return self.execute_step(data)

    def decode_internal(self, batched_outputs) -> dict:
        """Turn the finished requests of a call into the module's output. Called once per `run_generation`.

        batched_outputs: list of vLLM `RequestOutput`, sorted by request id (= batch order); each has
        `prompt_token_ids`, `prompt` (text or None) and `outputs` (n `CompletionOutput`s with `token_ids`,
        `logprobs`, `text`, `finish_reason`). Default returns per-sample lists, S = prompts x n samples
        (sample j of prompt i at i * n + j):
            prompt_ids  list[list[int]]    prompt tokens          output_ids  list[list[int]]  generated tokens
            logprobs    list[list[float]]  one per output token   finish_reason  list[str]  "stop" | "length"
            prompt      list[str | None]   str_outputs  list[str]  (text, "" without a tokenizer)
        """
        out = {"prompt_ids": [], "prompt": [], "output_ids": [], "logprobs": [], "finish_reason": [], "str_outputs": []}
        for request, sample in iter_samples(batched_outputs):
            out["prompt_ids"].append(list(request.prompt_token_ids))
            out["prompt"].append(request.prompt)
            out["output_ids"].append(list(sample.token_ids))
            out["logprobs"].append(sample_logprobs(sample))
            out["finish_reason"].append(sample.finish_reason)
            out["str_outputs"].append(sample.text or "")
        return out

    # ------------------------------------------------------------------ framework API

    def engine_kwargs(self) -> dict:
        """Keyword arguments for `vllm.LLM`, derived from the config (every key is honoured or was rejected)."""
        cfg, model = self.config, self.model_provider()
        tokenizer = cfg.tokenizer or model
        kwargs = dict(
            tokenizer=tokenizer,
            skip_tokenizer_init=not has_tokenizer(tokenizer),
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.seq_length,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            logprobs_mode=_LOGPROBS_MODES[cfg.logprobs_mode],
            max_num_seqs=cfg.generation_batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
        )
        if kwargs["kv_cache_memory_bytes"] is None and on_cpu():
            kwargs["kv_cache_memory_bytes"] = default_cpu_kv_cache_bytes(model, cfg)
        if self.distributed_executor_backend:
            kwargs["distributed_executor_backend"] = self.distributed_executor_backend
        return {k: v for k, v in kwargs.items() if v is not None}

    def max_tokens(self, prompt_len: int) -> int:
        """Tokens a response may take: max_new_tokens (new_token_limit: true) or what seq_length leaves."""
        if self.config.new_token_limit:
            return self.config.max_new_tokens
        return self.config.seq_length - prompt_len

    def sampling_params(self, prompt_len, *, is_eval=False, greedy=False, stop_strings=()):
        """vLLM `SamplingParams` for one prompt of `prompt_len` tokens.

        Train: n, temperature, top_p, top_k, min_p. Eval: eval_temperature / eval_top_p / eval_top_k where set.
        Greedy (greedy=True or a temperature of 0) yields one response per prompt. Logprobs: the sampled
        token's (raw or processed per logprobs_mode); prompt_logprobs if set.
        """
        cfg = self.config
        pick = lambda key: getattr(cfg, f"eval_{key}") if is_eval and getattr(cfg, f"eval_{key}") is not None \
            else getattr(cfg, key)  # noqa: E731
        temperature = 0.0 if greedy else pick("temperature")
        config_stop_strings, stop_token_ids = parse_stop_list(cfg.stop_token_list, self.tokenizer)
        stop = [*config_stop_strings, *stop_strings]
        if stop and self.tokenizer is None:
            raise ValueError(f"stop strings {stop} need a tokenizer to match text; this model has none: "
                             "use stop token ids (special tokens in stop_token_list) or add a tokenizer")
        return adapter.SamplingParams(
            n=1 if temperature == 0 else cfg.n,
            temperature=temperature,
            top_p=pick("top_p"),
            top_k=max(pick("top_k"), 0),  # vLLM: 0 = off; chatgen keeps ChatLearn's -1
            min_p=cfg.min_p,
            ignore_eos=cfg.ignore_eos,
            max_tokens=self.max_tokens(prompt_len),
            stop=stop,
            stop_token_ids=list(stop_token_ids),
            logprobs=0,  # the sampled token's logprob only
            prompt_logprobs=cfg.prompt_logprobs,
            detokenize=self.tokenizer is not None,
        )

    def add_request(self, prompt_ids, params, prompt_text=None) -> str:
        """Queue one prompt (list[int]) with `params` (from `sampling_params`); returns its request id."""
        if not prompt_ids:
            raise ValueError("add_request: empty prompt; every prompt needs at least one token (e.g. BOS)")
        if len(prompt_ids) >= self.config.seq_length:
            raise ValueError(f"add_request: prompt of {len(prompt_ids)} tokens leaves no room to generate in "
                             f"seq_length={self.config.seq_length}; shorten it or raise seq_length")
        request_id = str(next(self._request_ids))
        adapter.add_request(self.engine, request_id, prompt_ids, params, prompt_text)
        return request_id

    def execute_step(self, data):
        """Run the model on a scheduled batch (`forward_step`'s data); returns the requests that finished."""
        return adapter.execute(self.engine, data)

    def run_generation(self, data, is_eval=False):
        """Generate for a batch of dataset items with the hooks: the framework-owned loop.

        data: list of items from `build_dataset`. Returns `decode_internal(...)`; `self.metrics` has the
        call's figures.
        """
        return self.decode_internal(self._drive(lambda: self._add_request(data, is_eval)))

    def generate(self, batch, greedy=False) -> dict:
        """Token in, token out (NeMo RL's generation interface), with the train sampling parameters.

        batch: {"input_ids": (B, T) int tensor, right-padded; "input_lengths": (B,) int tensor;
                optional "stop_strings": list (length B) of list[str] or None, added to stop_token_list}.
        Returns, with S = B x n rows (sample j of prompt i at row i * n + j; n = 1 when greedy) and
        L = T + longest generation:
            output_ids                 (S, L) long   prompt + generated tokens, right-padded with pad_token_id
            logprobs                   (S, L) float  logprob of each generated token, 0 on prompt and padding
            generation_lengths         (S,)   long   generated tokens
            unpadded_sequence_lengths  (S,)   long   prompt + generated tokens
            truncated                  (S,)   bool   stopped by the token limit, not by EOS / a stop
        """
        prompts = unpad_batch(batch, self.pad_token_id)
        budget = self.config.seq_length - (self.config.max_new_tokens if self.config.new_token_limit else 1)
        for i, ids in enumerate(prompts):
            if len(ids) > budget:
                raise ValueError(f"generate(): row {i} has {len(ids)} prompt tokens, over the budget of {budget} "
                                 f"(seq_length={self.config.seq_length}, new_token_limit="
                                 f"{self.config.new_token_limit}); shorten it or raise seq_length")
        stops = batch.get("stop_strings") or [None] * len(prompts)
        items = [{"input_ids": ids, "stop_strings": stop} for ids, stop in zip(prompts, stops)]
        outputs = self._drive(lambda: self._queue(items, greedy=greedy))
        return generation_output(outputs, batch["input_ids"].shape[1], self.pad_token_id, batch["input_ids"].dtype)

    def generate_text(self, prompts, greedy=False, is_eval=False) -> list:
        """Text in, text out, for demos: list[str] -> list[str] of S = prompts x n responses (n = 1 if greedy)."""
        items = self.build_dataset(prompts, is_eval)
        return [s.text for _, s in iter_samples(self._drive(lambda: self._queue(items, is_eval, greedy)))]

    def sleep(self, level: int = 1) -> None:
        """Between episodes: pause the engine and free its GPU memory for the colocated trainer.

        level 1: drop the KV cache, offload weights to CPU; level 2: drop both (sync all weights after
        `wake_up`). On CPU vLLM 0.32 frees nothing (its CPU worker's sleep is a no-op): the engine pauses and
        the prefix cache is cleared; size the CPU cache with kv_cache_memory_bytes. Generating while asleep
        is an error.
        """
        adapter.sleep(self.engine, level)

    def wake_up(self) -> None:
        """Before the next episode: re-allocate weights and KV cache (GPU) and resume scheduling."""
        adapter.wake_up(self.engine)

    def is_sleeping(self) -> bool:
        return adapter.is_sleeping(self.engine)

    def load_weights(self, named_tensors) -> None:
        """Write HF-format (name, tensor) pairs into the engine in place (see `vllm_adapter.load_weights`)."""
        adapter.load_weights(self.engine, named_tensors)

    def shutdown(self) -> None:
        """Stop the engine and release its memory."""
        if self.engine is not None:
            adapter.shutdown(self.engine)
            self.engine = None

    # ------------------------------------------------------------------ the loop

    def _queue(self, items, is_eval=False, greedy=False) -> list:
        """add_request for each dataset item, with its own prompt length and stop strings; returns request ids."""
        return [
            self.add_request(item["input_ids"],
                             self.sampling_params(len(item["input_ids"]), is_eval=is_eval, greedy=greedy,
                                                  stop_strings=item.get("stop_strings") or ()),
                             prompt_text=item.get("prompt"))
            for item in items
        ]

    def _drive(self, add_requests) -> list:
        """Queue requests with `add_requests()`, step the engine until all finish; returns the finished
        `RequestOutput`s sorted by request id and records `self.metrics`."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before generating")
        if adapter.is_sleeping(self.engine):
            raise RuntimeError(f"{type(self).__name__} is asleep: call wake_up() before generating")
        start = time.perf_counter()
        request_ids, finished, steps, kv_peak = [], [], 0, 0.0
        try:
            request_ids = add_requests()
            while adapter.has_unfinished_requests(self.engine):
                scheduled = adapter.schedule(self.engine)
                kv_peak = max(kv_peak, adapter.kv_cache_usage(self.engine))
                finished += [o for o in self.forward_step(scheduled, steps) if o.finished]
                steps += 1
        except BaseException:
            adapter.abort(self.engine, request_ids)
            raise
        elapsed = time.perf_counter() - start
        finished.sort(key=lambda o: int(o.request_id))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
        generation_tokens = sum(len(s.token_ids) for _, s in iter_samples(finished))
        self.metrics = {
            "prompts": len(finished),
            "samples": sum(len(o.outputs) for o in finished),
            "prompt_tokens": prompt_tokens,
            "generation_tokens": generation_tokens,
            "engine_steps": steps,
            "elapsed_s": elapsed,
            "prompt_tokens_per_s": prompt_tokens / elapsed,
            "generation_tokens_per_s": generation_tokens / elapsed,
            "kv_cache_usage_peak": kv_peak,
        }
        return finished


# ---------------------------------------------------------------------- helpers (pure, unit-tested)

def check_vllm_config(cfg) -> None:
    """Reject keys that vLLM 0.32 (V1 engine) cannot honour, all in one ConfigError naming key and fix."""
    problems = list(cfg.check()) if hasattr(cfg, "check") else []
    if cfg.swap_space is not None:
        problems.append(("swap_space", "not supported: vLLM V1 recomputes preempted requests instead of swapping "
                                       "their KV cache to CPU; remove the key (size the KV cache with "
                                       "gpu_memory_utilization or kv_cache_memory_bytes)"))
    if cfg.sliding_window is not None:
        problems.append(("sliding_window", "not supported: vLLM V1 takes the sliding window from the model's "
                                           "config.json; remove the key and set `sliding_window` there"))
    if cfg.use_beam_search:
        problems.append(("use_beam_search", "not supported: vLLM V1 has no beam search in its step-driven engine "
                                            "(LLM.beam_search is a separate offline API); set it to false and "
                                            "use n > 1 sampling"))
    if cfg.temperature == 0 and cfg.n > 1:
        problems.append(("n", f"n={cfg.n} with temperature 0 would give {cfg.n} identical responses (vLLM rejects "
                              "it); set temperature > 0 or n: 1"))
    if cfg.block_size is not None and on_cpu() and cfg.block_size % 32:
        problems.append(("block_size", f"{cfg.block_size} does not fit vLLM's CPU attention, which needs a "
                                       "multiple of 32; use 128 (vLLM's CPU default) or remove the key"))
    if problems:
        raise ConfigError([f"{key}: {msg}" for key, msg in problems])


@functools.lru_cache(maxsize=16)
def parse_stop_list(stop_token_list: str, tokenizer) -> tuple:
    """Split `stop_token_list` ("a;b;c") into (stop strings, stop token ids).

    An entry that is one of the tokenizer's special tokens (e.g. "</s>", "<|im_end|>") stops on that token
    id: special tokens are left out of the decoded text, so a string match could never see them. Any other
    entry is a stop string matched on the decoded text.
    """
    entries = [s for s in (stop_token_list or "").split(";") if s]
    special = {}
    if tokenizer is not None:
        special = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
        special.update(tokenizer.get_added_vocab())
    return tuple(s for s in entries if s not in special), tuple(special[s] for s in entries if s in special)


def unpad_batch(batch, pad_token_id) -> list:
    """Right-padded (B, T) `input_ids` + (B,) `input_lengths` -> B lists of prompt token ids, or a ValueError
    naming the first bad row."""
    for key in ("input_ids", "input_lengths"):
        if key not in batch:
            raise ValueError(f"generate(): batch has no {key!r}; pass right-padded input_ids (B, T) and "
                             "input_lengths (B,)")
    ids, lengths = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["input_lengths"])
    if ids.dim() != 2 or lengths.shape != (ids.shape[0],):
        raise ValueError(f"generate(): input_ids must be (B, T) and input_lengths (B,); got {tuple(ids.shape)} "
                         f"and {tuple(lengths.shape)}")
    stops = batch.get("stop_strings")
    if stops is not None and len(stops) != ids.shape[0]:
        raise ValueError(f"generate(): stop_strings has {len(stops)} entries for {ids.shape[0]} rows; give one "
                         "list (or None) per row")
    prompts = []
    for i, (row, n) in enumerate(zip(ids.tolist(), lengths.tolist())):
        if not 1 <= n <= len(row):
            raise ValueError(f"generate(): row {i}: input_lengths[{i}]={n} is outside 1..{len(row)}")
        if any(t != pad_token_id for t in row[n:]):
            raise ValueError(f"generate(): row {i} is not right-padded: input_lengths[{i}]={n} but "
                             f"input_ids[{i}, {n}:] holds tokens other than pad_token_id={pad_token_id}; put "
                             "the prompt first and the padding after it")
        prompts.append(row[:n])
    return prompts


def iter_samples(request_outputs):
    """(RequestOutput, CompletionOutput) for every sample, prompt-major, samples in index order."""
    for request in request_outputs:
        for sample in sorted(request.outputs, key=lambda s: s.index):
            yield request, sample


def sample_logprobs(sample) -> list:
    """The logprob of each generated token of a `CompletionOutput` (requested with logprobs=0)."""
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def generation_output(request_outputs, input_width, pad_token_id, dtype=torch.long) -> dict:
    """Finished `RequestOutput`s -> the token-in/token-out output dict of `VLLMModule.generate`."""
    samples = list(iter_samples(request_outputs))
    width = input_width + max((len(s.token_ids) for _, s in samples), default=0)
    output_ids = torch.full((len(samples), width), pad_token_id, dtype=dtype)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    gen_lengths = torch.zeros(len(samples), dtype=torch.long)
    prompt_lengths = torch.zeros(len(samples), dtype=torch.long)
    truncated = torch.zeros(len(samples), dtype=torch.bool)
    for row, (request, sample) in enumerate(samples):
        p, g = len(request.prompt_token_ids), len(sample.token_ids)
        output_ids[row, :p] = torch.tensor(request.prompt_token_ids, dtype=dtype)
        if g:
            output_ids[row, p:p + g] = torch.tensor(sample.token_ids, dtype=dtype)
            logprobs[row, p:p + g] = torch.tensor(sample_logprobs(sample), dtype=torch.float32)
        gen_lengths[row], prompt_lengths[row] = g, p
        truncated[row] = sample.finish_reason == "length"
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": gen_lengths,
        "unpadded_sequence_lengths": prompt_lengths + gen_lengths,
        "truncated": truncated,
    }


def has_tokenizer(directory) -> bool:
    """Whether an HF directory holds a tokenizer (else the engine runs token-only)."""
    d = Path(directory)
    return any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def default_cpu_kv_cache_bytes(model_dir, cfg) -> int:
    """KV cache for (generation_batch_size or 8) full sequences of seq_length tokens: vLLM's CPU default
    would reserve most of the machine's RAM."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    elem = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads) * head_dim * elem
    return per_token * cfg.seq_length * (cfg.generation_batch_size or 8)
