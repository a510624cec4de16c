"""`chatgen.VLLMModule`: vLLM generation that the framework drives one engine step at a time, in this process.

    from chatgen import VLLMModule
    module = VLLMModule({"load": "outputs/tiny-llama", "new_token_limit": True, "max_new_tokens": 16}).start()
    batch = module.run_generation(module.build_dataset(["sort: 3 1 2 ="]))   # a chatgen.rollout.RolloutBatch
    out = module.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)   # token in / token out
    texts = module.generate_text(["Once upon a time"])              # text in / text out (demos)

Subclass it and override the hooks to shape what a generation call returns; docs/vllm_module.md walks through
examples/policy_inference.py. The framework owns the loop (`run_generation`):

    _add_request(batch) -> while requests remain: schedule -> forward_step -> collect finished -> decode_internal

The vLLM engine stays in this process (no engine subprocess), so a trainer in the same process can write new
weights into it in place (`load_weights`) and put it to sleep between episodes (`sleep` / `wake_up`).
Everything that touches vLLM internals is in `chatgen.generation.vllm_adapter`.
"""
import itertools
import logging
import os
import time

from chatgen.config import ConfigError, VLLMConfig
from chatgen.generation import engine_config, vllm_adapter as adapter
from chatgen.generation.batching import (
    generation_output,
    iter_samples,
    rollout_batch,
    unpad_batch,
)
from chatgen.module import Module

logger = logging.getLogger(__name__)


