"""`chatgen.VLLMModule`: vLLM generation that the framework drives one engine step at a time, in
this process.

    from chatgen import VLLMModule
    module = VLLMModule({"load": "outputs/tiny-llama", "new_token_limit": True, "max_new_tokens": 16}).start()
    batch = module.run_generation(module.build_dataset(["sort: 3 1 2 ="]))   # a chatgen.core.rollout.RolloutBatch
    out = module.generate({"input_ids": ids, "input_lengths": lens}, greedy=True)   # token in / token out

Subclass it and override the hooks to shape what a generation call returns; docs/vllm_module.md
walks through examples/policy_inference.py. The framework owns the loop (`run_generation`):

    _add_request(batch) -> while requests remain: schedule -> forward_step -> collect finished -> decode_internal

The vLLM engine stays in this process (no engine subprocess), so a trainer in the same process can
write new weights into it in place (`load_weights`) and put it to sleep between episodes (`sleep` /
`wake_up`). What every generation backend does is chatgen.generation.base (prompts, token batches,
the contract); ChatLearn's and NeMo RL's spellings come from chatgen.compat; everything that touches
vLLM internals is adapter/; serving it over HTTP is chatgen.serving.
"""

import contextlib
import logging
import os
import shutil
import time

from chatgen.compat.chatlearn import ChatLearnGeneration
from chatgen.compat.nemo_rl import NemoRLGeneration
from chatgen.core.checkpoint_io import read_megatron_meta
from chatgen.generation import config as gc
from chatgen.generation.base import GenerationModule
from chatgen.generation.batching import call_metrics, rollout_batch
from chatgen.generation.vllm import adapter
from chatgen.generation.vllm.adapter import cpu_release
from chatgen.generation.vllm.config import VLLMConfig, engine_kwargs, platform_problems
from chatgen.generation.vllm.engine_loop import EngineLoop
from chatgen.models.convert import hf_config_view, megatron_checkpoint_to_hf
from chatgen.module import collection_paused

logger = logging.getLogger(__name__)


