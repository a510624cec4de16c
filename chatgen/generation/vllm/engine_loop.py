"""`EngineLoop`: the one thread that steps a vLLM engine; every generation call and weight update
goes through it.

    loop = EngineLoop.of(llm)                      # one loop per engine, started on first use
    outputs, stats = loop.run(module, add)         # submit and wait (VLLMModule.run_generation / generate)
    async for output in loop.stream(module, add):  # each RequestOutput as the engine emits it (generate_async, server)
    loop.update_weights(buckets, mode="keep")      # between two engine steps (VLLMModule.load_weights)

Commands (start a call, abort one, update weights, any function) arrive through a thread-safe queue
and run on the engine thread between engine steps, so requests join while others run (continuous
batching) and nothing else ever touches the engine concurrently. Each step is ChatLearn's:
`schedule` -> the `forward_step` hook of the oldest running call's module (which calls
`execute_step` once) -> finished outputs routed to their calls.

With several processes per engine (external_launcher, WORLD_SIZE > 1) every rank must step its
engine in lockstep with the others, and a thread would let requests join at different steps on
different ranks. There the loop has no thread (`threaded=False`): the caller runs the same loop body
until its own call is done.

Weights: the loop counts versions (0 = the weights the engine started with, +1 per update). Every
finished sample carries `weight_versions` (list[int], the version each generated token was sampled
under; set on vLLM's `CompletionOutput`); so does every delta of a streamed request, for its new
tokens. Requests added after an update carry a new cache salt, so they never hit prefix-cache blocks
computed with older weights, whatever still holds those blocks. A call made inside
chatgen.generation.handover.hold_after(s, v) waits for the next update after s steps while the
weights are version v and only such calls run (`_held`); without a thread the loop never holds.

Watchdog: `health_problem()` names what keeps the loop from serving (its thread died, or one engine
step or command has run for over `stall_s` seconds without progress), which the server's /health
answers with 503; an error of the loop itself fails the running calls and the loop keeps serving;
`shutdown` waits at most `timeout` seconds for the thread: a stuck engine never blocks an exit.
"""

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import weakref

from chatgen.generation import handover
from chatgen.generation.base import UPDATE_MODES
from chatgen.generation.vllm import adapter
from chatgen.generation.vllm.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)
_loops = weakref.WeakKeyDictionary()  # vllm.LLM -> EngineLoop
_loops_lock = threading.Lock()
STALL_S = 120.0  # `EngineLoop.stall_s`: a step or command without progress this long is stuck
SHUTDOWN_WAIT_S = 10.0  # how long `shutdown` waits for the thread before leaving it behind


class _Call:
    """One submitted generation call: its module (hooks), its request ids and where its outputs
    go."""

    def __init__(self, owner, add, notify, is_eval=False, batched=False):
        self.owner, self.add, self.notify, self.is_eval = owner, add, notify, is_eval
        # batched: a step's outputs arrive as one list (one wake-up of the waiting thread per step
        # rather than per request: `run`); else one event per output (`stream`)
        self.batched = batched
        self.request_ids, self.unfinished = [], set()
        self.steps, self.kv_peak, self.done, self.error = 0, 0.0, False, None
        self.hold = handover.requested()  # (steps, weight version) or None: WeightUpdates._held


