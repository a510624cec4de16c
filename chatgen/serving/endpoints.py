"""The OpenAI server's endpoints that generate: /v1/chat/completions and /v1/completions, streamed
or not. Each request is one `module.stream` call (the generation contract), answered in vLLM's
protocol models with chatgen's fields; chatgen.serving.app routes to them, chatgen.serving.responses
shapes the answers.
"""

import contextlib
import json
import time
import uuid

from fastapi.responses import StreamingResponse

from chatgen.serving.http import APIError, error_body
from chatgen.serving.requests import Job
from chatgen.serving.responses import (
    ResponseBuilder,
    chain,
    generated_fields,
    json_response,
    sampled_logprobs,
    sse_event,
)
from chatgen.serving.tool_calls import named_function


class OpenAIServer(ResponseBuilder):
    """The generating endpoints' answers: one `module.stream` call each, streamed or not; their
    shapes are ResponseBuilder's, reading the requests is RequestReader's."""

    # ------------------------------------------------------------------ generation (on the event
    # loop)

    async def run(self, job: Job, stream: bool):
        """One `module.stream` call for the job's prompts: yields (prompt index, RequestOutput)
        (deltas when streaming). Leaving the iterator early aborts the requests."""
        module = self.module
        if module.is_sleeping():
            raise APIError(503, "the engine is asleep (between RLHF episodes); retry after wake_up")
        if module.needs_resync:
            raise APIError(503, module.needs_resync)
        if module.health_problem:
            raise APIError(503, module.health_problem)
        params = job.params[0] if len(job.params) == 1 else job.params
        # closed: aborts
        async with contextlib.aclosing(
            # a served LoRA adapter (chatgen serve --lora-modules) by name
            module.stream(job.prompts, params, deltas=stream, **adapter_of(job))
        ) as outputs:
            async for i, output in outputs:
                yield i, output

    async def streamed(self, job: Job, events):
        """A server-sent-event response of `events(first, outputs)`, after the job's first output
        (an error before it is still an HTTP error); an error after it ends the stream with an
        error event, as vLLM's does."""
        outputs = self.run(job, stream=True)
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            first = None

        async def body():
            async with contextlib.aclosing(outputs):  # a client that goes away aborts its requests
                try:
                    async for event in events(first, outputs):
                        yield event
                except APIError as e:
                    yield f"data: {json.dumps(error_body(e.status, e.message, e.param))}\n\n"
                except (
                    Exception
                ) as e:  # the engine failed mid-stream (a failed weight update, a shutdown)
                    yield f"data: {json.dumps(error_body(500, f'{type(e).__name__}: {e}'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def chat(self, job: Job):
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
            ChatMessage,
            DeltaMessage,
        )
        from vllm.entrypoints.serve.utils.api_utils import should_include_usage

        req, prompt, n = job.req, job.prompts[0], job.params[0].n
        last = req.messages[-1] if req.messages else {}
        echo = (last.get("content") or "") if req.echo and last.get("role") == "assistant" else ""
        if not isinstance(echo, str):
            echo = "\n".join(part["text"] for part in echo)

        def logprobs_of(sample):
            return self.chat_logprobs(sample, req.top_logprobs or 0) if req.logprobs else None

        tools = self.tool_calls if self.tool_calls and self.tool_calls.applies(req) else None

        def finish_reason(sample, called: bool):  # OpenAI's: "stop" after a named function's call
            reason = sample.finish_reason or "stop"
            return (
                "tool_calls" if called and reason == "stop" and not named_function(req) else reason
            )

        if req.stream:
            created, response_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
            include_usage, continuous = should_include_usage(req.stream_options, False)

            def chunk(choices, **fields):
                return ChatCompletionStreamResponse(
                    id=response_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=job.adapter or self.name,
                    choices=choices,
                    **fields,
                )

            async def events(first, outputs):
                generated, cached = [0] * n, None
                streamers = [tools.streamer(req) for _ in range(n)] if tools else None
                usage = (
                    (lambda i: self.usage(len(prompt), generated[i]))
                    if continuous
                    else (lambda i: None)
                )
                if first is not None:
                    cached = getattr(first[1], "num_cached_tokens", None)
                for i in range(n):
                    yield sse_event(
                        chunk(
                            [
                                ChatCompletionResponseStreamChoice(
                                    index=i,
                                    delta=DeltaMessage(role="assistant", content=""),
                                    logprobs=None,
                                    finish_reason=None,
                                )
                            ],
                            prompt_token_ids=prompt,
                            **({"usage": usage(i)} if continuous else {}),
                        )
                    )
                    if echo:
                        yield sse_event(
                            chunk(
                                [
                                    ChatCompletionResponseStreamChoice(
                                        index=i,
                                        delta=DeltaMessage(content=echo),
                                        logprobs=None,
                                        finish_reason=None,
                                    )
                                ],
                                **({"usage": usage(i)} if continuous else {}),
                            )
                        )
                async for _, output in chain(first, outputs):
                    for sample in output.outputs:
                        if (
                            not sample.text
                            and not sample.token_ids
                            and not generated[sample.index]
                            and not sample.finish_reason
                        ):
                            continue  # a chunked prefill step: nothing to say yet
                        generated[sample.index] += len(sample.token_ids)
                        delta, called = DeltaMessage(content=sample.text), False
                        if streamers:  # the parser may hold text back (a partial marker): None
                            streamer = streamers[sample.index]
                            delta = streamer.delta(
                                sample.text, sample.token_ids, bool(sample.finish_reason)
                            )
                            delta, called = delta or DeltaMessage(), streamer.called
                        yield sse_event(
                            chunk(
                                [
                                    ChatCompletionResponseStreamChoice(
                                        index=sample.index,
                                        delta=delta,
                                        logprobs=logprobs_of(sample),
                                        finish_reason=sample.finish_reason
                                        and finish_reason(sample, called),
                                        **(
                                            {"stop_reason": sample.stop_reason}
                                            if sample.finish_reason
                                            else {}
                                        ),
                                        **generated_fields(sample),
                                    )
                                ],
                                **({"usage": usage(sample.index)} if continuous else {}),
                            )
                        )
                if include_usage:
                    yield sse_event(
                        chunk([], usage=self.usage(len(prompt), sum(generated), cached)),
                        exclude_unset=True,
                        exclude_none=True,
                    )

            return await self.streamed(job, events)

        ((_, output),) = [o async for o in self.run(job, stream=False)]
        samples = sorted(output.outputs, key=lambda s: s.index)
        parsed = [tools.parse(s.text, req) if tools else (s.text, []) for s in samples]
        choices = [
            ChatCompletionResponseChoice(
                index=s.index,
                finish_reason=finish_reason(s, bool(calls)),
                stop_reason=s.stop_reason,
                logprobs=logprobs_of(s),
                message=ChatMessage(
                    role="assistant",
                    content=echo + content if content is not None or echo else None,
                    tool_calls=calls,
                    prompt_token_ids=prompt,
                    generation_token_ids=list(s.token_ids),
                    generation_log_probs=sampled_logprobs(s),
                    generation_weight_versions=s.weight_versions,
                ),
            )
            for s, (content, calls) in zip(samples, parsed)
        ]
        generated = sum(len(s.token_ids) for s in output.outputs)
        return json_response(
            ChatCompletionResponse(
                id=f"chatcmpl-{uuid.uuid4().hex}",
                model=job.adapter or self.name,
                choices=choices,
                prompt_token_ids=prompt,
                prompt_logprobs=self.prompt_logprobs(output),
                usage=self.usage(
                    len(prompt), generated, getattr(output, "num_cached_tokens", None)
                ),
            )
        )

    async def completions(self, job: Job):
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionResponse,
            CompletionResponseChoice,
            CompletionResponseStreamChoice,
            CompletionStreamResponse,
        )
        from vllm.entrypoints.serve.utils.api_utils import should_include_usage

        req, n = job.req, job.params[0].n
        # the prompt alone (vLLM samples one token, returns none)
        echo_only = req.echo and req.max_tokens == 0

        def logprobs_of(token_ids, steps, text_offset=0):
            if req.logprobs is None:
                return None
            return self.completion_logprobs(token_ids, steps, req.logprobs, text_offset)

        if req.stream:
            created, response_id = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
            include_usage, continuous = should_include_usage(req.stream_options, False)

            async def events(first, outputs):
                choices = n * len(job.prompts)
                generated, echoed, offsets = [0] * choices, [False] * choices, [0] * choices
                cached = None if first is None else getattr(first[1], "num_cached_tokens", None)
                prompt_logprobs = {}
                async for i, output in chain(first, outputs):
                    if output.prompt_logprobs is not None:  # on a prompt's first output only
                        prompt_logprobs[i] = output.prompt_logprobs
                    prompt = job.prompts[i]
                    for sample in output.outputs:
                        k = i * n + sample.index
                        fields = generated_fields(sample)
                        if req.echo and not echoed[k]:
                            echoed[k], fields["prompt_token_ids"] = True, prompt
                            steps = prompt_logprobs.get(i) or [None] * len(prompt)
                            if echo_only:
                                text, token_ids, logprob_steps = job.texts[i], prompt, steps
                            else:
                                text, token_ids = (
                                    job.texts[i] + sample.text,
                                    [*prompt, *sample.token_ids],
                                )
                                logprob_steps = [*steps, *(sample.logprobs or [])]
                        else:
                            if echo_only:
                                continue
                            text, token_ids, logprob_steps = (
                                sample.text,
                                sample.token_ids,
                                sample.logprobs,
                            )
                            if (
                                not text
                                and not token_ids
                                and not generated[k]
                                and not sample.finish_reason
                            ):
                                continue  # a chunked prefill step: nothing to say yet
                        generated[k] += len(sample.token_ids)
                        logprobs = logprobs_of(token_ids, logprob_steps or [], offsets[k])
                        # by the tokens, not the text (stop strings)
                        if logprobs is not None and logprobs.tokens:
                            offsets[k] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                        yield sse_event(
                            CompletionStreamResponse(
                                id=response_id,
                                object="text_completion",
                                created=created,
                                model=job.adapter or self.name,
                                choices=[
                                    CompletionResponseStreamChoice(
                                        index=k,
                                        text=text,
                                        logprobs=logprobs,
                                        finish_reason=sample.finish_reason,
                                        stop_reason=sample.stop_reason,
                                        **fields,
                                    )
                                ],
                                **(
                                    {"usage": self.usage(len(prompt), generated[k])}
                                    if continuous
                                    else {}
                                ),
                            )
                        )
                if include_usage:
                    prompt_tokens = sum(map(len, job.prompts))
                    yield sse_event(
                        CompletionStreamResponse(
                            id=response_id,
                            created=created,
                            model=job.adapter or self.name,
                            choices=[],
                            usage=self.usage(prompt_tokens, sum(generated), cached),
                        ),
                        exclude_unset=False,
                        exclude_none=True,
                    )

            return await self.streamed(job, events)

        outputs = sorted([o async for o in self.run(job, stream=False)], key=lambda o: o[0])
        choices = []
        for i, output in outputs:
            prompt, prompt_logprobs = job.prompts[i], self.prompt_logprobs(output)
            for s in sorted(output.outputs, key=lambda s: s.index):
                if not req.echo:
                    text, token_ids, steps = s.text, s.token_ids, s.logprobs
                elif echo_only:
                    text, token_ids, steps = job.texts[i], prompt, prompt_logprobs
                else:
                    text, token_ids = job.texts[i] + s.text, [*prompt, *s.token_ids]
                    steps = (
                        [*(prompt_logprobs or []), *s.logprobs]
                        if req.logprobs is not None
                        else None
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=len(choices),
                        text=text,
                        logprobs=logprobs_of(token_ids, steps),
                        finish_reason=s.finish_reason,
                        stop_reason=s.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                        prompt_token_ids=prompt,
                        **generated_fields(s),
                    )
                )
        prompt_tokens = sum(len(job.prompts[i]) for i, _ in outputs)
        generated = sum(len(s.token_ids) for _, o in outputs for s in o.outputs)
        cached = getattr(outputs[-1][1], "num_cached_tokens", None) if outputs else None
        return json_response(
            CompletionResponse(
                id=f"cmpl-{uuid.uuid4().hex}",
                model=job.adapter or self.name,
                choices=choices,
                usage=self.usage(prompt_tokens, generated, cached),
            )
        )


def adapter_of(job) -> dict:
    """stream()'s keyword for the LoRA adapter a job's request named, if any (a backend without
    served adapters never gets one: check_model refuses their names)."""
    return {} if job.adapter is None else {"adapter": job.adapter}
