"""The weight side of chatgen.generation.vllm.engine_loop.EngineLoop (a mixin of it, run on the
engine thread): a weight update between two engine steps in each mode, and the weight version each
generated token was sampled under (`weight_versions`), kept on the loop's books (`_calls`,
`_streamed`, `_start_version`, `_marks`); and the hold of calls that wait for the next update
(chatgen.generation.handover).
"""

import time

from chatgen.generation.vllm import adapter


class WeightUpdates:
    """EngineLoop's weight updates and version stamps; they use the loop's state and steps."""

    def _stamp_versions(self, output) -> None:
        """Set `weight_versions` (one per token it holds) on each sample of a finished
        RequestOutput, or of any delta of a streamed request."""
        # a delta's tokens were all sampled in the step just run
        if output.request_id in self._streamed:
            for sample in output.outputs:
                sample.weight_versions = [self.weight_version] * len(sample.token_ids)
            if output.finished:
                self._streamed.discard(output.request_id)
                self._start_version.pop(output.request_id, None)
            return
        start = self._start_version.pop(output.request_id, self.weight_version)
        for sample in output.outputs:
            versions = [start] * len(sample.token_ids)
            for count, version in self._marks.pop((output.request_id, sample.index), ()):
                versions[count:] = [version] * (len(versions) - count)
            sample.weight_versions = versions

    def _held(self) -> bool:
        """Whether the engine waits for the next weight update instead of stepping: every running
        call asked for it (chatgen.generation.handover) at the current version and has run its
        steps."""
        return bool(self._active) and all(
            call.hold is not None
            and call.hold[1] == self.weight_version
            and call.steps >= call.hold[0]
            for call in self._active
        )

    def _abort_returning_outputs(self) -> None:
        """End every running request now, each call getting what its requests generated so far.
        vLLM gives one output per request, or for a streamed request of n samples one per sample,
        all with the request's id (only the last one `finished`): each is routed to its call, and
        a request leaves the books once all of its outputs are out."""
        by_request = {}
        for output in adapter.abort_with_outputs(self.llm, list(self._calls)):
            by_request.setdefault(output.request_id, []).append(output)
        for request_id, outputs in by_request.items():
            call = self._calls.get(request_id)
            if call is None:
                continue
            outputs[-1].finished = True  # the request is over, whatever vLLM's parent request says
            for output in outputs:
                self._stamp_versions(output)
                call.notify(output)
            del self._calls[request_id]
            call.unfinished.discard(request_id)
            if not call.unfinished:
                self._finish(call)

    def _update(self, buckets, mode: str) -> int:
        """Apply a weight update on the engine thread (see GenerationModule.load_weights for the
        modes)."""
        if mode == "wait" and self.paused:
            raise RuntimeError(
                'update_weights: the engine is paused, and mode "wait" would run its waiting requests '
                'to their end first; use mode "keep", "recompute" or "abort", or resume first'
            )
        start = time.perf_counter()
        if mode == "wait":  # nothing new is admitted meanwhile: later commands wait in the inbox
            while self._active:
                self._step()
        elif mode == "abort":
            try:
                self._abort_returning_outputs()
            finally:  # none should remain; even if routing failed, never leave a call hanging
                self._fail_all(RuntimeError("aborted by a weight update"))
        counts = adapter.output_token_counts(self.llm)
        written, reloading = [0], [False]

        def counted(items):
            for item in items:
                written[0] += 1
                self._busy_since = time.monotonic()  # progress: a long load is not a stuck loop
                yield item

        def reload(items):
            reloading[0] = True  # vLLM's reload releases the old weights as it begins
            adapter.load_weights(self.llm, items, reset_prefix_cache=False)

        try:
            # one reload streams every bucket, no second copy
            if adapter.in_process_workers(self.llm):
                reload(counted(item for bucket in buckets for item in bucket))
            else:  # worker processes get pickled lists: one reload per bucket (each holds whole layers)
                for bucket in buckets:
                    reload(list(counted(bucket)))
        except BaseException as e:
            # failed before vLLM touched a weight: the engine keeps its old ones
            if not reloading[0]:
                raise
            self.broken = (
                f"a weight update failed after writing {written[0]} tensors ({type(e).__name__}: "
                f"{e}); the engine holds a mix of old and new weights and needs a re-sync: it "
                "refuses to generate until all weights are written again (load_weights / "
                "chatgen.param_sync.sync_weights with the full set)"
            )
            self._fail_all(RuntimeError(self.broken))
            raise
        self.broken = None
        if self.lora_request is not None and self.lora_held is not None:
            # vLLM's reload drops the adapters it holds in memory (later requests naming it would
            # fail): the held one goes back, on top of the new weights
            self.lora_request = adapter.replace_lora(self.llm, 1, *self.lora_held)
        self.weight_version += 1
        for key, count in counts.items():
            if key[0] in self._calls and key[0] not in self._streamed:
                self._marks.setdefault(key, []).append((count, self.weight_version))
        # No request may reuse KV computed with the old weights: recompute preempts the running
        # requests (they re-prefill prompt + generated tokens); otherwise the cache is cleared where
        # nothing holds blocks, and new requests carry a new cache salt either way.
        adapter.reset_prefix_cache(self.llm, preempt_running=mode == "recompute")
        self.last_update_s = time.perf_counter() - start
        return self.weight_version