class EngineLoop(WeightUpdates):
    """Steps one vLLM engine; see the module docstring. Use `EngineLoop.of(llm)`, not the
    constructor."""

    def __init__(self, llm, threaded: bool = True):
        self.llm = llm
        self.weight_version = 0
        self.lora_request = (
            None  # the LoRA adapter new requests sample with (lora_adapter.py); None = the base
        )
        self.lora_held = None  # (config, tensors) of that adapter when given in memory
        self.steps_run = 0  # engine steps since the loop started
        self.paused = False  # no engine step while set (`pause`); commands, weight updates included, still run
        self.broken = (
            None  # why generation is refused (a weight write failed midway), until a full update
        )
        self._inbox = queue.SimpleQueue()
        self._calls = {}  # request id -> _Call, for unfinished requests
        self._active = []  # calls with unfinished requests, oldest first
        self._request_ids = itertools.count()
        self._start_version = {}  # request id -> weight version when it was added
        self._marks = {}  # (request id, sample index) -> [(tokens generated before the update, new version)]
        self._streamed = set()  # ids of unfinished requests that emit a delta every step
        self._stopped = False
        self._starting = (
            None  # the call whose requests are being added (`_start`), on the engine thread
        )
        self.stall_s = STALL_S
        self._busy_since = None  # monotonic time of the last progress of a running step or command
        self.failure = None  # the last error of the loop itself (a chatgen bug)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(
                target=self._serve, name="chatgen-engine-loop", daemon=True
            )
            self._thread.start()

    @classmethod
    def of(cls, llm, threaded: bool = True) -> "EngineLoop":
        """The loop of `llm`, started on first use (one per engine, whichever module asks)."""
        with _loops_lock:
            loop = _loops.get(llm)
            if loop is None or loop._stopped:
                loop = _loops[llm] = cls(llm, threaded)
            return loop

    # ------------------------------------------------------------------ public API (any thread)

    def add_request(
        self, prompt_ids, params, prompt_text=None, stream: bool = False, lora_request=None
    ) -> str:
        """Add one request to the engine for the call being started (from inside its `add()`, on
        the engine thread); returns its id: decimal, increasing (outputs sort by
        int(request_id)). stream: a DELTA output every step instead of one when it finishes."""
        if self._starting is None:
            raise RuntimeError(
                "add_request: requests are added from inside a call's add() (run / stream), on the "
                "engine thread"
            )
        request_id = str(next(self._request_ids))
        kind = adapter.RequestOutputKind.DELTA if stream else adapter.RequestOutputKind.FINAL_ONLY
        adapter.add_request(
            self.llm,
            request_id,
            prompt_ids,
            params,
            prompt_text,
            cache_salt=self.cache_salt,
            output_kind=kind,
            lora_request=lora_request or self.lora_request,  # a served adapter, else the synced one
        )
        if stream:
            self._streamed.add(request_id)
        self._starting.request_ids.append(request_id)
        return request_id

    @property
    def cache_salt(self):
        """The prefix-cache salt of requests added now: None under the starting weights, else per
        version."""
        return None if self.weight_version == 0 else f"chatgen-weights-{self.weight_version}"

    def call(self, fn):
        """Run `fn()` on the engine thread between two steps; return its result or raise its
        exception."""
        if self._thread is None:  # no thread: commands queued before this one run first, here
            self._run_commands()
            return fn()
        if threading.current_thread() is self._thread:
            return fn()
        future = concurrent.futures.Future()

        def command():
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._post(command)
        return self._result(future)

    def _result(self, future):
        """`future.result()`, or an error naming why once the loop thread is gone for good."""
        while True:
            try:
                return future.result(timeout=5.0)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    raise RuntimeError(self.health_problem()) from None

    def health_problem(self) -> str | None:
        """Why the loop cannot serve now (its thread died, or it is stuck in one engine step or
        command), or None. Any thread may ask; the server's /health answers 503 with it."""
        if self._thread is not None and not self._thread.is_alive() and not self._stopped:
            return (
                f"the engine loop thread has died ({self.failure or 'no error recorded'}); "
                "restart the server"
            )
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.stall_s:
            return (
                f"the engine loop has made no progress for {time.monotonic() - since:.0f} s "
                f"(one engine step or command, over the {self.stall_s:.0f} s a healthy one "
                "takes); the engine may be hung"
            )
        return None

    def run(self, owner, add, is_eval=False, on_finished=None) -> tuple:
        """Submit a call and wait for it: `add()` queues requests through `add_request` (on the
        engine thread); steps run `owner.forward_step` (`owner.eval_forward` for an eval call)
        while it is the oldest call; `on_finished(output)`, if given, sees each request as it
        finishes (on this thread). Returns (finished RequestOutputs sorted by request id,
        {"engine_steps", "kv_cache_usage_peak"})."""
        events = queue.SimpleQueue()
        call = _Call(owner, add, events.put, is_eval, batched=True)
        self._post(lambda: self._start(call))
        finished = []
        try:
            while True:
                event = self._next_event(events, call)
                if event is None:
                    break
                if isinstance(event, BaseException):
                    raise event
                for output in event if isinstance(event, list) else (event,):
                    if output.finished:
                        finished.append(output)
                        if on_finished is not None:
                            on_finished(output)
        except BaseException:  # leave the engine empty of this call's requests
            if not call.done:
                self._post(lambda: self._abort(call))
            raise
        finished.sort(key=lambda o: int(o.request_id))
        return finished, {"engine_steps": call.steps, "kv_cache_usage_peak": call.kv_peak}

    async def stream(self, owner, add):
        """Submit a call; yield each RequestOutput the engine emits for it (finished ones; every
        step's delta for requests added with a DELTA output kind). Leaving the iterator early
        aborts the call's requests and frees their KV blocks."""
        events = queue.SimpleQueue()
        aio = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify(event):
            events.put(event)
            try:
                aio.call_soon_threadsafe(wake.set)
            except (
                RuntimeError
            ):  # the consumer's event loop is closed: nobody reads this call any more
                self._inbox.put(lambda: self._abort(call))

        call = _Call(owner, add, notify)
        self._post(lambda: self._start(call))
        try:
            while True:
                # no thread: the caller steps the engine (blocking the event loop)
                if self._thread is None:
                    event = self._next_event(events, call)
                else:
                    while events.empty():
                        await wake.wait()
                        wake.clear()
                    event = events.get()
                if event is None:
                    return
                if isinstance(event, BaseException):
                    raise event
                yield event
        finally:
            if not call.done:
                self._post(lambda: self._abort(call))
                if self._thread is None:
                    self._run_commands()

    def update_weights(self, buckets, mode: str = "wait") -> int:
        """Write `buckets` (lists of (HF name, tensor)) into the engine between two steps, in
        `mode` (see GenerationModule.load_weights); returns the new weight version."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"update_weights: mode={mode!r}; use one of {', '.join(UPDATE_MODES)}")
        return self.call(lambda: self._update(buckets, mode))

    def pause(self) -> None:
        """Stop stepping the engine: running requests keep their state and wait, new ones are
        admitted and wait too. Commands still run, so weights can be updated while paused (an
        update in mode "wait" would run the waiting requests to their end first: use "keep",
        "recompute" or "abort"). `resume` undoes it."""
        self.call(lambda: setattr(self, "paused", True))

    def resume(self) -> None:
        """Step the engine again after `pause`."""
        self.call(lambda: setattr(self, "paused", False))

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> bool:
        """Stop the thread (requests still running are failed); the engine itself is left to its
        owner. Returns False when the thread did not stop within `timeout` seconds (stuck in an
        engine step or command): the loop is then given up as it is, and its engine must not be
        touched again."""
        if self._stopped:
            return True
        error = RuntimeError("the engine loop was shut down while this request was running")

        def stop():
            self._fail_all(error)
            self._stopped = True

        stopped = True
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            stop()
        else:
            future = concurrent.futures.Future()
            self._post(lambda: future.set_result(stop()))
            try:
                future.result(timeout=timeout)
                self._thread.join(timeout=timeout)
            except concurrent.futures.TimeoutError:
                logger.warning(
                    "the engine loop did not stop within %.0f s (%s); leaving it behind",
                    timeout,
                    self.health_problem() or "busy",
                )
                stopped, self._stopped = False, True
                for call in list(self._active):  # nobody else will answer them
                    call.notify(error)
                    call.notify(None)
        with _loops_lock:  # the registry must not keep the engine alive
            if _loops.get(self.llm) is self:
                del _loops[self.llm]
        return stopped

    # ------------------------------------------------------------------ the engine thread

    def _post(self, command) -> None:
        if self._stopped:
            raise RuntimeError("the engine loop is shut down; start the module again")
        self._inbox.put(command)

    def _serve(self) -> None:
        while not self._stopped:
            try:
                self._run_commands(block=not self._active or self.paused or self._held())
                if self._active and not self._stopped and not self.paused and not self._held():
                    self._step()
            except BaseException as e:  # a bug of the loop itself: fail what runs, keep serving
                self.failure = f"{type(e).__name__}: {e}"
                logger.exception("engine loop failed; failing the running requests")
                try:
                    self._fail_all(RuntimeError(f"the engine loop failed ({self.failure})"))
                except BaseException:
                    logger.exception("engine loop: failing the running requests failed too")
                    for call in list(self._active):  # end them without the engine
                        call.notify(RuntimeError(f"the engine loop failed ({self.failure})"))
                        call.notify(None)
                        call.done = True
                    self._active.clear()
            finally:
                self._busy_since = None

    def _run_commands(self, block: bool = False) -> None:
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._busy_since = time.monotonic()
            try:
                command()
            except (
                Exception
            ):  # a command's own errors go to its caller; this is a bug, keep serving
                logger.exception("engine loop command failed")
            self._busy_since = None
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _next_event(self, events, call):
        """The call's next event; without a thread, step the engine here until one comes."""
        if self._thread is not None:
            while True:
                try:
                    return events.get(timeout=5.0)
                except queue.Empty:
                    if not self._thread.is_alive():
                        return RuntimeError(self.health_problem())
        while events.empty():
            self._run_commands()
            if events.empty() and self._active:
                self._step()
        return events.get()

    def _start(self, call) -> None:
        """Queue a call's requests (its module's `_add_request` hooks run here); fail it if that
        raises."""
        if self.broken:
            call.notify(RuntimeError(self.broken))
            call.done = True
            call.notify(None)
            return
        self._starting = call
        try:
            call.add()
        except BaseException as e:
            adapter.abort(self.llm, call.request_ids)
            self._streamed.difference_update(call.request_ids)
            call.done = True
            call.notify(e)
            return
        finally:
            self._starting = None
        for request_id in call.request_ids:
            self._calls[request_id] = call
            self._start_version[request_id] = self.weight_version
        call.unfinished = set(call.request_ids)
        if call.unfinished:
            self._active.append(call)
        else:
            call.done = True
            call.notify(None)

    def _step(self) -> None:
        """One engine step: schedule, the oldest call's forward_step hook, route what finished."""
        lead = self._active[0]
        self._busy_since = time.monotonic()  # progress (also a `wait` update's steps)
        try:
            scheduled = adapter.schedule(self.llm)
            usage = adapter.kv_cache_usage(self.llm)
            owner = lead.owner
            hook = owner.eval_forward if lead.is_eval else owner.forward_step
            # ChatLearn's iteration: steps over the module's life
            outputs = hook(scheduled, owner.iteration)
            owner.iteration += 1
        except BaseException as e:  # a hook or the engine failed: every running call gets the error
            self._fail_all(e)
            return
        if not outputs and not adapter.has_unfinished_requests(self.llm):  # else: empty steps
            self._fail_all(
                RuntimeError(
                    "the engine no longer holds this request (a chatgen bug: "
                    "the engine loop lost track of it); send it again"
                )
            )
            return
        self.steps_run += 1
        for call in self._active:
            call.steps += 1
            call.kv_peak = max(call.kv_peak, usage)
        routed = {}  # call -> its outputs of this step, in order
        for output in outputs:
            call = self._calls.get(output.request_id)
            if call is None:  # a request someone added to the engine directly: not ours to route
                continue
            if output.finished or output.request_id in self._streamed:
                self._stamp_versions(output)
            if output.finished:
                del self._calls[output.request_id]
                call.unfinished.discard(output.request_id)
            if call.batched:
                routed.setdefault(call, []).append(output)
            else:
                call.notify(output)
                if not call.unfinished:
                    self._finish(call)
        for call, delivered in routed.items():
            call.notify(delivered)
            if not call.unfinished:
                self._finish(call)

    def _finish(self, call) -> None:
        call.done = True
        self._active.remove(call)
        call.notify(None)

    def _abort(self, call, error=None) -> None:
        """Drop a call's unfinished requests from the engine (KV blocks freed) and end it."""
        if call.done:
            return
        try:
            adapter.abort(self.llm, sorted(call.unfinished))
        finally:  # whatever the engine says, the call ends
            self._forget(call)
            if error is not None:
                call.notify(error)
            self._finish(call)

    def _forget(self, call) -> None:
        for request_id in call.unfinished:
            self._calls.pop(request_id, None)
            self._start_version.pop(request_id, None)
            self._streamed.discard(request_id)
        self._marks = {k: v for k, v in self._marks.items() if k[0] not in call.unfinished}
        call.unfinished = set()

    def _fail_all(self, error) -> None:
        for call in list(self._active):
            self._abort(call, error)
