"""TRL's merged `VLLMGeneration` (trl/generation/vllm_generation.py, 2026) over chatgen's engine:
TRL code written against it runs with only the import changed.

    from chatgen.compat.trl import VLLMGeneration                  # TRL: from trl.generation.vllm_generation
    gen = VLLMGeneration(model, accelerator, tokenizer, max_completion_length=32)  # 2026-06: (.., False, tokenizer)
    prompt_ids, completion_ids, logprobs, logprob_token_ids = gen.generate(prompts, None, num_generations)
    ...an optimizer step on `model`...
    gen.sync_weights()                                             # reads the wrapped model, as TRL's does

The constructor's arguments are TRL's; the engine is chatgen's `VLLMGeneration`
(chatgen.generation.standalone) on the model's directory (`model.name_or_path`), colocated in this
process, or a `chatgen serve --control` server (mode="server"; chatgen's server wants an API key:
the extra keyword `api_key`). `prompts` holds each prompt num_generations times in a row, as TRL's
trainers build it; the result has one entry per entry of `prompts`, in order: logprobs[i][t] =
[log-prob of the sampled token t] (logprobs=0: TRL's inner dimension 1), logprob_token_ids[i][t] =
[that token]. A PEFT model is merged for the sync and unmerged after it (TRL's names:
"base_model.model." and ".base_layer" removed, the adapters' own weights left out). What chatgen's
engine does not do is refused by name: structured outputs, images, logprobs > 0, a trainer of
several processes (one engine per process of a multi-process job is chatgen's run,
docs/rlhf_engine.md).
"""

import contextlib

from chatgen.generation.standalone import VLLMGeneration as Engine
from chatgen.param_sync.checks import SyncError, nonfinite

# TRL's constructor after (model, accelerator), in order: its current shape, and the 2026-06 one
# (with is_fsdp_enabled third, removed on 2026-06-11; no trust_remote_code). A bool third argument
# or the keyword is_fsdp_enabled tells the 2026-06 shape (a processing_class is never a bool).
CURRENT = (
    "processing_class", "mode", "structured_outputs_regex", "server_base_url", "server_host",
    "server_port", "server_timeout", "group_port", "tensor_parallel_size", "gpu_memory_utilization",
    "max_model_length", "max_num_seqs", "enable_sleep_mode", "model_impl", "trust_remote_code",
    "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_completion_length",
    "logprobs", "generation_kwargs",
)  # fmt: skip
JUNE_2026 = ("is_fsdp_enabled",) + tuple(name for name in CURRENT if name != "trust_remote_code")


class VLLMGeneration:
    """TRL's merged class (see the module docstring); arguments as TRL names and defaults them,
    positional ones in TRL's current order or its 2026-06 one (CURRENT, JUNE_2026)."""

    def __init__(self, model, accelerator, *args, **kwargs):
        names = (
            JUNE_2026 if "is_fsdp_enabled" in kwargs or args[:1] in ((True,), (False,)) else CURRENT
        )
        if len(args) > len(names):
            raise TypeError(
                f"VLLMGeneration takes {2 + len(names)} positional arguments, {2 + len(args)} given"
            )
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"VLLMGeneration got multiple values for argument {name!r}")
            kwargs[name] = value
        self._start(model, accelerator, **kwargs)

    def _start(
        self,
        model,
        accelerator,
        processing_class=None,
        mode: str = "colocate",
        structured_outputs_regex: str | None = None,
        server_base_url: str | None = None,
        server_host: str = "127.0.0.1",
        server_port: int = 8000,
        server_timeout: float = 240.0,
        group_port: int = 51216,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_length: int | None = None,
        max_num_seqs: int | None = None,
        enable_sleep_mode: bool = False,
        model_impl: str = "auto",
        trust_remote_code: bool = False,  # chatgen loads the model families it knows, never remote code
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        max_completion_length: int = 16,
        logprobs: int | None = 0,
        generation_kwargs: dict | None = None,
        is_fsdp_enabled: bool = False,
        *,
        api_key: str | None = None,
        **engine_kwargs,
    ):
        refused = [
            (structured_outputs_regex is not None, "structured_outputs_regex", "remove it"),
            (
                logprobs not in (0, None),
                f"logprobs={logprobs}",
                "use 0 (the sampled token's) or None",
            ),
            (model_impl not in ("auto", "vllm"), f"model_impl={model_impl!r}", "use 'auto'"),
            (
                bool(generation_kwargs),
                f"generation_kwargs={generation_kwargs}",
                "pass the named arguments",
            ),
            (
                getattr(accelerator, "num_processes", 1) > 1,
                "a multi-process accelerator",
                "run one process",
            ),
        ]
        for bad, what, fix in refused:
            if bad:
                raise ValueError(
                    f"VLLMGeneration (chatgen.compat.trl): {what} is not supported; {fix}"
                )
        self.model, self.accelerator, self.is_fsdp_enabled = model, accelerator, is_fsdp_enabled
        self.processing_class, self.mode, self.logprobs = processing_class, mode, logprobs
        self.enable_sleep_mode = enable_sleep_mode and mode == "colocate"
        sampling = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or 0,  # TRL's trainers pass None for off
            min_p=min_p or 0.0,
            repetition_penalty=repetition_penalty,
            max_completion_length=max_completion_length,
        )
        if mode == "server":
            url = server_base_url or f"http://{server_host}:{server_port}"
            self.engine = Engine(
                None, "server", server_base_url=url, api_key=api_key, **sampling, **engine_kwargs
            )
        else:
            engine_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
            if max_num_seqs is not None:
                engine_kwargs.setdefault("generation_batch_size", max_num_seqs)
            self.engine = Engine(
                _model_dir(model),
                mode,
                tensor_parallel_size=tensor_parallel_size,
                max_model_length=max_model_length,
                **sampling,
                **engine_kwargs,
            )
            if self.enable_sleep_mode:
                self.engine.module.sleep()

    @property
    def llm(self):
        """The colocated engine's `vllm.LLM` (TRL's trainers read its model_config); None in
        server mode."""
        module = getattr(self.engine, "module", None)
        return getattr(module, "engine", None)

    def generate(self, prompts: list, images, num_generations: int, profiler=None) -> tuple:
        """(prompt_ids, completion_ids, logprobs, logprob_token_ids), one entry per entry of
        `prompts` (token-id lists, each prompt num_generations times in a row)."""
        if images is not None and any(image is not None for image in images):
            raise ValueError(
                "VLLMGeneration.generate (chatgen.compat.trl): images are not supported; pass None"
            )
        prompts = [list(p) for p in prompts]
        groups = len(prompts) // num_generations if num_generations else 0
        # TRL's layout: one request of n samples per prompt (one prefix in the cache), else one each
        grouped = groups * num_generations == len(prompts) and all(
            prompts[g * num_generations + j] == prompts[g * num_generations]
            for g in range(groups)
            for j in range(num_generations)
        )
        unique, n = (prompts[::num_generations], num_generations) if grouped else (prompts, 1)
        if self.enable_sleep_mode:
            self.engine.module.wake_up()
        try:
            with profiler or contextlib.nullcontext():  # TRL's profiling_context, timing the call
                prompt_ids, completion_ids, logprobs = self.engine.generate(
                    unique, num_generations=n
                )
        finally:
            if self.enable_sleep_mode:
                self.engine.module.sleep()
        if self.logprobs is None:
            return prompt_ids, completion_ids, None, None
        return (
            prompt_ids,
            completion_ids,
            [[[lp] for lp in row] for row in logprobs],
            [[[token] for token in row] for row in completion_ids],
        )

    def sync_weights(self) -> None:
        """Write the wrapped model's current weights into the engine (checked before anything is
        written)."""
        model = self.model
        if hasattr(model, "merge_adapter"):  # PEFT: the merged weights under the base model's names
            # before the merge: merging a NaN adapter into the base and out again leaves the base
            # NaN
            bad = nonfinite((n, p) for n, p in model.named_parameters() if model.prefix in n)
            if bad:
                raise SyncError(
                    f"weight sync refused, the engine and the model are as they were: the adapter holds "
                    f"NaN or inf in {len(bad)} tensor(s): {', '.join(bad[:5])}; the training step "
                    "that made them diverged (lower the learning rate, check the loss)"
                )
            model.merge_adapter()
            try:
                self.engine.sync_weights(_peft_weights(model))
            finally:
                model.unmerge_adapter()
        else:
            self.engine.sync_weights(model)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _model_dir(model) -> str:
    path = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    if not path:
        raise ValueError(
            "VLLMGeneration (chatgen.compat.trl): the model has no name_or_path; load it with "
            "from_pretrained(<directory>) so the engine can start from the same checkpoint"
        )
    return path


def _peft_weights(model) -> list:
    """(HF name, tensor) of a merged PEFT model, by the base model's names (TRL's renaming); a
    tied model's lm_head.weight left out (the engine's head is its embedding)."""
    config = getattr(model, "config", None)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    pairs = []
    for name, tensor in model.state_dict().items():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if model.prefix in name or "original_module" in name or name in tied:
            continue
        pairs.append((name.replace("modules_to_save.default.", ""), tensor))
    return pairs
