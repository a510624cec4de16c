"""Exact shortcuts through vLLM 0.32's per-request Python in each engine step.

vLLM's scheduler walks every running request at every step with code written for every feature
it has (speculative decoding, pooling, KV and encoder connectors, structured output, streaming
sessions). On the tiny model's 256-prompt evaluation that is ~20 us a request and step, a large
share of the call (docs/long_context.md, issue 52's evaluation item). Each shortcut here covers
only a request, or a step, for which vLLM's own code does nothing but the plain work, and does
that work; anything else goes to vLLM's code. `RELIES_ON` names the vLLM code each shortcut
mirrors (checked with adapter/patches.py's, tests/integration/test_vllm_patches.py), and
tests/integration/test_vllm_step_fast_paths.py generates with and without them and compares.
"""

# shortcut -> what it needs of vLLM, in patches.RELIES_ON's form
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
RELIES_ON = {
    "plain_output_fast_path": [
        (f"{_SCHEDULER}.update_from_output", ("self", "scheduler_output", "model_runner_output")),
        (f"{_SCHEDULER}._update_request_with_output", "request.append_output_token_ids("),
        (
            f"{_SCHEDULER}.update_from_output",
            "request.num_in_flight_tokens -= num_tokens_scheduled",
        ),
        (f"{_SCHEDULER}.update_from_output", "request.num_stale_output_tokens > 0"),
        (
            f"{_SCHEDULER}.update_from_output",
            "logprobs.slice_request(req_index, len(new_token_ids))",
        ),
        (
            f"{_SCHEDULER}.update_from_output",
            "for req_id, num_tokens_scheduled in num_scheduled_tokens",
        ),
        (f"{_SCHEDULER}.update_from_output", "outputs[request.client_index].append("),
        (f"{_SCHEDULER}.update_from_output", "prefill_stats = request.take_prefill_stats()"),
        (
            f"{_SCHEDULER}.update_from_output",
            "self.kv_cache_manager.estimate_cached_tokens(request)",
        ),
        (
            "vllm.v1.core.sched.utils:check_stop",
            "request.num_output_tokens < sampling_params.min_tokens",
        ),
        ("vllm.v1.core.sched.utils:check_stop", "repetition_detection = sampling_params."),
        ("vllm.v1.request:Request.update_block_hashes", "self._block_hasher(self)"),
        ("vllm.v1.request:Request.take_events", "if not self.events:"),
        (
            "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
            "start_token_idx = len(request.block_hashes) * hash_block_size",
        ),
        (
            "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
            "if start_token_idx + hash_block_size > num_tokens:",
        ),
        (
            "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
            "def request_block_hasher(request: Request) -> list[BlockHash]:",
        ),
        ("vllm.v1.request:Request.take_prefill_stats", "self.prefill_stats = None"),
        ("vllm.v1.engine:EngineCoreOutputs", "outputs: list[EngineCoreOutput]"),
        ("vllm.v1.engine:EngineCoreOutput", "num_nans_in_logits: int = 0"),
    ],
}


