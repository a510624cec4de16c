"""The OpenAI-compatible HTTP app over a started generation module (FastAPI; `chatgen serve` runs it with uvicorn).

    app = build_app(module, api_key="KEY")                       # module: a started VLLMModule
    app = build_app(module, api_key="KEY", routers=[control])    # more endpoints behind the same key
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions and /v1/completions (streaming or not),
POST /tokenize and /detokenize. Requests and responses are vLLM's OpenAI protocol models, and a request is read
the way vLLM's own server reads it: its sampling parameters by the protocol's `to_sampling_params`, its prompt's
length limits and truncation by the protocol's `TokenizeParams`, the token strings of log-probs by vLLM's
`convert_ids_list_to_tokens`; docs/serving.md lists what still differs. Every request is one `module.stream` call
(the generation contract, chatgen.generation.base), so requests run together in the engine (continuous batching)
and a weight update (`module.load_weights`) lands between two engine steps.

Beyond vLLM's fields, each chat choice's `message` carries `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs` and `generation_weight_versions` (completion choices: `prompt_token_ids`, `token_ids`, ...;
streamed chunks: the same for their new tokens); a chat request may give `required_prefix_token_ids` (or carry
them on its last assistant message as `prompt_token_ids` + `generation_token_ids`), and its prompt then begins with
exactly those ids (chatgen.generation.chat_tokens).

Bad requests get a 4xx with an OpenAI-style error body (vLLM's message for what vLLM validates: its client-error
type is answered in one handler); bodies over `max_request_bytes` get 413 before they are parsed; parsing and
tokenizing run on a worker thread, so a huge request never stalls /health or the streams of others.

Next to it: chatgen.serving.http (error bodies, guards, middleware), chatgen.serving.requests (a request read
and tokenized into a Job).
"""

import contextlib
import json
import time
import uuid

from chatgen.core.imports import require

require("fastapi", "the OpenAI server (chatgen serve, chatgen.serving)")
require("vllm", "the OpenAI server (its request and response schemas are vLLM's)")

from fastapi import APIRouter, Depends, FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

# DEFAULT_MAX_REQUEST_BYTES, APIError, api_key_dependency, ...: importable from here too
from chatgen.serving.http import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,  # noqa: F401
    BodyLimit,
    HostCheck,
    api_key_dependency,
    cancel_on_disconnect,
    error_body,
    error_response,
    require_json,
)
from chatgen.serving.requests import Job, RequestReader, pydantic_errors


def build_app(
    module,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    routers=(),
    max_request_bytes: int | None = None,
    allowed_hosts=(),
) -> FastAPI:
    """The FastAPI app serving `module` (a started VLLMModule) under `model_name` (default: its `load` path).

    api_key: when set, every endpoint (also those of `routers`) needs `Authorization: Bearer <api_key>`, and the
    interactive docs (/docs, /redoc, /openapi.json) are off (a browser cannot send the key).
    routers: more `fastapi.APIRouter`s to mount (e.g. weight-update control endpoints); they can reach the
    module as `request.app.state.module`.
    max_request_bytes: a larger request body is answered 413 without being read (None: 16 MiB).
    allowed_hosts: names clients may give in the Host header beyond IP addresses, localhost and this
    machine's names ("*": any; `HostCheck`). A POST must be JSON (`require_json`).
    """
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMClientError

    if module.tokenizer is None:
        raise ValueError(
            "build_app: the model has no tokenizer; the OpenAI server needs one to render chats "
            "and return text"
        )
    name = model_name or str(module.config.load)
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="chatgen",
        description="OpenAI-compatible server over a chatgen generation module",
        **docs,
    )
    app.add_middleware(BodyLimit, limit=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)  # outermost: before the body
    app.state.module, app.state.model_name = module, name
    server = _Server(module, name)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(VLLMClientError)
    async def vllm_client_error(
        request, e: VLLMClientError
    ):  # what vLLM validates, answered with vLLM's message
        error = create_error_response(e)
        return JSONResponse(error.model_dump(), error.error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        return error_response(400, "invalid request: " + pydantic_errors(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(
        request, e: Exception
    ):  # a bug, not the client's fault: say so, keep serving
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    guards = [Depends(api_key_dependency(api_key)), Depends(require_json)]  # in this order
    router = APIRouter(dependencies=guards)

    @router.get("/health")
    async def health():
        problem = module.health_problem  # a hung engine: a load balancer must stop sending here
        if problem:
            raise APIError(503, problem)
        return {"status": "ok", "model": name, "weight_version": module.weight_version}

    @router.get("/v1/models")
    async def models():
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        return _json_response(
            ModelList(
                data=[
                    ModelCard(
                        id=name,
                        owned_by="chatgen",
                        root=str(module.config.load),
                        max_model_len=module.config.seq_length,
                    )
                ]
            )
        )

    @router.post("/tokenize")
    @cancel_on_disconnect
    async def tokenize(request: Request):
        return _json_response(await server.off_loop(server.tokenize, await request.body()))

    @router.post("/detokenize")
    @cancel_on_disconnect
    async def detokenize(request: Request):
        return _json_response(await server.off_loop(server.detokenize, await request.body()))

    @router.post("/v1/chat/completions")
    @cancel_on_disconnect
    async def chat(request: Request):
        return await server.chat(await server.off_loop(server.prepare_chat, await request.body()))

    @router.post("/v1/completions")
    @cancel_on_disconnect
    async def completions(request: Request):
        return await server.completions(
            await server.off_loop(server.prepare_completion, await request.body())
        )

    app.include_router(router)
    for extra in routers:
        app.include_router(extra, dependencies=guards)
    return app


def _json_response(obj) -> Response:
    """A protocol model as the response body: pydantic's own JSON (FastAPI's generic encoder of a returned model
    costs 0.25 ms per completion response, measured; this 0.007 ms)."""
    return Response(obj.model_dump_json(), media_type="application/json")


def _sse(obj, **dump) -> str:
    return f"data: {obj.model_dump_json(**(dump or {'exclude_unset': True}))}\n\n"


class _Server(RequestReader):
    """The endpoints' answers: log-probs, usage, one `module.stream` call each (streamed or
    not); reading the requests is RequestReader's (chatgen.serving.requests)."""

    # ------------------------------------------------------------------ outputs

    def token_text(self, token: int) -> str:
        """A token's text in log-probs, as vLLM writes it (the leading space SentencePiece's decode drops kept)."""
        text = self.token_texts.get(token)
        if text is None:
            from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

            text = self.token_texts[token] = convert_ids_list_to_tokens(self.tokenizer, [token])[0]
        return text

    def prompt_logprobs(self, output):
        """The request's prompt log-probs as vLLM answers them: token texts filled in, -inf clamped to -9999."""
        steps = output.prompt_logprobs
        for step in steps or ():
            for token, lp in (step or {}).items():
                lp.decoded_token = self.token_text(token)
                lp.logprob = max(lp.logprob, -9999.0)
        return steps

    def completion_logprobs(self, token_ids, steps, top: int, text_offset: int = 0):
        """vLLM's completions `logprobs`: per token its text, log-prob, the first `top` + 1 entries of its step
        (the sampled token first, then the most likely) and its offset in the text."""
        from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token, step in zip(token_ids, steps):
            if step is None:  # the first prompt token (echo) has no log-prob
                tokens.append(self.tokenizer.decode(token))
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                tokens.append(self.token_text(token))
                token_logprobs.append(max(step[token].logprob, -9999.0))
                top_logprobs.append(
                    {
                        self.token_text(t): max(lp.logprob, -9999.0)
                        for i, (t, lp) in enumerate(step.items())
                        if top == -1 or top >= i
                    }
                )
            offsets.append(text_offset if not offsets else offsets[-1] + len(tokens[-2]))
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )

    def chat_logprobs(self, sample, top: int):
        """vLLM's chat `logprobs` of a sample: per token its text, bytes, log-prob and its step's first `top`
        entries (the sampled token first, then the most likely)."""
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProb,
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
        )

        def entry(cls, token, lp, **more):
            text = self.token_text(token)
            return cls(
                token=text,
                logprob=max(lp.logprob, -9999.0),
                bytes=list(text.encode("utf-8", errors="replace")),
                **more,
            )

        return ChatCompletionLogProbs(
            content=[
                entry(
                    ChatCompletionLogProbsContent,
                    token,
                    step[token],
                    top_logprobs=[
                        entry(ChatCompletionLogProb, t, lp)
                        for i, (t, lp) in enumerate(step.items())
                        if top == -1 or i < top
                    ],
                )
                for token, step in zip(sample.token_ids, sample.logprobs)
            ]
        )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens=None):
        from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None
            if cached_tokens is None
            else PromptTokenUsageInfo(cached_tokens=cached_tokens),
        )

    # ------------------------------------------------------------------ generation (on the event loop)

    async def run(self, job: Job, stream: bool):
        """One `module.stream` call for the job's prompts: yields (prompt index, RequestOutput) (deltas when
        streaming). Leaving the iterator early aborts the requests."""
        module = self.module
        if module.is_sleeping():
            raise APIError(503, "the engine is asleep (between RLHF episodes); retry after wake_up")
        if module.needs_resync:
            raise APIError(503, module.needs_resync)
        if module.health_problem:
            raise APIError(503, module.health_problem)
        params = job.params[0] if len(job.params) == 1 else job.params
        async with contextlib.aclosing(
            module.stream(job.prompts, params, deltas=stream)
        ) as outputs:  # closed: aborts
            async for i, output in outputs:
                yield i, output

    async def streamed(self, job: Job, events):
        """A server-sent-event response of `events(first, outputs)`, after the job's first output (an error before
        it is still an HTTP error); an error after it ends the stream with an error event, as vLLM's does."""
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

        if req.stream:
            created, response_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
            include_usage, continuous = should_include_usage(req.stream_options, False)

            def chunk(choices, **fields):
                return ChatCompletionStreamResponse(
                    id=response_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=self.name,
                    choices=choices,
                    **fields,
                )

            async def events(first, outputs):
                generated, cached = [0] * n, None
                usage = (
                    (lambda i: self.usage(len(prompt), generated[i]))
                    if continuous
                    else (lambda i: None)
                )
                if first is not None:
                    cached = getattr(first[1], "num_cached_tokens", None)
                for i in range(n):
                    yield _sse(
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
                        yield _sse(
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
                async for _, output in _chain(first, outputs):
                    for sample in output.outputs:
                        if (
                            not sample.text
                            and not sample.token_ids
                            and not generated[sample.index]
                            and not sample.finish_reason
                        ):
                            continue  # a chunked prefill step: nothing to say yet
                        generated[sample.index] += len(sample.token_ids)
                        yield _sse(
                            chunk(
                                [
                                    ChatCompletionResponseStreamChoice(
                                        index=sample.index,
                                        delta=DeltaMessage(content=sample.text),
                                        logprobs=logprobs_of(sample),
                                        finish_reason=sample.finish_reason,
                                        **(
                                            {"stop_reason": sample.stop_reason}
                                            if sample.finish_reason
                                            else {}
                                        ),
                                        **_generated_fields(sample),
                                    )
                                ],
                                **({"usage": usage(sample.index)} if continuous else {}),
                            )
                        )
                if include_usage:
                    yield _sse(
                        chunk([], usage=self.usage(len(prompt), sum(generated), cached)),
                        exclude_unset=True,
                        exclude_none=True,
                    )

            return await self.streamed(job, events)

        ((_, output),) = [o async for o in self.run(job, stream=False)]
        choices = [
            ChatCompletionResponseChoice(
                index=s.index,
                finish_reason=s.finish_reason or "stop",
                stop_reason=s.stop_reason,
                logprobs=logprobs_of(s),
                message=ChatMessage(
                    role="assistant",
                    content=echo + s.text,
                    prompt_token_ids=prompt,
                    generation_token_ids=list(s.token_ids),
                    generation_log_probs=_sampled_logprobs(s),
                    generation_weight_versions=s.weight_versions,
                ),
            )
            for s in sorted(output.outputs, key=lambda s: s.index)
        ]
        generated = sum(len(s.token_ids) for s in output.outputs)
        return _json_response(
            ChatCompletionResponse(
                id=f"chatcmpl-{uuid.uuid4().hex}",
                model=self.name,
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
        echo_only = (
            req.echo and req.max_tokens == 0
        )  # the prompt alone (vLLM samples one token, returns none)

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
                async for i, output in _chain(first, outputs):
                    if output.prompt_logprobs is not None:  # on a prompt's first output only
                        prompt_logprobs[i] = output.prompt_logprobs
                    prompt = job.prompts[i]
                    for sample in output.outputs:
                        k = i * n + sample.index
                        fields = _generated_fields(sample)
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
                        if (
                            logprobs is not None and logprobs.tokens
                        ):  # by the tokens, not the text (stop strings)
                            offsets[k] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                        yield _sse(
                            CompletionStreamResponse(
                                id=response_id,
                                object="text_completion",
                                created=created,
                                model=self.name,
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
                    yield _sse(
                        CompletionStreamResponse(
                            id=response_id,
                            created=created,
                            model=self.name,
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
                        **_generated_fields(s),
                    )
                )
        prompt_tokens = sum(len(job.prompts[i]) for i, _ in outputs)
        generated = sum(len(s.token_ids) for _, o in outputs for s in o.outputs)
        cached = getattr(outputs[-1][1], "num_cached_tokens", None) if outputs else None
        return _json_response(
            CompletionResponse(
                id=f"cmpl-{uuid.uuid4().hex}",
                model=self.name,
                choices=choices,
                usage=self.usage(prompt_tokens, generated, cached),
            )
        )


def _sampled_logprobs(sample) -> list:
    return [step[token].logprob for step, token in zip(sample.logprobs or (), sample.token_ids)]


def _generated_fields(sample) -> dict:
    """chatgen's fields of a sample (or of a streamed delta: its new tokens): the ids, the engine's log-prob of
    each and the weight version each was sampled under."""
    return {
        "token_ids": list(sample.token_ids),
        "generation_log_probs": _sampled_logprobs(sample),
        "generation_weight_versions": getattr(sample, "weight_versions", None),
    }


async def _chain(first, outputs):
    if first is None:
        return
    yield first
    async for item in outputs:
        yield item
