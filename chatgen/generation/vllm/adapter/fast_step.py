"""Exact shortcuts through vLLM 0.32's per-request Python in each engine step.

vLLM's scheduler walks every running request at every step with code written for every feature
it has (speculative decoding, pooling, KV and encoder connectors, structured output, streaming
sessions). On the tiny model's 256-prompt evaluation that is ~20 us a request and step, a large
share of the call (docs/long_context.md, issue 52's evaluation item). Each shortcut here covers
only a request, or a step, for which vLLM's own code does nothing but the plain work, and does
that work; anything else goes to vLLM's code: `plain_decode_schedule_fast_path` schedules a step
of plain decodes (`Scheduler.schedule`), `plain_output_fast_path` files a step's sampled tokens
(`Scheduler.update_from_output`) and holds the outputs of requests that want only their final
one (`flush_held_outputs` hands them over before anything reads the requests' state mid-run).
`RELIES_ON` names the vLLM code each mirrors (checked with patches.py's), and
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
        # held outputs: what the output processor does with a held request's unfinished output
        ("vllm.v1.engine.output_processor:RequestState.from_new_request", "tokenizer = None"),
        ("vllm.v1.engine.detokenizer:IncrementalDetokenizer.update", "self.token_ids.extend("),
        (
            "vllm.v1.engine.output_processor:RequestState.make_request_output",
            "if not finished and final_only:",
        ),
        (
            "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
            "engine_core_output.prefill_stats.num_cached_tokens",
        ),
        (
            "vllm.v1.engine.output_processor:OutputProcessor._update_stats_from_output",
            "if iteration_stats is None:",
        ),
        ("vllm.v1.engine.logprobs:LogprobsProcessor.update_from_output", "if output.new_logprobs"),
        ("vllm.v1.request:Request.is_finished", "def is_finished(self) -> bool:"),
    ],
    "plain_decode_schedule_fast_path": [
        (f"{_SCHEDULER}.schedule", ("self", "throttle_prefills")),
        # the running loop's tests, in its order, and its one call per request
        (f"{_SCHEDULER}.schedule", "request.num_output_placeholders > 0"),
        (f"{_SCHEDULER}.schedule", "self.current_step < request.next_decode_eligible_step"),
        (f"{_SCHEDULER}.schedule", "request.num_tokens_with_spec"),
        (f"{_SCHEDULER}.schedule", "- self.num_sampled_tokens_per_step,"),
        (f"{_SCHEDULER}.schedule", "if request.has_encoder_inputs:"),
        (f"{_SCHEDULER}.schedule", "num_lookahead_tokens=self.num_lookahead_tokens,"),
        (f"{_SCHEDULER}.schedule", "if self.policy == SchedulingPolicy.PRIORITY:"),
        (f"{_SCHEDULER}.schedule", "assert len(scheduled_loras) <= self.lora_config.max_loras"),
        # the waiting loop, which an empty queue leaves at once, and what follows it
        (f"{_SCHEDULER}.schedule", "request_queue = self.kv_holding_waiting"),
        (
            f"{_SCHEDULER}.schedule",
            "self.prefill_capacity_bound = num_waiting > len(self.deferred_waiting)",
        ),
        (f"{_SCHEDULER}.schedule", "self.prev_step_scheduled_req_ids.update("),
        (f"{_SCHEDULER}.schedule", "self.kv_cache_manager.take_boundary_state_offloads()"),
        (f"{_SCHEDULER}.schedule", "self.kv_cache_manager.take_kv_cache_block_copies()"),
        (f"{_SCHEDULER}.schedule", "free_encoder_mm_hashes=self.encoder_cache_manager"),
        (f"{_SCHEDULER}.schedule", "new_block_ids_to_zero=self._get_new_block_ids_to_zero(),"),
        (f"{_SCHEDULER}.schedule", "ec_manager_metadata=self.encoder_cache_manager"),
        (f"{_SCHEDULER}._make_cached_request_data", "req.all_token_ids.copy()"),
        (
            f"{_SCHEDULER}._make_cached_request_data",
            "req_to_new_blocks[req_id].get_block_ids(allow_none=True)",
        ),
        (f"{_SCHEDULER}._update_after_schedule", "request.num_in_flight_tokens += num_scheduled"),
        (f"{_SCHEDULER}._update_after_schedule", "request.use_structured_output and not"),
        (f"{_SCHEDULER}._update_after_schedule", "self._inflight_prefills.discard(request)"),
        (f"{_SCHEDULER}._update_after_schedule", "self.reset_preempted_req_ids = set()"),
        # a running request's blocks to allocate, with one full-attention group
        (
            "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.get_num_blocks_to_allocate",
            "return max(num_required_blocks - num_req_blocks, 0)",
        ),
        ("vllm.v1.core.sched.output:SchedulerOutput", "num_spec_tokens_to_schedule: int = 0"),
        ("vllm.v1.core.sched.output:CachedRequestData", "num_output_tokens: list[int]"),
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
    scheduling, sampling masks, aux outputs or MFU metrics.

    Held outputs: vLLM's output processor only appends a step's token of a request that wants
    its final output alone (FINAL_ONLY), no log-probs and no text (~3 us an output, ~2,300 in the
    main job's evaluation), so without stats such tokens are held here: the request's next output
    (vLLM's final one, or `flush_held_outputs`'s) carries them and its first token's prefill stats;
    the processor's state after it, and its RequestOutput, are the same."""
    from vllm.sampling_params import RequestOutputKind
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
    # request id -> [request, tokens held, its first token's prefill stats]
    holding = scheduler.chatgen_holding = {}
    final_only, log_stats = RequestOutputKind.FINAL_ONLY, scheduler.log_stats
    scheduler.chatgen_hold_outputs = True  # read for each new request (a bench's switch)

    def held_back(request) -> bool:
        params = request.sampling_params
        held = (
            not log_stats
            and scheduler.chatgen_hold_outputs
            and params.output_kind == final_only
            and params.logprobs is None
            and params.prompt_logprobs is None
            and not params.detokenize
            and not request.resumable
        )
        request.chatgen_hold = held
        return held

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
            return _with_held(update(scheduler_output, model_runner_output), holding, scheduled)
        logprobs, index = model_runner_output.logprobs, model_runner_output.req_id_to_index
        outputs, rest, filed = {}, {}, False
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
            filed = True
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
            hold = request.__dict__.get("chatgen_hold")
            if hold if hold is not None else held_back(request):
                entry = holding.get(req_id)
                if entry is None:
                    holding[req_id] = [request, 1, prefill_stats]
                else:
                    entry[1] += 1
                continue
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
        if not filed:
            return _with_held(update(scheduler_output, model_runner_output), holding, scheduled)
        scheduler_output.num_scheduled_tokens = rest  # vLLM's loop files the rest
        try:
            result = _with_held(update(scheduler_output, model_runner_output), holding, rest)
        finally:
            scheduler_output.num_scheduled_tokens = scheduled
        for client, filed_outputs in outputs.items():
            core_outputs = result.get(client)
            if core_outputs is None:
                result[client] = EngineCoreOutputs(outputs=filed_outputs)
            elif not core_outputs.outputs:
                core_outputs.outputs = filed_outputs
            else:  # vLLM's order: the step's requests as scheduled, then its error outputs
                order = {req_id: i for i, req_id in enumerate(scheduled)}
                filed_outputs.extend(core_outputs.outputs)
                filed_outputs.sort(key=lambda o: order.get(o.request_id, len(order)))
                core_outputs.outputs = filed_outputs
        return result

    scheduler.update_from_output = update_from_output
    scheduler.chatgen_fast_output = True


def _with_held(result: dict, holding: dict, filed_by_vllm) -> dict:
    """vLLM's outputs of a step, each of a request with tokens held carrying them too (before its
    own tokens: they came first), with its first token's prefill stats; `filed_by_vllm`: the
    requests vLLM's loop filed this step. A held request vLLM dropped without an output (aborted
    inside the engine) is forgotten."""
    if not holding or not any(req_id in holding for req_id in filed_by_vllm):
        return result
    for core_outputs in result.values():
        for output in core_outputs.outputs:
            entry = holding.pop(output.request_id, None)
            if entry is not None:
                request, held, prefill_stats = entry
                tokens = request._output_token_ids
                output.new_token_ids = tokens[len(tokens) - held - len(output.new_token_ids) :]
                if output.prefill_stats is None:
                    output.prefill_stats = prefill_stats
    for req_id in filed_by_vllm:
        entry = holding.get(req_id)
        if entry is not None and entry[0].is_finished():
            del holding[req_id]
    return result


def flush_held_outputs(scheduler, output_processor) -> None:
    """Hand the output processor every token `plain_output_fast_path` holds, as the outputs it
    would have had (so its request states, e.g. each request's token count, are vLLM's): before
    anything reads those states mid-run or aborts requests. The requests want only their final
    output, so this makes none."""
    from vllm.v1.engine import EngineCoreOutput

    holding = getattr(scheduler, "chatgen_holding", None)
    if not holding:
        return
    outputs = []
    for req_id, (request, held, prefill_stats) in holding.items():
        tokens = request._output_token_ids
        outputs.append(
            EngineCoreOutput(
                request_id=req_id,
                new_token_ids=tokens[len(tokens) - held :],
                stop_reason=request.stop_reason,
                prefill_stats=prefill_stats,
                trace_headers=request.trace_headers,
                num_nans_in_logits=request.num_nans_in_logits,
            )
        )
    holding.clear()
    made = output_processor.process_outputs(outputs, engine_core_timestamp=None)
    assert not made.request_outputs and not made.reqs_to_abort, "held outputs are never final"