def plain_output_fast_path(scheduler) -> None:
    """vLLM 0.32's `Scheduler.update_from_output` files each request's sampled tokens with ~8 us
    of Python per request and step (stale-output, speculative-decoding, encoder, pooling,
    structured-output, stop and connector branches around two calls). A step's plain requests
    are filed here first: a running request with no stale output, no encoder inputs and no
    grammar that sampled one token which stops nothing (not EOS, no stop token, under max_tokens
    and the model's length, no repetition check past min_tokens) gets exactly what vLLM does to
    it: the token appended (block hashes too), the in-flight count dropped, its prefill stats
    finalized after its prompt, its EngineCoreOutput (with its log-probs' slice, its events).
    vLLM's method then runs on the rest of the step (requests that finish, partial prefills,
    anything else) and everything after its loop (freeing, stats, events), and the outputs keep
    vLLM's order. A step with speculative tokens, pooling, NaN counts, prompt log-probs or a KV
    connector output goes to vLLM whole; so does every step of a scheduler with connectors, async
    scheduling, sampling masks, aux outputs or MFU metrics."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    if (
        getattr(scheduler, "chatgen_fast_output", False)
        or type(scheduler) is not Scheduler  # AsyncScheduler files placeholders differently
        or scheduler.connector is not None
        or scheduler.ec_connector is not None
        or scheduler.aux_output_connector is not None
        or scheduler.return_sampling_mask
        or scheduler.perf_metrics is not None
    ):
        return
    update = scheduler.update_from_output
    hashers = [None, None]  # the requests' block hasher (one per engine) and its block size
    requests, max_model_len, running = (
        scheduler.requests,
        scheduler.max_model_len,
        RequestStatus.RUNNING,
    )

    def update_from_output(scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        scheduled = scheduler_output.num_scheduled_tokens
        if (
            not sampled
            or scheduler_output.scheduled_spec_decode_tokens
            or model_runner_output.pooler_output
            or model_runner_output.num_nans_in_logits  # {} when not counted
            or model_runner_output.kv_connector_output is not None
            or model_runner_output.prompt_logprobs_dict
            or model_runner_output.prompt_token_id_logprobs_dict
        ):
            return update(scheduler_output, model_runner_output)
        logprobs, index = model_runner_output.logprobs, model_runner_output.req_id_to_index
        outputs, rest = {}, {}
        for req_id, num_tokens in scheduled.items():
            request = requests.get(req_id)
            if (
                request is None
                or request.status != running
                or request.num_stale_output_tokens
                or request.has_encoder_inputs
                or request.structured_output_request is not None
            ):
                rest[req_id] = num_tokens
                continue
            req_index = index[req_id]
            new_token_ids = sampled[req_index]
            params = request.sampling_params
            # check_stop's tests, in its order, for the token about to be appended
            if (
                len(new_token_ids) != 1
                or new_token_ids[0] == params.eos_token_id
                or new_token_ids[0] in (params.stop_token_ids or ())
                or request.num_tokens + 1 >= max_model_len
                or request.num_output_tokens + 1 >= request.max_tokens
                or (
                    params.repetition_detection is not None
                    and request.num_output_tokens + 1 >= params.min_tokens
                )
            ):
                rest[req_id] = num_tokens
                continue
            request.num_in_flight_tokens -= num_tokens
            token, all_token_ids = new_token_ids[0], request._all_token_ids
            request._output_token_ids.append(token)
            all_token_ids.append(token)
            hasher = request._block_hasher
            if hasher is not None:
                if hasher is not hashers[0]:
                    hashers[:] = hasher, _closure_value(hasher, "hash_block_size")
                # the hasher's own early stop (no new full block: it returns []), without the call
                if (len(request.block_hashes) + 1) * hashers[1] <= len(all_token_ids):
                    request.block_hashes.extend(hasher(request))
            prefill_stats = request.prefill_stats  # the first token after the prompt: its stats
            if prefill_stats is not None:
                request.prefill_stats = None
                prefill_stats.finalize(scheduler.kv_cache_manager.estimate_cached_tokens(request))
            client_outputs = outputs.get(request.client_index)
            if client_outputs is None:
                client_outputs = outputs[request.client_index] = []
            client_outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=(
                        logprobs.slice_request(req_index, 1)
                        if logprobs and params.num_logprobs is not None
                        else None
                    ),
                    stop_reason=request.stop_reason,
                    events=request.take_events() if request.events else None,
                    prefill_stats=prefill_stats,
                    trace_headers=request.trace_headers,
                    num_nans_in_logits=request.num_nans_in_logits,
                )
            )
        if not outputs:
            return update(scheduler_output, model_runner_output)
        scheduler_output.num_scheduled_tokens = rest  # vLLM's loop files the rest
        try:
            result = update(scheduler_output, model_runner_output)
        finally:
            scheduler_output.num_scheduled_tokens = scheduled
        for client, filed in outputs.items():
            core_outputs = result.get(client)
            if core_outputs is None:
                result[client] = EngineCoreOutputs(outputs=filed)
            elif not core_outputs.outputs:
                core_outputs.outputs = filed
            else:  # vLLM's order: the step's requests as scheduled, then its error outputs
                order = {req_id: i for i, req_id in enumerate(scheduled)}
                filed.extend(core_outputs.outputs)
                filed.sort(key=lambda o: order.get(o.request_id, len(order)))
                core_outputs.outputs = filed
        return result

    scheduler.update_from_output = update_from_output
    scheduler.chatgen_fast_output = True


def _closure_value(function, name: str):
    """The value of the variable `name` that `function` closes over."""
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents
