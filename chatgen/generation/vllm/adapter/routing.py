"""MoE routing capture: `record_routed_experts(llm)` makes the split step record the experts vLLM
routes every token to, handed out on each finished sample as `CompletionOutput.routed_experts`
(moe_routing_replay).
"""

from vllm import LLM

from chatgen.generation.vllm.adapter.engine import in_process_workers


class _RoutingRecorder:
    """The experts each token of each request was routed to, as vLLM's MoE routers chose them.

    Every MoE layer's router calls `capture(layer, topk_ids)` during the forward (vLLM's
    `BaseRouter` capture hook; ids (tokens, k) in the model runner's token order); `end_step`
    files the step's rows per request and position (a request's tokens are its run of
    `num_scheduled_tokens` in the runner's batch order, at positions from its
    `num_computed_tokens`); `hand_out` puts each finished sample's array on its
    `CompletionOutput.routed_experts` (vLLM's own field): (positions, num_layers, k) int16,
    position t = the token the model read at t, -1 where none was routed here (a prompt prefix
    served from the prefix cache). A recomputed position (preemption) keeps its last routing."""

    def __init__(self, runner, num_layers: int, topk: int):
        self.runner, self.num_layers, self.topk = runner, num_layers, topk
        self.step = {}  # layer -> (tokens, k) ids of the running step
        self.routed = {}  # engine request id -> np.ndarray (positions, layers, k)
        self.sample = {}  # engine request id -> (request id, sample index)

    def capture(self, layer: int, topk_ids) -> None:
        self.step[layer] = topk_ids.detach().to("cpu", copy=True)

    def end_step(self, scheduler_output, output_processor) -> None:
        import numpy as np

        if not self.step:
            return
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        # (tokens, L, k)
        ids = np.stack([self.step[layer].numpy() for layer in range(self.num_layers)], axis=1)
        row = 0
        for rid in self.runner.input_batch.req_ids[: self.runner.input_batch.num_reqs]:
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            start, end = starts[rid], starts[rid] + n
            have = self.routed.get(rid)
            if have is None or len(have) < end:
                grown = np.full(
                    (
                        max(end, 2 * len(have) if have is not None else 0),
                        self.num_layers,
                        self.topk,
                    ),
                    -1,
                    dtype=np.int16,
                )
                if have is not None:
                    grown[: len(have)] = have
                self.routed[rid] = have = grown
            have[start:end] = ids[row : row + n]
            row += n
            if rid not in self.sample:
                state = output_processor.request_states.get(rid)
                if state is not None:
                    self.sample[rid] = (state.external_req_id, state.request_index)
        self.step = {}

    def hand_out(self, request_outputs) -> None:
        finished = {key: rid for rid, key in self.sample.items()}
        for output in request_outputs:
            if not output.finished:
                continue
            for completion in output.outputs:
                rid = finished.get((output.request_id, completion.index))
                if rid is None:
                    continue
                routed = self.routed.pop(rid, None)
                del self.sample[rid]
                # every position the model read: the prompt and all but the last generated token
                length = len(output.prompt_token_ids or ()) + len(completion.token_ids) - 1
                if routed is not None:
                    completion.routed_experts = routed[:length]

    def forget(self, engine_request_ids) -> None:
        for rid in engine_request_ids:
            self.routed.pop(rid, None)
            self.sample.pop(rid, None)


def record_routed_experts(llm: LLM) -> None:
    """From now on `execute` records the experts vLLM routes every token to (see `_RoutingRecorder`); finished
    samples carry them as `CompletionOutput.routed_experts`. Needs the workers in this process (one engine rank,
    or external_launcher) and an MoE model; turn prefix caching off so that every prompt token is routed per
    request."""
    if not in_process_workers(llm):
        raise ValueError(
            "recording routed experts needs the engine's workers in this process: tensor_parallel_size 1 "
            "(or the external_launcher executor); turn return_routed_experts off for this engine"
        )
    config = llm.llm_engine.model_config
    if config.get_num_experts() <= 0:
        raise ValueError(
            f"return_routed_experts: {config.model} is not a mixture-of-experts model; set it to false"
        )
    llm.chatgen_routing = None

    def install(worker):
        from functools import partial

        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        recorder = _RoutingRecorder(
            worker.model_runner,
            config.get_total_num_hidden_layers(),
            config.get_num_experts_per_tok(),
        )
        layers = [
            m
            for m in worker.model_runner.get_model().modules()
            if isinstance(getattr(m, "router", None), BaseRouter) and hasattr(m, "layer_id")
        ]
        if sorted(m.layer_id for m in layers) != list(range(recorder.num_layers)):
            raise RuntimeError(
                f"chatgen's vLLM adapter found MoE routers for layers {[m.layer_id for m in layers]}; "
                f"it records routing for an MoE MLP in each of the {recorder.num_layers} layers"
            )
        for m in layers:
            m.router.set_capture_fn(partial(recorder.capture, m.layer_id))
        return recorder

    llm.chatgen_routing = llm.collective_rpc(install)[0]