class VLLMModule(ChatLearnGeneration, NemoRLGeneration, GenerationModule):
    """A vLLM generation model. Construct with its per-model config, `start()` it, then generate.

    config: a `VLLMConfig`, a dict of its keys, or the path of a per-model YAML
    (docs/generation_keys.md). Lifecycle (chatgen.module): `init()` picks vLLM's executor:
    "external_launcher" (one engine rank in each process of an existing torch.distributed job, e.g.
    colocated with a Megatron TP group) when the process has WORLD_SIZE > 1, else vLLM's default;
    `setup()` builds the engine.

    Attributes after `setup()`: `engine` (the `vllm.LLM`), `tokenizer`, `pad_token_id`,
    `vocab_size`, `metrics` (figures of the last generation call), `config`, `iteration` (engine
    steps over the module's life, what `forward_step` / `eval_forward` receive). Sampling keys are
    read at every call (changing `module.config.temperature` between calls takes effect); engine
    keys at `setup()`.
    """

    config_class = VLLMConfig

    def __init__(self, config=None, *, name: str | None = None, config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.distributed_executor_backend = None
        self.engine = None
        self.iteration = 0
        self._engine_dir = (
            None  # the HF view of a Megatron checkpoint `load` (a temporary directory)
        )
        self.on_finished = (
            None  # called with each finished RequestOutput of a call (chatgen generate's progress)
        )

    @classmethod
    def config_problems(cls, config):
        return platform_problems(config, cpu=adapter.on_cpu())

    def init(self) -> None:
        """Framework: one engine rank per process of a multi-process job (WORLD_SIZE > 1), else
        one engine."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.distributed_executor_backend = "external_launcher"

    # ------------------------------------------------------------------ user hooks

    def setup(self) -> None:
        """Build the engine. Called once, before the first generation call.

        Default: starts `vllm.LLM(model_dir, **self.engine_kwargs(model_dir))` (model_dir =
        `model_provider()`) in this process and reads the tokenizer. `model_dir` may also be a
        chatgen Megatron checkpoint (what `MegatronModule.save_checkpoint` writes, any TP x PP, as
        ChatLearn's vLLM module starts from its trainer's checkpoint): the engine then starts from
        its HF config with placeholder weights and the checkpoint's weights are written in through
        the weight-sync path, no conversion on disk. Override to add work around it (load a
        checkpoint, ...) and call `super().setup()`.
        """
        model_dir = self.model_provider()
        megatron = read_megatron_meta(model_dir) is not None
        if megatron:  # the engine starts from the checkpoint's HF config, its weights come after
            self._engine_dir = engine_dir = hf_config_view(model_dir)
        else:
            engine_dir = model_dir
        self.config = gc.resolve_seq_length(self.config, engine_dir)
        kwargs = self.engine_kwargs(engine_dir)
        if megatron:
            kwargs["load_format"] = "dummy"
        self.engine = adapter.build_llm(str(engine_dir), **kwargs)
        if self.config.return_routed_experts:
            adapter.record_routed_experts(self.engine)
        self.hf_config = adapter.hf_config(self.engine)
        self.vocab_size = self.hf_config["vocab_size"]
        if megatron:
            self.update_weights(megatron_checkpoint_to_hf(model_dir)[1].items())
        if not self.engine.llm_engine.model_config.skip_tokenizer_init:
            self.tokenizer = self.engine.get_tokenizer()
            self.alias_tokenizer(self.tokenizer)
        self.pad_token_id = gc.pad_token_id(self.tokenizer, model_dir, self.config.pad_token_id)
        try:
            self.check_tokenizer(self.config.tokenizer or model_dir, model_dir)
        except gc.ConfigError:
            self.shutdown()
            raise

    def _add_request(self, data, is_eval=False) -> list:
        """Queue a batch in the engine with the train (or eval) sampling parameters.

        Called by `run_generation` at the start of a call. data: list of dataset items (dicts with
        "input_ids": list[int], optional "prompt": str and "stop_strings": list[str]); or, when the
        dataset `build_dataset` returned has a `collate_fn` (ChatLearn), what it made of those
        items, e.g. a dict of lists {"input_ids": [...], "prompt": [...]}. Returns the request ids
        (in batch order). Override to set per-item sampling (call `self.add_request` for each item),
        or call `self._add_request_internal(prompts, prompt_token_ids, is_eval)` as ChatLearn's
        modules do.
        """
        if isinstance(data, dict):  # a collated batch
            return self._add_request_internal(
                data.get("prompt") or [None] * len(data["input_ids"]), data["input_ids"], is_eval
            )
        return self._queue(data, is_eval=is_eval)

    def forward_step(self, data, iteration):
        """Run one engine step on the batch the scheduler picked. Called once per step of a
        train-mode call.

        data: `adapter.ScheduledBatch` (`request_ids`, `num_tokens` {request id: tokens this step},
        `total_tokens`); iteration: `self.iteration`, the engine steps this module has run before
        this one (over its life, as ChatLearn counts). Must call `self.execute_step(data)` exactly
        once and return its result (the `RequestOutput`s that finished).
        """
        return self.execute_step(data)

    def eval_forward(self, data, iteration=0):
        """`forward_step` of an evaluation call (`run_generation(..., is_eval=True)`), as
        ChatLearn calls it. Default: `forward_step(data, iteration)`."""
        return self.forward_step(data, iteration)

    def decode_internal(self, batched_outputs):
        """Turn the finished requests of a call into the module's output. Called once per
        `run_generation`.

        batched_outputs: list of vLLM `RequestOutput`, sorted by request id (= batch order); each
        has `prompt_token_ids`, `prompt` (text or None) and `outputs` (n `CompletionOutput`s with
        `token_ids`, `logprobs`, `text`, `finish_reason`). Default: a
        `chatgen.core.rollout.RolloutBatch` of S = prompts x n samples (sample j of prompt i at row
        i * n + j), what every RLHF algorithm consumes. Override to return something else for your
        own loop, or to post-process the batch (e.g. zero `loss_mask` on tokens the policy should
        not be trained on).
        """
        return rollout_batch(batched_outputs, self.pad_token_id)

    # ------------------------------------------------------------------ framework API

    def engine_kwargs(self, model_dir) -> dict:
        """Keyword arguments for `vllm.LLM(model_dir, ...)`, derived from the config
        (config.engine_kwargs)."""
        return engine_kwargs(
            self.config, model_dir, adapter.on_cpu(), self.distributed_executor_backend
        )

    def sampling_params(
        self,
        prompt_len,
        *,
        is_eval=False,
        greedy=False,
        stop_strings=(),
        stop_token_ids=(),
        logprobs=True,
    ):
        """vLLM `SamplingParams` for one prompt of `prompt_len` tokens (see config.sampling_kwargs).

        Train: n, temperature, top_p, top_k, min_p, repetition_penalty; eval: eval_temperature /
        eval_top_p / eval_top_k where set. Greedy yields one response per prompt. Stops:
        stop_token_list plus `stop_strings` and `stop_token_ids`. logprobs=False: none computed
        (the outputs' `logprobs` None).
        """
        kwargs = self.sampling_kwargs(
            prompt_len,
            is_eval=is_eval,
            greedy=greedy,
            stop_strings=stop_strings,
            stop_token_ids=stop_token_ids,
        )
        if not logprobs:
            kwargs["logprobs"] = None
        # Incremental detokenization (and the text of every log-prob entry) costs about a third of a
        # small model's engine step on CPU; it is needed only to match stop strings. Without any,
        # texts are decoded once at the end of the call (`_decode_texts`).
        return adapter.SamplingParams(
            **kwargs, detokenize=self.tokenizer is not None and bool(kwargs["stop"])
        )

    def add_request(
        self, prompt_ids, params, prompt_text=None, *, stream: bool = False, lora_request=None
    ) -> str:
        """Queue one prompt (list[int]) with `params` (from `sampling_params`); returns its request
        id.

        Runs on the engine thread, inside a call's `_add_request`. stream: emit every step's new
        tokens (a DELTA output each step, for `stream`) instead of one output when the request
        finishes.
        """
        if not prompt_ids:
            raise ValueError(
                "add_request: empty prompt; every prompt needs at least one token (e.g. BOS)"
            )
        return self.engine_loop.add_request(
            prompt_ids, params, prompt_text, stream=stream, lora_request=lora_request
        )

    def execute_step(self, data):
        """Run the model on a scheduled batch (`forward_step`'s data); returns the requests that
        finished."""
        return adapter.execute(self.engine, data)

    def run_generation(self, data, is_eval=False):
        """Generate for a batch of dataset items with the hooks: the framework-owned loop.

        data: list of items from `build_dataset` (collated first when `prepare_dataset` saw a
        `collate_fn`). An item over the prompt budget seq_length - max_new_tokens is an error naming
        it (never cut here). Steps go to `forward_step`, or to `eval_forward` when is_eval. Returns
        `decode_internal(...)`; `self.metrics` has the call's figures.
        """
        batch = self.collate(data, is_eval)
        return self.decode_internal(self._drive(lambda: self._add_request(batch, is_eval), is_eval))

    def finished(self, items: list, is_eval: bool = False, greedy: bool = False) -> list:
        return self._drive(lambda: self._queue(items, is_eval, greedy), is_eval)

    async def stream(self, prompts: list, params, deltas: bool = False, adapter: str | None = None):
        """GenerationModule.stream; adapter: the name of a served LoRA adapter
        (`add_lora_adapter`) to sample with instead of the base."""
        self._check_ready()
        shared = not isinstance(params, list)
        index = {}  # request id -> prompt index
        lora = self.lora_adapters[adapter] if adapter is not None else None

        def add():
            # a request owns its params (vLLM sets fields on them): one each
            for i, ids in enumerate(prompts):
                p = (params.clone() if len(prompts) > 1 else params) if shared else params[i]
                index[self.add_request(ids, p, stream=deltas, lora_request=lora)] = i

        # closed: aborts the rest
        async with contextlib.aclosing(self.engine_loop.stream(self, add)) as outputs:
            async for output in outputs:
                if output.finished and not deltas:
                    self._decode_texts([output])
                yield index[output.request_id], output

    # ------------------------------------------------------------------ weights, memory, control

    def load_weights(self, buckets, mode: str = "wait") -> int:
        """See GenerationModule.load_weights. Every generated token reports the version it was
        sampled under (`weight_versions` in the outputs); requests added after an update never
        reuse prefix-cache blocks computed with older weights. Names and layouts: see
        `adapter.load_weights`. On CPU, weights that `sleep(2)` released are regrown first and
        checked after: a write that missed one fails and leaves the module refusing to
        generate."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before writing weights")
        if not self.weights_released:  # nothing to regrow or check: no engine-thread round trips
            return self.engine_loop.update_weights(buckets, mode)
        loop = self.engine_loop
        loop.call(lambda: cpu_release.regrow(self.engine, "weights"))
        version = loop.update_weights(buckets, mode)
        missed = loop.call(lambda: cpu_release.check_rewritten(self.engine))
        self.weights_released = missed is not None
        if missed is not None:
            loop.broken = (
                f"the weights released while the trainer trained (sleep level 2, "
                f"release_during_training) were not all written again: {missed}; a weight sync "
                "of the full set brings them back"
            )
            raise RuntimeError(loop.broken)
        return version

    weights_released = False  # sleep(2) on CPU freed them: the next sync regrows and checks them
    lora_adapters: dict = {}  # name -> LoRARequest of the adapters served beside the base (add_lora_adapter)

    def add_lora_adapter(self, name: str, directory) -> None:
        """Serve the PEFT LoRA adapter in `directory` as model `name` beside the base (`chatgen
        serve --lora-modules`): `stream(..., adapter=name)` samples with it. vLLM reads the
        directory (again, should it evict the adapter), so it must stay. Needs `enable_lora`."""
        if not self.config.enable_lora:
            raise ValueError(f"{self.name}: add_lora_adapter needs enable_lora: true in its config")
        lora_id = 2 + len(self.lora_adapters)  # 1: the synced adapter (load_lora_tensors)
        loop = self.engine_loop
        request = loop.call(lambda: adapter.add_lora_dir(loop.llm, name, lora_id, directory))
        self.lora_adapters = {**self.lora_adapters, name: request}

    def load_lora_adapter(self, directory) -> None:
        """`load_lora_tensors` of the PEFT LoRA adapter in `directory` (read now: it may go away
        after)."""
        from chatgen.models.lora_format import read_peft

        self.load_lora_tensors(*read_peft(directory, key=str(directory)))

    def load_lora_tensors(self, config: dict, tensors: dict) -> int:
        """Sample every later request with this LoRA adapter (its adapter_config.json as a dict,
        its tensors by PEFT name) on top of the base weights, replacing the previous one in place
        under the same adapter id (adapter-only sync, docs/lora.md); needs `enable_lora`. Between
        calls. A new weight version: requests added after it never reuse prefix-cache blocks
        computed under the previous adapter. Returns it."""
        from chatgen.models.lora_format import check_finite_adapter

        if not self.config.enable_lora:
            raise ValueError(
                f"{self.name}: load_lora_tensors needs enable_lora: true in its config"
            )
        check_finite_adapter(tensors, f"{self.name}: load_lora_tensors")
        loop = self.engine_loop

        def swap():
            if adapter.has_unfinished_requests(loop.llm):  # they would finish under the new adapter
                raise RuntimeError(
                    f"{self.name}: a LoRA adapter load while requests run; load it between calls"
                )
            loop.lora_request = adapter.replace_lora(loop.llm, 1, config, tensors)
            loop.lora_held = (config, tensors)  # put back after a full weight load (weight_updates)
            loop.weight_version += 1
            return loop.weight_version

        return loop.call(swap)

    @property
    def needs_resync(self) -> str | None:
        return self.engine_loop.broken if self.engine is not None else None

    @property
    def health_problem(self) -> str | None:
        return self.engine_loop.health_problem() if self.engine is not None else None

    @property
    def weight_version(self) -> int:
        return self.engine_loop.weight_version

    @property
    def engine_loop(self):
        """The `EngineLoop` stepping this module's engine (one per engine; threadless with
        external_launcher, whose ranks must step in lockstep)."""
        return EngineLoop.of(
            self.engine, threaded=self.distributed_executor_backend != "external_launcher"
        )

    def sleep(self, level: int = 1) -> None:
        """Level 1: drop the KV cache, offload weights to CPU; level 2: drop both (sync all
        weights after `wake_up`). On CPU vLLM 0.32 frees nothing (its CPU worker's sleep is a
        no-op): at level 1 the engine pauses and the prefix cache is cleared; level 2 frees the
        weights and the KV cache here (adapter/cpu_release.py, what release_during_training
        uses), and the engine refuses to generate until a weight sync has written every weight
        again. Generating while asleep is an error."""
        loop = self.engine_loop

        def sleep():
            adapter.sleep(self.engine, level)
            if level == 2 and adapter.on_cpu():
                cpu_release.release(self.engine)
                self.weights_released = True
                loop.broken = (
                    "the engine's weights were released (sleep level 2, release_during_training); "
                    "a weight sync of the full set brings them back"
                )

        loop.call(sleep)

    def wake_up(self, tags: list | None = None) -> None:
        def wake_up():
            if adapter.on_cpu():  # what sleep(2) released; the weights' values come with a sync
                for what in tags or ("weights", "kv_cache"):
                    cpu_release.regrow(self.engine, what)
            adapter.wake_up(self.engine, tags)

        self.engine_loop.call(wake_up)

    def is_sleeping(self) -> bool:
        return adapter.is_sleeping(self.engine)

    def pause(self) -> None:
        self.engine_loop.pause()

    def resume(self) -> None:
        self.engine_loop.resume()

    def reset_prefix_cache(self) -> bool:
        return self.engine_loop.call(lambda: adapter.reset_prefix_cache(self.engine))

    def expert_weights(self) -> list:
        """[(w13, w2)] per MoE layer as the engine computes with them (for check-sync's
        per-expert check)."""
        return self.engine_loop.call(lambda: adapter.expert_weights(self.engine))

    def shutdown(self) -> None:
        """Stop the engine loop and the engine and release its memory."""
        if self.engine is not None:
            if self.engine_loop.shutdown():
                adapter.shutdown(self.engine)
            else:  # the loop is stuck inside the engine: leave both to the process's exit
                logger.warning(
                    "%s: the engine loop did not stop; the engine is left as it is",
                    type(self).__name__,
                )
            self.engine = None
        if self._engine_dir is not None:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None

    # ------------------------------------------------------------------ the loop

    def _queue(self, items, is_eval=False, greedy=False) -> list:
        """add_request for each dataset item, with its own prompt length and stop strings
        (greedy: one greedy response; so for an item with "greedy": True; an item with
        "logprobs": False computes none); returns request ids. An item over the prompt budget is
        an error naming it."""
        request_ids, made = [], {}  # items of the same kind share one params object
        with adapter.request_batch(self.engine):
            for i, item in enumerate(items):
                self.check_item(item, f"run_generation: item {i}")
                kind = (
                    len(item["input_ids"]),
                    greedy or item.get("greedy", False),
                    tuple(item.get("stop_strings") or ()),
                    tuple(item.get("stop_token_ids") or ()),
                    item.get("logprobs", True),
                )
                if kind not in made:
                    made[kind] = self.sampling_params(
                        kind[0],
                        is_eval=is_eval,
                        greedy=kind[1],
                        stop_strings=kind[2],
                        stop_token_ids=kind[3],
                        logprobs=kind[4],
                    )
                request_ids.append(
                    self.add_request(item["input_ids"], made[kind], prompt_text=item.get("prompt"))
                )
        return request_ids

    def _check_ready(self) -> None:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before generating")
        if adapter.is_sleeping(self.engine):
            raise RuntimeError(f"{type(self).__name__} is asleep: call wake_up() before generating")

    def _drive(self, add_requests, is_eval=False) -> list:
        """Submit a call to the engine loop (`add_requests()` queues its requests, on the engine
        thread; each step goes through `forward_step`, or `eval_forward` when is_eval) and wait
        until all its requests finish; returns the finished `RequestOutput`s sorted by request id
        and records `self.metrics`."""
        self._check_ready()
        start = time.perf_counter()
        with collection_paused():  # see chatgen.module.collection_paused
            finished, stats = self.engine_loop.run(self, add_requests, is_eval, self.on_finished)
        self._decode_texts(finished)
        self.metrics = {**call_metrics(finished, time.perf_counter() - start), **stats}
        return finished
