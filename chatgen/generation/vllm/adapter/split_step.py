"""The split engine step: vLLM's `EngineCore.step()` cut in two so that the framework owns the loop.

    schedule(llm)            -> ScheduledBatch     scheduler.schedule()
    execute(llm, batch)      -> [RequestOutput]    executor.execute_model + sample_tokens,
                                                   scheduler.update_from_output, output_processor

which is exactly `EngineCore.step()` + `InprocClient.get_output()` + `LLMEngine.step()` for an
in-process, single-batch-queue engine; plus the request calls around it (add, abort, counts, prefix
cache, sleep). `check_internals(llm)` asserts every private attribute the split relies on
(`build_llm` calls it).
"""

import contextlib
import copy
import dataclasses
import random
import time

import msgspec

import vllm
from vllm import LLM, SamplingParams, envs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from chatgen.generation.vllm.adapter.fast_step import flush_held_outputs
from chatgen.generation.vllm.adapter.patches import TESTED_VLLM


@dataclasses.dataclass
class ScheduledBatch:
    """What the scheduler picked for one engine step; `forward_step` receives it.

    num_tokens: {request id: tokens to run this step}: a prefill chunk (> 1) or one decode token
    each. scheduler_output: vLLM's `SchedulerOutput`, opaque to user code: hand the batch to
    `execute_step`.
    """

    num_tokens: dict
    scheduler_output: object

    @property
    def request_ids(self) -> list:
        return list(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())


def engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def check_internals(llm: LLM) -> None:
    """Raise a RuntimeError naming each vLLM internal that the split step needs and that is
    missing."""
    problems = []
    engine = llm.llm_engine
    client = getattr(engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is None:
        problems.append(
            "LLM.llm_engine.engine_core.engine_core (in-process EngineCore) is missing: the engine runs in a "
            "separate process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm is imported"
        )
    else:
        for owner, attrs in (
            (
                core,
                (
                    "scheduler",
                    "model_executor",
                    "step",
                    "step_fn",
                    "post_step",
                    "_process_aborts_queue",
                    "batch_queue",
                    "async_scheduling",
                ),
            ),
            (
                getattr(core, "scheduler", None),
                (
                    "schedule",
                    "update_from_output",
                    "get_grammar_bitmask",
                    "has_requests",
                    "kv_cache_manager",
                ),
            ),
            (getattr(core, "model_executor", None), ("execute_model", "sample_tokens")),
            (
                engine,
                (
                    "output_processor",
                    "add_request",
                    "has_unfinished_requests",
                    "abort_request",
                    "reset_prefix_cache",
                    "input_processor",
                    "get_supported_tasks",
                ),
            ),
            (
                getattr(engine, "input_processor", None),
                ("process_inputs", "assign_request_id"),
            ),
            (client, ("add_request",)),
            (getattr(engine, "output_processor", None), ("request_states", "external_req_ids")),
        ):
            for attr in attrs:
                if not hasattr(owner, attr):
                    problems.append(f"{type(owner).__name__}.{attr} is missing")
        if not problems:
            if core.batch_queue is not None or core.step_fn != core.step:
                problems.append(
                    "EngineCore uses a batch queue (pipeline parallel?): the split step supports "
                    "only EngineCore.step; use pipeline_parallel_size=1"
                )
            if core.async_scheduling:
                problems.append(
                    "async scheduling is on: the split step needs synchronous scheduling"
                )
    from vllm.v1.engine.output_processor import RequestState

    if not hasattr(RequestState, "make_request_output"):
        problems.append(
            "vllm.v1.engine.output_processor.RequestState.make_request_output is missing"
        )
    if problems:
        raise RuntimeError(
            f"chatgen's vLLM adapter (tested with vLLM {TESTED_VLLM}) does not fit vLLM {vllm.__version__}:\n  "
            + "\n  ".join(problems)
            + "\nUpdate chatgen/generation/vllm/adapter/split_step.py (schedule/execute mirror EngineCore.step)."
        )


def add_request(
    llm: LLM,
    request_id: str,
    prompt_ids: list,
    params: SamplingParams,
    prompt_text=None,
    cache_salt=None,
    output_kind=RequestOutputKind.FINAL_ONLY,
    lora_request=None,
) -> None:
    """Queue one prompt (token ids, optional text kept for the output) with its sampling parameters.

    output_kind: FINAL_ONLY (one output when the request finishes, as LLM.generate) or DELTA (every
    step's new tokens, for streaming). lora_request: the vLLM LoRA adapter to sample with (None: the
    base). cache_salt: requests share prefix-cache blocks only with requests of the same salt.
    Log-prob entries carry no token text (`decoded_token` None) even when the request detokenizes
    its output: vLLM would decode every entry on the engine thread (measured: 15% of a serving
    engine step of the tiny model), and chatgen reads only their values.
    """
    caller_params = params
    params.output_kind = output_kind
    sampled = getattr(llm, "chatgen_sampled_logprobs", None)
    gathered = sampled is not None and sampled.takes(params, output_kind)
    if (
        gathered
    ):  # vLLM computes none; sampled_logprobs.py gathers them (a copy: the caller may reuse params)
        params = copy.copy(params)
        params.logprobs = None
    engine = llm.llm_engine
    templates = getattr(llm, "chatgen_request_templates", None)
    key = (id(caller_params), len(prompt_ids), cache_salt, output_kind, id(lora_request))
    if templates is not None and params.n == 1 and key in templates:
        # vLLM's checks and its processed params hold for this prompt too: copy them
        template = templates[key][1]
        request = msgspec.structs.replace(
            template,
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            sampling_params=copy.copy(template.sampling_params),
            arrival_time=time.time(),
        )
        _submit(engine, request, prompt_text)
    elif templates is not None and params.n == 1:
        request = engine.input_processor.process_inputs(
            request_id,
            _prompt(prompt_ids, prompt_text, cache_salt),
            params,
            supported_tasks=engine.get_supported_tasks(),
            lora_request=lora_request,
        )
        # kept as processed, before the engine takes it; the caller's params are kept alive so
        # that their id stays theirs
        kept = msgspec.structs.replace(request, sampling_params=copy.copy(request.sampling_params))
        templates[key] = (caller_params, kept)
        _submit(engine, request, prompt_text)
    else:
        prompt = _prompt(prompt_ids, prompt_text, cache_salt)
        engine.add_request(request_id, prompt, params, lora_request=lora_request)
    processor = engine.output_processor
    if gathered:
        sampled.want(request_id, processor)
    # a request with n samples has n
    for internal_id in processor.external_req_ids.get(request_id, ()):
        state = processor.request_states.get(internal_id)
        if state is not None and state.logprobs_processor is not None:
            state.logprobs_processor.tokenizer = None


def _prompt(prompt_ids, prompt_text, cache_salt) -> TokensPrompt:
    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if prompt_text is not None:
        prompt["prompt"] = prompt_text
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


# The 8 random hex digits vLLM's `InputProcessor.assign_request_id` appends to a request's id
# (internal id "<id>-<8 hex>"), drawn from a generator seeded once from the OS instead of a uuid4
# per request (an os.urandom read each: ~4 us against ~0.5 us, for every prompt of a call).
_ID_SUFFIXES = random.Random()


def _submit(engine, request, prompt_text) -> None:
    """What LLMEngine.add_request does with a processed request of one sample (n = 1)."""
    if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        engine.input_processor.assign_request_id(request)
    else:
        request.external_req_id = request.request_id
        request.request_id = f"{request.request_id}-{_ID_SUFFIXES.getrandbits(32):08x}"
    engine.output_processor.add_request(request, prompt_text, None, 0)
    engine.engine_core.add_request(request)


@contextlib.contextmanager
def request_batch(llm: LLM):
    """Inside it, `add_request` runs vLLM's input processing (validation, rendering, a deep copy
    of the params) once per params object and prompt length, and copies the processed request for
    every further prompt of that kind: the per-prompt cost of adding a batch of prompts
    (measured: ~20% of the tiny model's 256-prompt evaluation). The caller must not change a
    params object inside it."""
    llm.chatgen_request_templates = {}
    try:
        yield
    finally:
        llm.chatgen_request_templates = None


def has_unfinished_requests(llm: LLM) -> bool:
    return llm.llm_engine.has_unfinished_requests()


def abort(llm: LLM, request_ids: list) -> None:
    """Drop requests (e.g. after an exception mid-loop) so the next call starts from an empty
    engine."""
    processor = llm.llm_engine.output_processor
    flush_held_outputs(engine_core(llm).scheduler, processor)
    engine_ids = [rid for r in request_ids for rid in processor.external_req_ids.get(r, ())]
    for recorder in _recorders(llm):
        recorder.forget(engine_ids)
    llm.llm_engine.abort_request(list(request_ids))


def _recorders(llm: LLM) -> list:
    """The per-request recorders installed on this engine (routed experts, sampled log-probs)."""
    return [
        r
        for r in (
            getattr(llm, "chatgen_routing", None),
            getattr(llm, "chatgen_sampled_logprobs", None),
        )
        if r is not None
    ]


def abort_with_outputs(llm: LLM, request_ids: list) -> list:
    """Abort requests and return, for each, a finished RequestOutput holding what it generated so
    far (finish_reason "abort"; a request with n samples gives one output with all n)."""
    from vllm.v1.engine import FinishReason

    wanted, outputs = set(request_ids), []
    flush_held_outputs(engine_core(llm).scheduler, llm.llm_engine.output_processor)
    for state in list(llm.llm_engine.output_processor.request_states.values()):
        if state.external_req_id in wanted:
            output = state.make_request_output([], None, FinishReason.ABORT, None)
            if output is not None:
                outputs.append(output)
    sampled = getattr(llm, "chatgen_sampled_logprobs", None)
    if sampled is not None:
        sampled.hand_out(outputs)
    abort(llm, request_ids)
    return outputs


def output_token_counts(llm: LLM) -> dict:
    """{(request id, sample index): tokens generated so far} for every unfinished request."""
    flush_held_outputs(engine_core(llm).scheduler, llm.llm_engine.output_processor)
    return {
        (state.external_req_id, state.request_index): state.detokenizer.num_output_tokens()
        for state in llm.llm_engine.output_processor.request_states.values()
        if state.detokenizer is not None
    }


def reset_prefix_cache(llm: LLM, preempt_running: bool = False) -> bool:
    """Drop every cached KV block that no request holds; with preempt_running, first preempt the
    running requests (they re-prefill prompt + generated tokens when next scheduled), so the
    reset always succeeds. Returns whether the cache was reset (False: running requests hold
    blocks)."""
    return llm.reset_prefix_cache(reset_running_requests=preempt_running) is not False


def schedule(llm: LLM) -> ScheduledBatch:
    """Ask vLLM's scheduler which requests run next and how many tokens each (first half of
    EngineCore.step)."""
    out = engine_core(llm).scheduler.schedule()
    return ScheduledBatch(out.num_scheduled_tokens, out)


def execute(llm: LLM, batch: ScheduledBatch) -> list:
    """Run the model on a scheduled batch, sample, and update request states (second half of
    EngineCore.step).

    Returns the `RequestOutput`s this step finished (requests are added with FINAL_ONLY output).
    """
    engine = llm.llm_engine
    core = engine_core(llm)
    so = batch.scheduler_output
    future = core.model_executor.execute_model(so, non_block=True)
    grammar_output = core.scheduler.get_grammar_bitmask(so)
    model_output = future.result()
    if model_output is None:
        model_output = core.model_executor.sample_tokens(grammar_output)
    core._process_aborts_queue()
    core_outputs = core.scheduler.update_from_output(so, model_output)
    core.post_step(model_executed=so.total_num_scheduled_tokens > 0)
    routing = getattr(llm, "chatgen_routing", None)
    if routing is not None:
        routing.end_step(so, engine.output_processor)
    core_outputs = core_outputs.get(0)
    if core_outputs is None:
        return []
    processed = engine.output_processor.process_outputs(
        core_outputs.outputs, engine_core_timestamp=core_outputs.timestamp, iteration_stats=None
    )
    for recorder in _recorders(llm):
        recorder.hand_out(processed.request_outputs)
    engine.output_processor.update_scheduler_stats(core_outputs.scheduler_stats)
    # Requests that hit a stop string finish in the output processor; the core must drop them too.
    if processed.reqs_to_abort:
        core.abort_requests(processed.reqs_to_abort)
    return processed.request_outputs


def kv_cache_usage(llm: LLM) -> float:
    """Fraction of KV-cache blocks in use right now (0..1)."""
    return engine_core(llm).scheduler.kv_cache_manager.usage


def sleep(llm: LLM, level: int = 1) -> None:
    """Pause the engine and (on GPU) discard the KV cache and offload weights (level 1) or drop them
    (level 2).

    On CPU this pauses scheduling and clears the prefix cache; memory stays allocated.
    """
    llm.sleep(level=level)


def wake_up(llm: LLM, tags: list | None = None) -> None:
    """Reallocate what `sleep` released: everything, or only `tags` ("weights", "kv_cache"; all
    of them must be woken before the engine generates again)."""
    llm.wake_up(tags)


def is_sleeping(llm: LLM) -> bool:
    return llm.llm_engine.is_sleeping()


def vocab_size(llm: LLM) -> int:
    """Token ids the engine accepts: 0 .. vocab_size - 1."""
    return llm.llm_engine.model_config.get_vocab_size()


def hf_config(llm: LLM) -> dict:
    """The HF config (config.json as a dict) the engine was started with."""
    return llm.llm_engine.model_config.hf_config.to_dict()