def plain_decode_schedule_fast_path(scheduler) -> None:
    """vLLM 0.32's `Scheduler.schedule` spends ~8 us of Python per running request and step in
    its running loop, its `_make_cached_request_data` and its `_update_after_schedule` (async
    placeholders, pipeline cadence, prefill deferral, encoder inputs, Mamba splits, MTP
    lookahead, preemption, speculative tokens around one `allocate_slots` each). A step in which
    every running request is a plain decode (one new token, no placeholders, no speculative
    tokens, no encoder inputs, room in the model's length), nothing waits, the scheduler is not
    paused or throttled and the pool's free blocks cover every block the step allocates (so
    nothing is preempted) is scheduled here in one loop: the same `SchedulerOutput` and the same
    state (each request's blocks from vLLM's `allocate_slots` unless, as in
    `patches.decode_slots_fast_path`, it has nothing to do; the counters, the step's finished and
    preempted ids handed over and reset, the drained block lists). Any other step is vLLM's
    whole method; so is every step of a scheduler with speculative decoding, connectors,
    pipeline parallelism, the v2 model runner or a KV cache other than one full-attention group
    (where `decode_slots_fast_path` did not install)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

    manager = scheduler.kv_cache_manager
    if (
        getattr(scheduler, "chatgen_fast_schedule", False)
        or type(scheduler) is not Scheduler  # AsyncScheduler schedules placeholders
        or not getattr(manager, "chatgen_fast_slots", False)  # one full-attention group
        or scheduler.vllm_config.speculative_config is not None
        or scheduler.num_lookahead_tokens
        or scheduler.connector is not None
        or scheduler.ec_connector is not None
        or scheduler.aux_output_connector is not None
        or scheduler.defer_block_free
        or scheduler.use_pp
        or scheduler.use_v2_model_runner
        or scheduler.need_mamba_block_aligned_split
        or scheduler.num_sampled_tokens_per_step != 1
    ):
        return
    schedule = scheduler.schedule
    (group,) = manager.coordinator.single_type_managers
    blocks, cached, partial = group.req_to_blocks, group.num_cached_block, group._partial_hit_reqs
    block_size, free_blocks = group.block_size, manager.block_pool.get_num_free_blocks
    allocate = manager.allocate_slots
    max_model_len, unpaused = scheduler.max_model_len, PauseState.UNPAUSED
    encoder_cache, prev_scheduled = (
        scheduler.encoder_cache_manager,
        scheduler.prev_step_scheduled_req_ids,
    )

    def fast_schedule(throttle_prefills: bool = False):
        running, step = scheduler.running, scheduler.current_step + 1
        if (
            throttle_prefills
            or not running
            or scheduler.waiting
            or scheduler.kv_holding_waiting
            or scheduler._pause_state != unpaused
            or partial
            # the token and input budgets hold one token of every running request
            or len(running) > scheduler.max_num_scheduled_tokens
            or len(running) > scheduler.scheduler_config.max_num_batched_tokens
        ):
            return schedule(throttle_prefills)
        to_allocate, num_new_blocks = set(), 0
        for request in running:
            tokens = request.num_computed_tokens + 1  # after this step
            if (
                request.num_output_placeholders
                or step < request.next_decode_eligible_step
                or request.spec_token_ids
                or len(request._all_token_ids) != tokens  # one new token: a decode
                or tokens >= max_model_len  # vLLM keeps a slot for the token it samples
                or request.has_encoder_inputs
            ):
                return schedule(throttle_prefills)
            request_id = request.request_id
            held = len(blocks.get(request_id, ()))
            if tokens > held * block_size or tokens // block_size > cached.get(request_id, 0):
                to_allocate.add(request_id)  # a block to allocate, or a full one to cache
                num_new_blocks += max(cdiv(tokens, block_size) - held, 0)
        if num_new_blocks > free_blocks():  # vLLM would preempt
            return schedule(throttle_prefills)

        scheduler.current_step = step
        manager.new_step_starts()
        num_scheduled, new_block_ids, num_computed, num_output, all_token_ids = {}, [], [], [], {}
        structured, inflight = False, scheduler._inflight_prefills
        for request in running:
            request_id = request.request_id
            new_blocks = None
            if request_id in to_allocate:
                new_blocks = allocate(request, 1, num_lookahead_tokens=0)
                assert new_blocks is not None, "counted blocks to allocate"
                new_blocks = new_blocks.get_block_ids(allow_none=True)
            new_block_ids.append(new_blocks)
            num_scheduled[request_id] = 1
            if request_id not in prev_scheduled:
                all_token_ids[request_id] = request.all_token_ids.copy()
            num_computed.append(request.num_computed_tokens)
            num_output.append(len(request._output_token_ids))
            # _update_after_schedule
            request.num_computed_tokens += 1
            request.num_in_flight_tokens += 1
            request.is_prefill_chunk = False
            structured |= request.structured_output_request is not None
            if inflight:
                inflight.discard(request)
        if scheduler.lora_config:
            loras = {r.lora_request.lora_int_id for r in running if r.lora_request}
            assert len({i for i in loras if i > 0}) <= scheduler.lora_config.max_loras
        # the waiting loop finds nothing to admit
        scheduler.prefill_capacity_bound = False
        prev_scheduled.clear()
        prev_scheduled.update(num_scheduled)
        manager.take_boundary_state_offloads()  # drained every step; no connector takes them
        copies, cow_retained_blocks = manager.take_kv_cache_block_copies()
        if copies:
            scheduler._free_cow_retained_blocks(cow_retained_blocks, scheduler.sched_step_seq + 1)
        output = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=list(num_scheduled),
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids=all_token_ids,
                new_block_ids=new_block_ids,
                num_computed_tokens=num_computed,
                num_output_tokens=num_output,
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=len(num_scheduled),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            scheduled_encoder_input_stats=None,  # what vLLM's stats of no encoder input are
            preempted_req_ids=scheduler.reset_preempted_req_ids,
            finished_req_ids=scheduler.finished_req_ids,
            free_encoder_mm_hashes=encoder_cache.get_freed_mm_hashes(),
            new_block_ids_to_zero=scheduler._get_new_block_ids_to_zero(),
            has_sync_kv_loads=False,
            kv_cache_block_copies=copies or None,
            kv_connector_block_state=None,
            num_spec_tokens_to_schedule=scheduler.num_spec_tokens,
            ec_manager_metadata=encoder_cache.get_manager_metadata(),
            has_structured_output_requests=structured,
        )
        scheduler.finished_req_ids = set()
        scheduler.reset_preempted_req_ids = set()
        return output

    scheduler.schedule = fast_schedule
    scheduler.chatgen_fast_schedule = True


def _closure_value(function, name: str):
    """The value of the variable `name` that `function` closes over."""
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents
