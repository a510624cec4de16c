"""`chatgen.VLLMModule`: vLLM generation that the framework drives one engine step at a time, in this process.

    from chatgen import VLLMModule
    module = VLLMModule({"load": "outputs/tiny-llama", "new_token_limit": True, "max_new_tokens": 16}).start()
    batch = module.run_generation(module.build_dataset(["sort: 3 1 2 ="]))   # a chatgen.rollout.RolloutBatch
    out = module.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)   # token in / token out
    texts = module.generate_text(["Once upon a time"])              # text in / text out (demos)
    url = module.serve()                          # OpenAI HTTP on a loopback port (docs/serving.md)

Subclass it and override the hooks to shape what a generation call returns; docs/vllm_module.md walks through
examples/policy_inference.py. The framework owns the loop (`run_generation`):

    _add_request(batch) -> while requests remain: schedule -> forward_step -> collect finished -> decode_internal

The vLLM engine stays in this process (no engine subprocess), so a trainer in the same process can write new
weights into it in place (`update_weights`) and put it to sleep between episodes (`sleep` / `wake_up`).
Everything that touches vLLM internals is in `chatgen.generation.vllm_adapter`.
"""
import contextlib
import logging
import os
import shutil
import tempfile
import time
import types

from chatgen.checkpoint_io import copy_hf_side_files, read_megatron_meta
from chatgen.config import ConfigError, VLLMConfig, model_args
from chatgen.generation import engine_config, vllm_adapter as adapter
from chatgen.generation.engine_loop import EngineLoop
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

    Attributes after `setup()`: `engine` (the `vllm.LLM`), `tokenizer` (None for a model without one; also
    reachable as `tokenizer.tokenizer`, ChatLearn's spelling), `pad_token_id`, `metrics` (figures of the last
    generation call), `config`, `model_args` (ChatLearn's flat dict of the config's keys and its `args:`
    keys), `iteration` (engine steps over the module's life, what `forward_step` / `eval_forward` receive).
    Sampling keys are read at every call (changing `module.config.temperature` between calls takes effect);
    engine keys at `setup()`.
    """

    config_class = VLLMConfig

    def __init__(self, config=None, *, name: str | None = None, config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.distributed_executor_backend = None
        self.engine = None
        self.tokenizer = None
        self.pad_token_id = 0
        self.vocab_size = None  # the model's vocabulary (config.json vocab_size), read at setup()
        self.metrics = {}
        self.iteration = 0
        self._queued = []  # request ids added by the call being started (engine thread), aborted if it fails
        self._collate_fns = {}  # is_eval -> the collate_fn of the dataset build_dataset returned (ChatLearn)
        self._engine_dir = None  # the HF view of a Megatron checkpoint `load` (a temporary directory)
        self._server = self._server_thread = self._server_url = None  # `serve`: uvicorn on a daemon thread

    def config_problems(self, config):
        return engine_config.platform_problems(config, cpu=adapter.on_cpu())

    @property
    def model_args(self) -> types.MappingProxyType:
        """ChatLearn's `model_args`: every key of this model's config, its `args:` (user) keys included, as one
        flat read-only mapping of the current values (seq_length as resolved by `setup()`). Change a value
        through `module.config.<key>` (typed keys; sampling keys take effect at the next call)."""
        return types.MappingProxyType(model_args(self.config))

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

        Default: starts `vllm.LLM(model_dir, **self.engine_kwargs(model_dir))` (model_dir = `model_provider()`) in
        this process and reads the tokenizer. `model_dir` may also be a chatgen Megatron checkpoint (what
        `MegatronModule.save_checkpoint` writes, any TP x PP, as ChatLearn's vLLM module starts from its
        trainer's checkpoint): the engine then starts from its HF config with placeholder weights and the
        checkpoint's weights are written in through the weight-sync path (`update_weights`), no conversion on disk.
        Override to add work around it (load a checkpoint, ...) and call `super().setup()`.
        """
        model_dir = self.model_provider()
        megatron = read_megatron_meta(model_dir) is not None
        engine_dir = self._hf_view(model_dir) if megatron else model_dir
        self.config = engine_config.resolve_seq_length(self.config, engine_dir)
        kwargs = self.engine_kwargs(engine_dir)
        if megatron:
            kwargs["load_format"] = "dummy"
        self.engine = adapter.build_llm(str(engine_dir), **kwargs)
        if self.config.return_routed_experts:
            adapter.record_routed_experts(self.engine)
        if megatron:
            from chatgen.training.convert import megatron_checkpoint_to_hf  # pure tensor code: no Megatron import

            self.update_weights(megatron_checkpoint_to_hf(model_dir)[1].items())
        if not self.engine.llm_engine.model_config.skip_tokenizer_init:
            self.tokenizer = self.engine.get_tokenizer()
            try:  # ChatLearn's modules reach the HF tokenizer as self.tokenizer.tokenizer
                self.tokenizer.tokenizer = self.tokenizer
            except AttributeError:
                pass
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
        texts = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"build_dataset: prompt {i} is empty or not a string ({prompt!r}); drop it")
            texts.append(template.replace("{prompt}", prompt) if template else prompt)
        # one batched call (the fast tokenizer's batch path): one encode per prompt took seconds for 20k prompts
        if self.config.chat_template:
            # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
            encoded = self.tokenizer.apply_chat_template([[{"role": "user", "content": t}] for t in texts],
                                                         add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        else:
            encoded = self.tokenizer(texts)["input_ids"]
        items, cut = [], []
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            item = {"input_ids": list(ids), "prompt": prompt}
            if len(ids) > budget:
                cut.append(i)
                item.update(input_ids=list(ids[:budget]), prompt_cut=True)
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
        "input_ids": list[int], optional "prompt": str and "stop_strings": list[str]); or, when the dataset
        `build_dataset` returned has a `collate_fn` (ChatLearn), what it made of those items, e.g. a dict of
        lists {"input_ids": [...], "prompt": [...]}. Returns the request ids (in batch order). Override to set
        per-item sampling (call `self.add_request` for each item), or call
        `self._add_request_internal(prompts, prompt_token_ids, is_eval)` as ChatLearn's modules do.
        """
        if isinstance(data, dict):  # a collated batch
            return self._add_request_internal(data.get("prompt") or [None] * len(data["input_ids"]),
                                              data["input_ids"], is_eval)
        return self._queue(data, is_eval=is_eval)

    def _add_request_internal(self, prompt_list, prompt_token_id_list, is_eval=False) -> list:
        """ChatLearn's call: queue prompts (their texts, or None) with their token ids (lists or 1-D tensors)
        with the train or eval sampling parameters; returns the request ids. A prompt over the budget
        seq_length - max_new_tokens is an error naming it (cut prompts in `build_dataset`)."""
        if len(prompt_list) != len(prompt_token_id_list):
            raise ValueError(f"_add_request_internal: {len(prompt_list)} prompts but {len(prompt_token_id_list)} "
                             "prompt_token_ids; pass one list of token ids per prompt")
        items = [{"input_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids), "prompt": text}
                 for text, ids in zip(prompt_list, prompt_token_id_list)]
        return self._queue(items, is_eval=is_eval)

    def forward_step(self, data, iteration):
        """Run one engine step on the batch the scheduler picked. Called once per step of a train-mode call.

        data: `vllm_adapter.ScheduledBatch` (`request_ids`, `num_tokens` {request id: tokens this step},
        `total_tokens`); iteration: `self.iteration`, the engine steps this module has run before this one (over
        its life, as ChatLearn counts). Must call `self.execute_step(data)` exactly once and return its result
        (the `RequestOutput`s that finished).
        """
        return self.execute_step(data)

    def eval_forward(self, data, iteration=0):
        """`forward_step` of an evaluation call (`run_generation(..., is_eval=True)`), as ChatLearn calls it.
        Default: `forward_step(data, iteration)`."""
        return self.forward_step(data, iteration)

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

        Train: n, temperature, top_p, top_k, min_p, repetition_penalty; eval: eval_temperature / eval_top_p / eval_top_k where
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

    def add_request(self, prompt_ids, params, prompt_text=None, *, stream: bool = False) -> str:
        """Queue one prompt (list[int]) with `params` (from `sampling_params`); returns its request id.

        Runs on the engine thread, inside a call's `_add_request`. stream: emit every step's new tokens
        (a DELTA output each step, for `engine_loop.stream`) instead of one output when the request finishes.
        """
        if not prompt_ids:
            raise ValueError("add_request: empty prompt; every prompt needs at least one token (e.g. BOS)")
        loop = self.engine_loop
        request_id = loop.next_request_id()
        kind = adapter.RequestOutputKind.DELTA if stream else adapter.RequestOutputKind.FINAL_ONLY
        adapter.add_request(self.engine, request_id, prompt_ids, params, prompt_text, cache_salt=loop.cache_salt,
                            output_kind=kind)
        self._queued.append(request_id)
        return request_id

    def execute_step(self, data):
        """Run the model on a scheduled batch (`forward_step`'s data); returns the requests that finished."""
        return adapter.execute(self.engine, data)

    def prepare_dataset(self, prompts, is_eval=False) -> list:
        """Framework: `build_dataset(prompts, is_eval)` as a list of items. A dataset with a `collate_fn` (a
        ChatLearn `torch.utils.data.Dataset`) is remembered: `run_generation` then hands `_add_request` the
        collated batch, as ChatLearn's data loader does."""
        dataset = self.build_dataset(prompts, is_eval)
        self._collate_fns[bool(is_eval)] = getattr(dataset, "collate_fn", None)
        return [dataset[i] for i in range(len(dataset))]

    def run_generation(self, data, is_eval=False):
        """Generate for a batch of dataset items with the hooks: the framework-owned loop.

        data: list of items from `build_dataset` (collated first when `prepare_dataset` saw a `collate_fn`). An
        item over the prompt budget seq_length - max_new_tokens is an error naming it (never cut here). Steps go
        to `forward_step`, or to `eval_forward` when is_eval. Returns `decode_internal(...)`; `self.metrics`
        has the call's figures.
        """
        collate = self._collate_fns.get(bool(is_eval))
        batch = collate(list(data)) if collate is not None else data
        return self.decode_internal(self._drive(lambda: self._add_request(batch, is_eval), is_eval))

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
        return [s.text for _, s in iter_samples(self._drive(lambda: self._queue(items, is_eval, greedy), is_eval))]

    async def generate_async(self, batch, greedy=False):
        """`generate`, streaming: an async iterator of (row index, one-row output), each as soon as its prompt's
        samples finish (rows i * n .. i * n + n - 1 of prompt i, one at a time).

        Each output has the keys of `generate` for one row, L = T + that row's generation. Requests of other
        callers run alongside (continuous batching). Leaving the iterator early aborts this call's requests
        and frees their KV blocks.
        """
        prompts = unpad_batch(batch, self.pad_token_id)
        for i, ids in enumerate(prompts):
            engine_config.check_prompt_length(self.config, len(ids), f"generate_async(): row {i}")
        stops = batch.get("stop_strings") or [None] * len(prompts)
        items = [{"input_ids": ids, "stop_strings": stop} for ids, stop in zip(prompts, stops)]
        self._check_ready()
        first = {}  # request id -> its prompt's row index in the batch
        width, dtype = batch["input_ids"].shape[1], batch["input_ids"].dtype

        def add():
            for i, request_id in enumerate(self._queue(items, greedy=greedy)):
                first[request_id] = i

        async with contextlib.aclosing(self.engine_loop.stream(self, add)) as outputs:  # closed: aborts the rest
            async for output in outputs:
                self._decode_texts([output])
                rows = generation_output([output], width, self.pad_token_id, dtype)
                n = rows["output_ids"].shape[0]
                for j in range(n):
                    yield first[output.request_id] * n + j, {key: value[j:j + 1] for key, value in rows.items()}

    def update_weights(self, named_tensors, mode: str = "wait") -> int:
        """Write HF-format (name, tensor) pairs into the engine between two engine steps; returns the new
        weight version (0 = the weights the engine started with, +1 per update).

        mode, for requests in flight when the update arrives:
            wait       admit nothing new, run them to the end under the old weights, then write
            keep       write now; they continue under the new weights, keeping the KV already computed
            recompute  write now; they are re-prefilled (prompt + generated tokens) under the new weights
            abort      they end now with what they have (finish_reason "abort"), then write
        Every generated token reports the version it was sampled under (`weight_versions` in the outputs).
        Requests added after the update never reuse prefix-cache blocks computed with older weights. Names and
        layouts: see `vllm_adapter.load_weights`; chatgen.param_sync.sync_weights writes through here. If the
        write fails (vLLM's reload releases the old weights as it begins, so any failure leaves a mix), the
        module refuses to generate (a RuntimeError saying so; `needs_resync` says why) until a later update
        succeeds: sync all weights again.
        """
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before update_weights")
        return self.engine_loop.update_weights(lambda: named_tensors, mode)

    @property
    def needs_resync(self) -> str | None:
        """Why this module refuses to generate (a weight write failed after vLLM's reload began, leaving a mix of
        old and new weights), or None. A later complete `update_weights` / sync clears it."""
        return self.engine_loop.broken if self.engine is not None else None

    @property
    def weight_version(self) -> int:
        """Weight version of the engine: 0 at start, +1 per `update_weights`."""
        return self.engine_loop.weight_version

    @property
    def engine_loop(self):
        """The `EngineLoop` stepping this module's engine (one per engine; threadless with external_launcher,
        whose ranks must step in lockstep)."""
        return EngineLoop.of(self.engine, threaded=self.distributed_executor_backend != "external_launcher")

    def sleep(self, level: int = 1) -> None:
        """Between episodes: pause the engine and free its GPU memory for the colocated trainer.

        level 1: drop the KV cache, offload weights to CPU; level 2: drop both (sync all weights after
        `wake_up`). On CPU vLLM 0.32 frees nothing (its CPU worker's sleep is a no-op): the engine pauses and
        the prefix cache is cleared; size the CPU cache with kv_cache_memory_bytes. Generating while asleep
        is an error.
        """
        self.engine_loop.call(lambda: adapter.sleep(self.engine, level))

    def wake_up(self) -> None:
        """Before the next episode: re-allocate weights and KV cache (GPU) and resume scheduling."""
        self.engine_loop.call(lambda: adapter.wake_up(self.engine))

    def is_sleeping(self) -> bool:
        return adapter.is_sleeping(self.engine)

    def prepare_for_generation(self) -> bool:
        """NeMo RL's name: wake the engine if it sleeps. Returns True."""
        if self.is_sleeping():
            self.wake_up()
        return True

    def finish_generation(self) -> bool:
        """NeMo RL's name: put the engine to sleep (level 1) so a colocated trainer gets the memory. Returns True."""
        if not self.is_sleeping():
            self.sleep()
        return True

    def serve(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
              model_name: str | None = None) -> str:
        """Serve this module over OpenAI HTTP (chatgen.serving.app.build_app, docs/serving.md) from a daemon
        thread of this process, e.g. to hand an RLHF run's policy to environments. Returns the base URL
        (`http://HOST:PORT/v1`, for `openai.OpenAI(base_url=...)`); port 0 picks a free port. `shutdown` stops
        the server. Binds to loopback unless `host` says otherwise."""
        import socket
        import threading

        import uvicorn

        from chatgen.serving.app import build_app

        if self._server is not None:
            raise RuntimeError(f"{self.name}: already serving at {self._server_url}; one server per module")
        app = build_app(self, api_key=api_key, model_name=model_name)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"{self.name}-server",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(f"{self.name}: the OpenAI server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.01)
        self._server, self._server_thread = server, thread
        self._server_url = f"http://{host}:{sock.getsockname()[1]}/v1"
        return self._server_url

    def shutdown(self) -> None:
        """Stop the server (`serve`), the engine loop and the engine and release its memory."""
        if self._server is not None:
            self._server.should_exit = True
            self._server_thread.join(timeout=30)
            self._server = None
        if self.engine is not None:
            self.engine_loop.shutdown()
            adapter.shutdown(self.engine)
            self.engine = None
        if self._engine_dir is not None:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None

    def _hf_view(self, checkpoint) -> str:
        """A temporary HF directory for the engine to start from: the Megatron checkpoint's HF config.json and
        its tokenizer files (the weights come through `update_weights`)."""
        import json

        self._engine_dir = tempfile.mkdtemp(prefix="chatgen-vllm-")
        with open(os.path.join(self._engine_dir, "config.json"), "w") as f:
            json.dump(read_megatron_meta(checkpoint)["hf_config"], f)
        copy_hf_side_files(checkpoint, self._engine_dir)
        return self._engine_dir

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

    def _check_ready(self) -> None:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before generating")
        if adapter.is_sleeping(self.engine):
            raise RuntimeError(f"{type(self).__name__} is asleep: call wake_up() before generating")

    def _drive(self, add_requests, is_eval=False) -> list:
        """Submit a call to the engine loop (`add_requests()` queues its requests, on the engine thread; each
        step goes through `forward_step`, or `eval_forward` when is_eval) and wait until all its requests
        finish; returns the finished `RequestOutput`s sorted by request id and records `self.metrics`."""
        self._check_ready()
        start = time.perf_counter()
        finished, stats = self.engine_loop.run(self, add_requests, is_eval)
        self._decode_texts(finished)
        elapsed = time.perf_counter() - start
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
        generation_tokens = sum(len(s.token_ids) for _, s in iter_samples(finished))
        self.metrics = {
            "prompts": len(finished),
            "samples": sum(len(o.outputs) for o in finished),
            "prompt_tokens": prompt_tokens,
            "generation_tokens": generation_tokens,
            "engine_steps": stats["engine_steps"],
            "elapsed_s": elapsed,
            "prompt_tokens_per_s": prompt_tokens / elapsed,
            "generation_tokens_per_s": generation_tokens / elapsed,
            "kv_cache_usage_peak": stats["kv_cache_usage_peak"],
        }
        return finished