class VLLMModule(Module):
    """A vLLM generation model. Construct with its per-model config, `start()` it, then generate.

    config: a `VLLMConfig`, a dict of its keys, or the path of a per-model YAML (docs/generation_keys.md).
    Lifecycle (chatgen.module): `init()` picks vLLM's executor: "external_launcher" (one engine rank in each
    process of an existing torch.distributed job, e.g. colocated with a Megatron TP group) when the process
    has WORLD_SIZE > 1, else vLLM's default; `setup()` builds the engine.

    Attributes after `setup()`: `engine` (the `vllm.LLM`), `tokenizer` (None for a model without one),
    `pad_token_id`, `metrics` (figures of the last generation call), `config`. Sampling keys are read at
    every call (changing `module.config.temperature` between calls takes effect); engine keys at `setup()`.
    """

    config_class = VLLMConfig

    def __init__(self, config=None, *, name: str | None = None):
        super().__init__(config, name=name)
        self.distributed_executor_backend = None
        self.engine = None
        self.tokenizer = None
        self.pad_token_id = 0
        self.vocab_size = None  # the model's vocabulary (config.json vocab_size), read at setup()
        self.metrics = {}
        self._request_ids = itertools.count()
        self._queued = []  # request ids added during the current call, aborted if it fails
        self.needs_resync = None  # set by chatgen.param_sync when a sync failed half-way: the message says why

    def config_problems(self, config):
        return engine_config.platform_problems(config, cpu=adapter.on_cpu())

    def init(self) -> None:
        """Framework: one engine rank per process of a multi-process job (WORLD_SIZE > 1), else one engine."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.distributed_executor_backend = "external_launcher"

    # ------------------------------------------------------------------ user hooks

    def model_provider(self) -> str:
        """Which model vLLM runs. Called once by `setup()`.

        Returns the Hugging Face model directory (config.json + safetensors; the architecture is read from
        config.json). Default: the `load` key. Override to pick the model in code.
        """
        if not self.config.load:
            raise ConfigError(["load: not set; set it to the Hugging Face model directory vLLM should run"])
        return self.config.load

    def setup(self) -> None:
        """Build the engine. Called once, before the first generation call.

        Default: starts `vllm.LLM(model_dir, **self.engine_kwargs(model_dir))` (model_dir = `model_provider()`) in this process and reads
        the tokenizer. Override to add work around it (load a checkpoint, ...) and call `super().setup()`.
        """
        model_dir = self.model_provider()
        self.config = engine_config.resolve_seq_length(self.config, model_dir)
        self.engine = adapter.build_llm(model_dir, **self.engine_kwargs(model_dir))
        if not self.engine.llm_engine.model_config.skip_tokenizer_init:
            self.tokenizer = self.engine.get_tokenizer()
        if self.config.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError([f"chat_template: true, but the tokenizer of {model_dir} has no chat template; set it to "
                               "false (and use prompt_template), or use a tokenizer that has one"])
        self.pad_token_id = engine_config.pad_token_id(self.tokenizer, model_dir)
        self.vocab_size = adapter.hf_config(self.engine)["vocab_size"]
        if self.tokenizer is not None:
            try:
                mismatch = engine_config.check_vocab(len(self.tokenizer), self.vocab_size,
                                                     self.config.tokenizer or model_dir, model_dir)
            except ConfigError:
                self.shutdown()
                raise
            if mismatch:
                logger.warning("%s: %s", self.name, mismatch)

    def build_dataset(self, prompts, is_eval=False) -> list:
        """Turn prompt strings into dataset items. The framework calls it on the train / eval prompts.

        prompts: list[str]. Returns list[dict], one per prompt: {"input_ids": list[int], "prompt": str (as given)},
        plus "prompt_cut": True on a prompt that was cut (the RLHF run stops when too many are).
        Each prompt is put into `prompt_template` (if set), rendered as a user message with the tokenizer's chat
        template when `chat_template` is true, then tokenized with the model's tokenizer (BOS included). An empty
        prompt is an error. A prompt over the budget seq_length - max_new_tokens tokens
        (`engine_config.prompt_budget`) is cut to it, keeping its beginning as ChatLearn does
        (`prompt[:max_prompt_length]`); one warning per call gives the count.
        """
        if self.tokenizer is None:
            raise RuntimeError("build_dataset needs a tokenizer; this model has none: pass token ids to generate()")
        budget = engine_config.prompt_budget(self.config)
        template = self.config.prompt_template
        items, cut = [], []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"build_dataset: prompt {i} is empty or not a string ({prompt!r}); drop it")
            text = template.replace("{prompt}", prompt) if template else prompt
            if self.config.chat_template:
                ids = list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=True))
            else:
                ids = self.tokenizer.encode(text)
            item = {"input_ids": ids, "prompt": prompt}
            if len(ids) > budget:
                cut.append(i)
                item.update(input_ids=ids[:budget], prompt_cut=True)
            items.append(item)
        if cut:
            logger.warning("build_dataset: cut %d of %d prompts to the prompt budget seq_length - max_new_tokens = "
                           "%d tokens, keeping their beginning (prompts %s); raise seq_length or lower "
                           "max_new_tokens to keep them whole", len(cut), len(items), budget,
                           ", ".join(map(str, cut[:10])) + (", ..." if len(cut) > 10 else ""))
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

    def decode_internal(self, batched_outputs):
        """Turn the finished requests of a call into the module's output. Called once per `run_generation`.

        batched_outputs: list of vLLM `RequestOutput`, sorted by request id (= batch order); each has
        `prompt_token_ids`, `prompt` (text or None) and `outputs` (n `CompletionOutput`s with `token_ids`,
        `logprobs`, `text`, `finish_reason`). Default: a `chatgen.rollout.RolloutBatch` of S = prompts x n
        samples (sample j of prompt i at row i * n + j), what every RLHF algorithm consumes. Override to return
        something else for your own loop, or to post-process the batch (e.g. zero `loss_mask` on tokens the
        policy should not be trained on).
        """
        return rollout_batch(batched_outputs, self.pad_token_id)

    # ------------------------------------------------------------------ framework API

    def engine_kwargs(self, model_dir) -> dict:
        """Keyword arguments for `vllm.LLM(model_dir, ...)`, derived from the config (engine_config.engine_kwargs)."""
        return engine_config.engine_kwargs(self.config, model_dir, adapter.on_cpu(), self.distributed_executor_backend)

    def sampling_params(self, prompt_len, *, is_eval=False, greedy=False, stop_strings=()):
        """vLLM `SamplingParams` for one prompt of `prompt_len` tokens (see engine_config.sampling_kwargs).

        Train: n, temperature, top_p, top_k, min_p; eval: eval_temperature / eval_top_p / eval_top_k where
        set. Greedy yields one response per prompt. Stops: stop_token_list plus `stop_strings`.
        """
        config_strings, stop_token_ids = engine_config.parse_stop_list(self.config.stop_token_list, self.tokenizer)
        stop = [*config_strings, *stop_strings]
        if stop and self.tokenizer is None:
            raise ValueError(f"stop strings {stop} need a tokenizer to match text, and this model has none: add "
                             "one (tokenizer files in the model directory, or the `tokenizer` key), or remove "
                             "them (stop_token_list / stop_strings); without a tokenizer only EOS stops")
        kwargs = engine_config.sampling_kwargs(self.config, prompt_len, is_eval=is_eval, greedy=greedy,
                                               stop_strings=stop, stop_token_ids=stop_token_ids)
        # Incremental detokenization (and the text of every log-prob entry) costs about a third of a small model's
        # engine step on CPU; it is needed only to match stop strings. Without any, texts are decoded once at the
        # end of the call (`_decode_texts`).
        return adapter.SamplingParams(**kwargs, detokenize=self.tokenizer is not None and bool(stop))

    def add_request(self, prompt_ids, params, prompt_text=None) -> str:
        """Queue one prompt (list[int]) with `params` (from `sampling_params`); returns its request id."""
        if not prompt_ids:
            raise ValueError("add_request: empty prompt; every prompt needs at least one token (e.g. BOS)")
        request_id = str(next(self._request_ids))
        adapter.add_request(self.engine, request_id, prompt_ids, params, prompt_text)
        self._queued.append(request_id)
        return request_id

    def execute_step(self, data):
        """Run the model on a scheduled batch (`forward_step`'s data); returns the requests that finished."""
        return adapter.execute(self.engine, data)

    def run_generation(self, data, is_eval=False):
        """Generate for a batch of dataset items with the hooks: the framework-owned loop.

        data: list of items from `build_dataset`. An item over the prompt budget seq_length - max_new_tokens
        is an error naming it (never cut here). Returns `decode_internal(...)`; `self.metrics` has the call's
        figures.
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
            prompt_logprobs            (S, L) float  only when prompt_logprobs is set: logprob of each prompt
                                                     token after the first, 0 elsewhere
        """
        prompts = unpad_batch(batch, self.pad_token_id)
        for i, ids in enumerate(prompts):  # all rows before any is queued; never cut: the trainer owns them
            engine_config.check_prompt_length(self.config, len(ids), f"generate(): row {i}")
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
        """add_request for each dataset item, with its own prompt length and stop strings; returns request ids.
        An item over the prompt budget is an error naming it."""
        request_ids = []
        for i, item in enumerate(items):
            n = len(item["input_ids"])
            engine_config.check_prompt_length(self.config, n, f"run_generation: item {i}")
            engine_config.check_prompt_ids(item["input_ids"], self.vocab_size, f"run_generation: item {i}")
            params = self.sampling_params(n, is_eval=is_eval, greedy=greedy,
                                          stop_strings=item.get("stop_strings") or ())
            request_ids.append(self.add_request(item["input_ids"], params, prompt_text=item.get("prompt")))
        return request_ids

    def _decode_texts(self, request_outputs) -> None:
        """Fill the text of samples generated without incremental detokenization (see `sampling_params`), in one
        batch decode, so that hooks and outputs always see texts."""
        if self.tokenizer is None:
            return
        todo = [s for _, s in iter_samples(request_outputs) if not s.text and s.token_ids]
        for sample, text in zip(todo, self.tokenizer.batch_decode([list(s.token_ids) for s in todo],
                                                                  skip_special_tokens=True)):
            sample.text = text

    def _drive(self, add_requests) -> list:
        """Queue requests with `add_requests()`, step the engine until all finish; returns the finished
        `RequestOutput`s sorted by request id and records `self.metrics`."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before generating")
        if adapter.is_sleeping(self.engine):
            raise RuntimeError(f"{type(self).__name__} is asleep: call wake_up() before generating")
        if self.needs_resync:
            raise RuntimeError(f"{type(self).__name__} cannot generate until a weight sync completes; the last "
                               f"one failed half-way: {self.needs_resync}")
        start = time.perf_counter()
        finished, steps, kv_peak = [], 0, 0.0
        self._queued = []
        try:
            add_requests()
            while adapter.has_unfinished_requests(self.engine):
                scheduled = adapter.schedule(self.engine)
                kv_peak = max(kv_peak, adapter.kv_cache_usage(self.engine))
                finished += [o for o in self.forward_step(scheduled, steps) if o.finished]
                steps += 1
        except BaseException:  # leave the engine empty for the next call
            adapter.abort(self.engine, self._queued)
            raise
        finished.sort(key=lambda o: int(o.request_id))
        self._decode_texts(finished)
        elapsed = time.perf_counter() - start
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
