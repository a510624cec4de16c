"""The OpenAI-compatible HTTP app over a started generation module (FastAPI; `chatgen serve` runs it with uvicorn).

    app = build_app(module, api_key="KEY")                       # module: a started VLLMModule
    app = build_app(module, api_key="KEY", routers=[control])    # more endpoints behind the same key
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions and /v1/completions (streaming or not),
POST /tokenize. Requests and responses are vLLM's OpenAI protocol models (the schemas, and their
`to_sampling_params`, so that a request means what it means to vLLM's own server). Every request is one
`module.stream` call (the generation contract, chatgen.generation.base), so requests run together in the engine
(continuous batching) and a weight update (`module.load_weights`) lands between two engine steps. Each chat
choice's `message` also carries `prompt_token_ids`, `generation_token_ids`, `generation_log_probs` and
`generation_weight_versions`; a chat request may give `required_prefix_token_ids` (or carry them on its last assistant message as `prompt_token_ids`
+ `generation_token_ids`), and its prompt then begins with exactly those ids (chatgen.generation.chat_tokens).
Bad requests get a 4xx with an OpenAI-style error body naming the field; the server keeps serving.
"""
import contextlib
import hmac
import json
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from chatgen.generation.chat_tokens import replace_prefix_tokens

# Request fields the server refuses rather than silently ignore: (field, is it set?, why)
UNSUPPORTED = (
    ("use_beam_search", bool, "beam search is not supported"),
    ("tools", bool, "tool calling is not supported: put tool descriptions in the messages"),
    ("response_format", lambda v: v is not None and getattr(v, "type", "text") != "text",
     "structured output is not supported"),
    ("structured_outputs", lambda v: v is not None, "structured output is not supported"),
    ("echo", bool, "echo is not supported"),
    ("prompt_logprobs", lambda v: v is not None, "prompt_logprobs is not supported"),
    ("suffix", bool, "suffix is not supported"),
    ("continue_final_message", bool, "continue_final_message is not supported"),
)


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "code"}}` with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error_response(status: int, message: str, param=None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            503: "ServiceUnavailableError"}.get(status, "Error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency that refuses (401) requests without `Authorization: Bearer <api_key>`; a no-op
    when api_key is None. `build_app` puts it on every route, including those of `routers`."""
    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                                "the key the server was started with (--api-key)")

    return require_api_key


def build_app(module, *, api_key: str | None = None, model_name: str | None = None, routers=()) -> FastAPI:
    """The FastAPI app serving `module` (a started VLLMModule) under `model_name` (default: its `load` path).

    api_key: when set, every endpoint (also those of `routers`) needs `Authorization: Bearer <api_key>`.
    routers: more `fastapi.APIRouter`s to mount (e.g. weight-update control endpoints); they can reach the
    module as `request.app.state.module`.
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

    if module.tokenizer is None:
        raise ValueError("build_app: the model has no tokenizer; the OpenAI server needs one to render chats "
                         "and return text")
    name = model_name or str(module.config.load)
    app = FastAPI(title="chatgen", description="OpenAI-compatible server over a chatgen VLLMModule")
    app.state.module, app.state.model_name = module, name
    server = _Server(module, name)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        return _error_response(400, "invalid request: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):  # a bug, not the client's fault: say so, keep serving
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")

    router = APIRouter(dependencies=[Depends(api_key_dependency(api_key))])

    @router.get("/health")
    async def health():
        return {"status": "ok", "model": name, "weight_version": module.weight_version}

    @router.get("/v1/models")
    async def models():
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        return _json_response(ModelList(data=[ModelCard(id=name, owned_by="chatgen", root=str(module.config.load),
                                               max_model_len=module.config.seq_length)]))

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        if "messages" in body:
            req = _parse(TokenizeChatRequest, body)
            server.check_model(req.model)
            ids = server.render(body["messages"], add_generation_prompt=req.add_generation_prompt)
        else:
            req = _parse(TokenizeCompletionRequest, body)
            server.check_model(req.model)
            ids = module.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse

        return _json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=module.config.seq_length))

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        req = _parse(ChatCompletionRequest, body)
        return await server.chat(req, body)

    @router.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        req = _parse(CompletionRequest, body)
        return await server.completions(req)

    app.include_router(router)
    for extra in routers:
        app.include_router(extra, dependencies=[Depends(api_key_dependency(api_key))])
    return app


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _parse(model_class, body: dict):
    try:
        req = model_class.model_validate(body)
    except ValidationError as e:
        raise APIError(400, "invalid request: " + "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()))
    for field, is_set, why in UNSUPPORTED:
        if is_set(getattr(req, field, None)):
            raise APIError(400, f"{field}: {why}", field)
    return req


def _json_response(obj) -> Response:
    """A protocol model as the response body: pydantic's own JSON (FastAPI's generic encoder of a returned model
    costs 0.25 ms per completion response, measured; this 0.007 ms)."""
    return Response(obj.model_dump_json(), media_type="application/json")


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n"


class _Server:
    """Request handling shared by the endpoints: prompts, sampling parameters, one `module.stream` call each."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name
        cfg = module.config
        self.defaults = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": max(cfg.top_k, 0),
                         "min_p": cfg.min_p}

    def check_model(self, model) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.name!r} (GET /v1/models)",
                           "model")

    def render(self, messages, add_generation_prompt=True) -> list:
        """Token ids of a chat rendered with the model's own chat template."""
        tokenizer = self.module.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise APIError(400, f"messages.{i}: each message needs a role and content", "messages")
            content = message.get("content")
            if isinstance(content, list):  # content parts: only text
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported", "messages")
                content = "".join(part["text"] for part in content)
            plain.append({**{k: v for k, v in message.items() if k in ("role", "name", "tool_call_id")},
                          "content": content or ""})
        try:
            return list(tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, return_dict=False))
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages")

    def chat_prompt(self, messages, body: dict) -> list:
        """The prompt ids of a chat: the template's, with the previous turn's exact ids as prefix when known."""
        prefix = body.get("required_prefix_token_ids")
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=None)
        if prefix is None and last is not None:
            m = messages[last]
            if m.get("prompt_token_ids") is not None and m.get("generation_token_ids") is not None:
                prefix = list(m["prompt_token_ids"]) + list(m["generation_token_ids"])
        ids = self.render(messages)
        if prefix is None:
            return ids
        if not (isinstance(prefix, list) and prefix and all(isinstance(t, int) and t >= 0 for t in prefix)):
            raise APIError(400, "required_prefix_token_ids must be a non-empty list of token ids",
                           "required_prefix_token_ids")
        if last is None:
            raise APIError(400, "required_prefix_token_ids needs the assistant message they end with in messages",
                           "required_prefix_token_ids")
        history = self.render(messages[:last + 1], add_generation_prompt=False)
        try:
            return replace_prefix_tokens(self.module.tokenizer, prefix, history, ids)
        except ValueError as e:
            raise APIError(400, str(e), "required_prefix_token_ids")

    def sampling_params(self, req, prompt_len: int):
        seq_length = self.module.config.seq_length
        if prompt_len >= seq_length:
            raise APIError(400, f"the prompt has {prompt_len} tokens, and this model's context is {seq_length} "
                                "tokens; shorten the prompt", "messages")
        wanted = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if wanted is not None and prompt_len + wanted > seq_length:
            raise APIError(400, f"max_tokens={wanted} plus the prompt's {prompt_len} tokens is over this model's "
                                f"context of {seq_length} tokens; ask for at most {seq_length - prompt_len}",
                           "max_tokens")
        try:
            params = req.to_sampling_params(wanted or seq_length - prompt_len, self.defaults)
        except ValueError as e:
            raise APIError(400, f"invalid sampling parameters: {e}")
        if params.logprobs is None:  # generation_log_probs needs the sampled token's log-prob
            params.logprobs = 0
        return params

    async def run(self, prompts: list, params, stream: bool):
        """One `module.stream` call for the prompts: yields RequestOutputs (deltas when streaming) with the prompt's
        index as `.prompt_index`."""
        module = self.module
        if module.is_sleeping():
            raise APIError(503, "the engine is asleep (between RLHF episodes); retry after wake_up")
        if module.needs_resync:
            raise APIError(503, module.needs_resync)
        async with contextlib.aclosing(module.stream(prompts, params, deltas=stream)) as outputs:  # closed: aborts
            async for i, output in outputs:
                output.prompt_index = i
                yield output

    async def chat(self, req, body: dict):
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProb,
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
            ChatMessage,
            DeltaMessage,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        self.check_model(req.model)
        prompt = self.chat_prompt(body["messages"], body)
        params = self.sampling_params(req, len(prompt))
        tokenizer = self.module.tokenizer

        def logprobs_of(sample):
            if not req.logprobs:
                return None
            content = []
            for token, step in zip(sample.token_ids, sample.logprobs or []):
                top = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:req.top_logprobs or 0]
                content.append(ChatCompletionLogProbsContent(
                    token=tokenizer.decode([token]), logprob=step[token].logprob,
                    top_logprobs=[ChatCompletionLogProb(token=tokenizer.decode([t]), logprob=lp.logprob)
                                  for t, lp in top]))
            return ChatCompletionLogProbs(content=content)

        if req.stream:
            created, response_id = int(time.time()), f"chatcmpl-{time.time_ns()}"
            outputs = self.run([prompt], params, stream=True)
            first = await _first(outputs)  # errors before the first byte are still a 4xx

            async def events():
                usage = 0
                yield _sse(ChatCompletionStreamResponse(
                    id=response_id, created=created, model=self.name, prompt_token_ids=prompt,
                    choices=[ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                           content=""))
                             for i in range(params.n)]))
                async for output in _chain(first, outputs):
                    for sample in output.outputs:
                        usage += len(sample.token_ids)
                        yield _sse(ChatCompletionStreamResponse(
                            id=response_id, created=created, model=self.name, choices=[
                                ChatCompletionResponseStreamChoice(
                                    index=sample.index, delta=DeltaMessage(content=sample.text),
                                    logprobs=logprobs_of(sample), finish_reason=sample.finish_reason,
                                    token_ids=list(sample.token_ids))]))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse(ChatCompletionStreamResponse(
                        id=response_id, created=created, model=self.name, choices=[],
                        usage=UsageInfo(prompt_tokens=len(prompt), completion_tokens=usage,
                                        total_tokens=len(prompt) + usage)))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        (output,) = [o async for o in self.run([prompt], params, stream=False)]
        choices = [ChatCompletionResponseChoice(
            index=s.index, finish_reason=s.finish_reason, stop_reason=s.stop_reason, logprobs=logprobs_of(s),
            message=ChatMessage(role="assistant", content=s.text, prompt_token_ids=prompt,
                                generation_token_ids=list(s.token_ids),
                                generation_log_probs=[step[t].logprob for step, t in zip(s.logprobs, s.token_ids)],
                                generation_weight_versions=s.weight_versions))
            for s in sorted(output.outputs, key=lambda s: s.index)]
        generated = sum(len(s.token_ids) for s in output.outputs)
        usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=generated,
                          total_tokens=len(prompt) + generated)
        return _json_response(ChatCompletionResponse(model=self.name, choices=choices, prompt_token_ids=prompt,
                                                     usage=usage))

    async def completions(self, req):
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionLogProbs,
            CompletionResponse,
            CompletionResponseChoice,
            CompletionResponseStreamChoice,
            CompletionStreamResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        self.check_model(req.model)
        tokenizer = self.module.tokenizer
        raw = req.prompt
        if raw is None or raw == "" or raw == []:
            raise APIError(400, "prompt: give a non-empty string, list of token ids, or a list of those", "prompt")
        if isinstance(raw, str) or (isinstance(raw, list) and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in raw]
        if any(not p for p in prompts):
            raise APIError(400, "prompt: every prompt needs at least one token", "prompt")
        vocab = self.module.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise APIError(400, f"prompt: token ids must be in 0..{vocab - 1}", "prompt")
        params = self.sampling_params(req, max(map(len, prompts)))
        n = params.n

        def logprobs_of(sample):
            if req.logprobs is None:
                return None
            tokens = [tokenizer.decode([t]) for t in sample.token_ids]
            return CompletionLogProbs(
                tokens=tokens, token_logprobs=[step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)],
                text_offset=[sum(map(len, tokens[:k])) for k in range(len(tokens))],
                top_logprobs=[{tokenizer.decode([t]): lp.logprob for t, lp in sorted(
                    step.items(), key=lambda kv: -kv[1].logprob)[:req.logprobs]} for step in sample.logprobs])

        if req.stream:
            created, response_id = int(time.time()), f"cmpl-{time.time_ns()}"
            outputs = self.run(prompts, params, stream=True)
            first = await _first(outputs)

            async def events():
                async for output in _chain(first, outputs):
                    for sample in output.outputs:
                        yield _sse(CompletionStreamResponse(id=response_id, created=created, model=self.name, choices=[
                            CompletionResponseStreamChoice(index=output.prompt_index * n + sample.index,
                                                           text=sample.text, logprobs=logprobs_of(sample),
                                                           finish_reason=sample.finish_reason,
                                                           token_ids=list(sample.token_ids))]))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        outputs = sorted([o async for o in self.run(prompts, params, stream=False)], key=lambda o: o.prompt_index)
        choices = [CompletionResponseChoice(index=o.prompt_index * n + s.index, text=s.text, logprobs=logprobs_of(s),
                                            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                            prompt_token_ids=list(o.prompt_token_ids), token_ids=list(s.token_ids),
                                            generation_log_probs=[step[t].logprob
                                                                  for step, t in zip(s.logprobs, s.token_ids)],
                                            generation_weight_versions=s.weight_versions)
                   for o in outputs for s in sorted(o.outputs, key=lambda s: s.index)]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        generated = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        return _json_response(CompletionResponse(model=self.name, choices=choices, usage=UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)))


class _Ended(Exception):
    pass


async def _first(outputs):
    """The first item of an async iterator (raising its error here, before a streamed response starts), or
    _Ended when there is none."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return _Ended()


async def _chain(first, outputs):
    async with contextlib.aclosing(outputs):  # a client that goes away aborts its requests
        if isinstance(first, _Ended):
            return
        yield first
        async for output in outputs:
            yield output
