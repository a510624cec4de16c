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
"""
import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import hmac
import ipaddress
import json
import re
import socket
import time
import uuid

from chatgen.core.imports import require

require("fastapi", "the OpenAI server (chatgen serve, chatgen.serving)")
require("vllm", "the OpenAI server (its request and response schemas are vLLM's)")

from fastapi import APIRouter, Depends, FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from chatgen.generation.chat_tokens import replace_prefix_tokens

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # a 128k-token prompt is ~1 MB of text; a batch of token-id prompts ~7 B/id

# Request fields the server refuses rather than silently ignore: (field, is it set?, why)
UNSUPPORTED = (
    ("use_beam_search", bool, "beam search is not supported; sample with n > 1"),
    ("response_format", lambda v: v is not None and getattr(v, "type", "text") != "text",
     "structured output is not supported"),
    ("structured_outputs", lambda v: v is not None, "structured output is not supported"),
    ("suffix", bool, "suffix (fill in the middle) is not supported"),
    ("chat_template", lambda v: v is not None,
     "a chat template sent with the request is not run (vLLM's default, without --trust-request-chat-template); "
     "the model's own template renders every chat"),
    ("tool_choice", lambda v: v not in (None, "none"),
     "chatgen parses no tool calls: send tool_choice 'none' to render the tools into the prompt with the chat "
     "template, and read the calls from the reply yourself"),
)


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "code"}}` with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
               503: "ServiceUnavailableError"}


def _error_body(status: int, message: str, param=None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError" if status >= 500
                                                                   else "Error"), "param": param, "code": status}}


def _error_response(status: int, message: str, param=None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param), status)


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


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app reads any of it (by its
    Content-Length, or as its chunks arrive), so an oversized request costs neither parsing nor memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and int(declared) > self.limit:
            return await self._refuse(send, int(declared))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send, size)
            more = message.get("more_body", False)
        replayed = False

        async def replay():  # the body once, then the connection's own events (a disconnect ends a stream)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        body = json.dumps(_error_body(413, f"the request body has {size} bytes, over this server's limit of "
                                           f"{self.limit} bytes; send less per request (e.g. fewer prompts), or "
                                           "start the server with a larger --max-request-bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def require_json(request: Request) -> None:
    """A FastAPI dependency (after the API key's) on every route: a request with a body (any method
    but GET and HEAD) must be `Content-Type: application/json`, 415 otherwise. A web page can send
    text/plain, a form or no type at all to any server without asking it first; JSON it cannot
    without a CORS preflight, which this server never approves (it sends no CORS headers)."""
    if request.method in ("GET", "HEAD"):
        return
    given = request.headers.get("content-type")
    if (given or "").split(";")[0].strip().lower() != "application/json":
        gave = f"this request gave {given!r}" if given else "none given"
        raise APIError(415, f"{request.method} requests take a JSON body: send the header "
                            f"'Content-Type: application/json' ({gave}), even with an empty "
                            "body {}")


class HostCheck:
    """ASGI middleware: the `Host` header must be an IP address or a name of this server (400
    otherwise, before anything else is read). DNS rebinding points a web page's own name at
    127.0.0.1: its requests then reach a server on the user's machine, carrying that name. Names:
    localhost, this machine's host names and `allowed_hosts`; "*" accepts any (behind a proxy that
    checks the name itself)."""

    def __init__(self, app, allowed_hosts=()):
        self.app = app
        names = {"localhost", socket.gethostname(), socket.getfqdn(), *allowed_hosts}
        self.names = None if "*" in names else {n.lower().rstrip(".") for n in names}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.names is not None:
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            problem = host is not None and self.problem(host.decode("latin-1").strip())
            if problem:
                return await _error_response(400, problem)(scope, receive, send)
        return await self.app(scope, receive, send)

    def problem(self, host: str) -> str | None:
        name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
        try:
            ipaddress.ip_address(name)
            return None
        except ValueError:
            pass
        if name.lower().rstrip(".") in self.names:
            return None
        return (f"Host {host!r} is not a name of this server (an IP address, localhost, this "
                "machine's name or one of --allowed-hosts); behind a proxy, start the server with "
                f"--allowed-hosts {name} (or '*' if the proxy checks the name itself)")


def build_app(module, *, api_key: str | None = None, model_name: str | None = None, routers=(),
              max_request_bytes: int | None = None, allowed_hosts=()) -> FastAPI:
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
        raise ValueError("build_app: the model has no tokenizer; the OpenAI server needs one to render chats "
                         "and return text")
    name = model_name or str(module.config.load)
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="chatgen", description="OpenAI-compatible server over a chatgen generation module", **docs)
    app.add_middleware(BodyLimit, limit=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)  # outermost: before the body
    app.state.module, app.state.model_name = module, name
    server = _Server(module, name)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(e.status, e.message, e.param)

    @app.exception_handler(VLLMClientError)
    async def vllm_client_error(request, e: VLLMClientError):  # what vLLM validates, answered with vLLM's message
        error = create_error_response(e)
        return JSONResponse(error.model_dump(), error.error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        return _error_response(400, "invalid request: " + _pydantic_errors(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):  # a bug, not the client's fault: say so, keep serving
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")

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

        return _json_response(ModelList(data=[ModelCard(id=name, owned_by="chatgen", root=str(module.config.load),
                                               max_model_len=module.config.seq_length)]))

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
        return await server.completions(await server.off_loop(server.prepare_completion, await request.body()))

    app.include_router(router)
    for extra in routers:
        app.include_router(extra, dependencies=guards)
    return app


def cancel_on_disconnect(handler):
    """A route handler that is cancelled when its client disconnects (vLLM's `with_cancellation`):
    its engine requests are aborted, so an abandoned request stops costing the others. The body is
    read first; after that the connection's only event is its disconnect. A handler that returns a
    StreamingResponse hands the listening over to it (Starlette cancels a stream whose client
    left)."""
    @functools.wraps(handler)
    async def cancellable(request: Request):
        await request.body()  # kept by the request for the handler

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(handler(request)), asyncio.ensure_future(disconnected())
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        for task in (work, gone):
            task.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        with contextlib.suppress(BaseException):  # its requests are aborted as it unwinds
            await work
        return None  # the client left: nobody reads an answer

    return cancellable


def _pydantic_errors(errors) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors[:10])


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in the raw body


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an int of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}")
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply to parse")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE.search(raw):  # a pair of escapes is one character; a lone one is no text
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"the request body holds a lone UTF-16 surrogate escape "
                                f"(\\u{ord(e.object[e.start]):04x}), which is no text: escape the "
                                "whole character as a surrogate pair, or send it as UTF-8")
    return body


def _parse(model_class, body: dict):
    try:
        req = model_class.model_validate(body)
    except ValidationError as e:
        raise APIError(400, "invalid request: " + _pydantic_errors(e.errors()))
    for field, is_set, why in UNSUPPORTED:
        if is_set(getattr(req, field, None)):
            raise APIError(400, f"{field}: {why}", field)
    return req


def _json_response(obj) -> Response:
    """A protocol model as the response body: pydantic's own JSON (FastAPI's generic encoder of a returned model
    costs 0.25 ms per completion response, measured; this 0.007 ms)."""
    return Response(obj.model_dump_json(), media_type="application/json")


def _sse(obj, **dump) -> str:
    return f"data: {obj.model_dump_json(**(dump or {'exclude_unset': True}))}\n\n"


class _ModelLimits:
    """What the protocol's `build_tok_params(model_config)` reads of vLLM's ModelConfig."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len


class _Job:
    """A parsed request, ready to run: its prompts (token ids), their texts where known, their sampling params."""

    def __init__(self, req, prompts, texts, params, **extra):
        self.req, self.prompts, self.texts, self.params = req, prompts, texts, params
        self.__dict__.update(extra)


class _Server:
    """Request handling shared by the endpoints: prompts, sampling parameters, one `module.stream` call each."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name
        cfg = module.config
        self.defaults = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": max(cfg.top_k, 0),
                         "min_p": cfg.min_p}
        self.limits = _ModelLimits(cfg.seq_length)
        self.tokenizer = module.tokenizer  # decoding (shared with the engine: decoding never changes it)
        # Encoding with vLLM's truncation settings changes the tokenizer's state (HF's set_truncation_and_padding),
        # which would fail ("Already borrowed") while another thread encodes with it: the server encodes with its
        # own copy, on its own single thread (which also keeps tokenizing off the event loop).
        self.encoder = copy.deepcopy(module.tokenizer)
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chatgen-server-tokenize")
        self.token_texts = {}  # token id -> its text in log-probs (vLLM's convert_ids_list_to_tokens)

    async def off_loop(self, fn, raw: bytes):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, raw)

    def check_model(self, model) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.name!r} (GET /v1/models)",
                           "model")

    # ------------------------------------------------------------------ prompts (on the worker thread)

    def tokenize_text(self, text: str, tok_params) -> list:
        """vLLM's text path: a length check on characters (before any tokenizing), encode, truncate, a length check
        on tokens; the rules are the request's `TokenizeParams`."""
        text = tok_params.apply_pre_tokenization(self.encoder, {"prompt": text})["prompt"]
        return self.check_ids(self.encoder.encode(self.trim(text, tok_params),
                                                  **tok_params.get_encode_kwargs()), tok_params)

    def trim(self, text: str, tok_params) -> str:
        """A truncated prompt's text cut, before encoding, to what its kept tokens can span (the
        model's max input tokens x its longest token, on the side truncation drops): the tokenizer
        would otherwise encode all of a 15 MB text to keep 100 tokens, and every other request waits
        on this thread meanwhile. vLLM cuts the same way when a request names truncation_side."""
        limit = getattr(self.encoder, "max_chars_per_token", None)
        if not limit or None in (tok_params.truncate_prompt_tokens, tok_params.max_input_tokens):
            return text
        limit *= tok_params.max_input_tokens
        if len(text) <= limit:
            return text
        side = tok_params.truncation_side or getattr(self.encoder, "truncation_side", "left")
        return text[-limit:] if side == "left" else text[:limit]

    def check_ids(self, ids, tok_params) -> list:
        """Token ids truncated and length-checked by the request's `TokenizeParams`."""
        ids = list(tok_params.apply_post_tokenization(self.encoder, {"prompt_token_ids": list(ids)})
                   ["prompt_token_ids"])
        if not ids:
            raise APIError(400, "the prompt has no tokens left (truncate_prompt_tokens: 0?); every "
                                "prompt needs at least one", "truncate_prompt_tokens")
        return ids

    def render(self, req, messages=None, add_generation_prompt=None, continue_final_message=None) -> str:
        """A chat (the request's messages, or `messages`) rendered to text with the model's own chat template, with
        the request's tools, documents and chat_template_kwargs."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt")
        plain = []
        for i, message in enumerate(req.messages if messages is None else messages):
            content = message.get("content")
            if content is not None and not isinstance(content, str):  # content parts: text only
                try:
                    parts = list(content)  # validated here, lazily, by the protocol
                except ValidationError as e:
                    raise APIError(400, f"messages.{i}.content: " + _pydantic_errors(e.errors()), "messages")
                if any(part.get("type") != "text" for part in parts):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported (this server serves a "
                                        "text-only model)", "messages")
                content = "\n".join(part["text"] for part in parts)  # vLLM's "string" content format
            plain.append({**{k: v for k, v in message.items() if k in ("role", "name", "tool_call_id", "tool_calls")},
                          "content": content})
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.update(add_generation_prompt=req.add_generation_prompt if add_generation_prompt is None
                      else add_generation_prompt,
                      continue_final_message=req.continue_final_message if continue_final_message is None
                      else continue_final_message)
        tools = getattr(req, "tools", None)
        if tools:
            kwargs["tools"] = [tool.model_dump() for tool in tools]
        if getattr(req, "documents", None):
            kwargs["documents"] = req.documents
        try:
            return self.tokenizer.apply_chat_template(plain, tokenize=False, **kwargs)
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages")

    def chat_prompt(self, req, tok_params) -> list:
        """The prompt ids of a chat: the template's, with the previous turn's exact ids as prefix when known."""
        messages = req.messages
        prefix = getattr(req, "required_prefix_token_ids", None)
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if prefix is None and last is not None:
            m = messages[last]
            if m.get("prompt_token_ids") is not None and m.get("generation_token_ids") is not None:
                parts = (m["prompt_token_ids"], m["generation_token_ids"])
                if not all(isinstance(p, list) for p in parts):
                    raise APIError(400, f"messages.{last}: prompt_token_ids and "
                                        "generation_token_ids are lists of token ids", "messages")
                prefix = parts[0] + parts[1]
        if prefix is None:
            return self.tokenize_text(self.render(req), tok_params)
        if not (isinstance(prefix, list) and prefix and all(type(t) is int and t >= 0 for t in prefix)):
            raise APIError(400, "required_prefix_token_ids must be a non-empty list of token ids",
                           "required_prefix_token_ids")
        if last is None:
            raise APIError(400, "required_prefix_token_ids needs the assistant message they end with in messages",
                           "required_prefix_token_ids")
        eos = self.tokenizer.eos_token_id
        if req.continue_final_message and last == len(messages) - 1:  # continue exactly the ids of that answer
            return self.check_ids(prefix[:-1] if prefix[-1] == eos else prefix, tok_params)
        history = self.encoder.encode(self.render(req, messages[:last + 1], add_generation_prompt=False,
                                                  continue_final_message=False), add_special_tokens=False)
        ids = self.encoder.encode(self.render(req), add_special_tokens=False)
        try:
            return self.check_ids(replace_prefix_tokens(self.tokenizer, prefix, history, ids), tok_params)
        except ValueError as e:
            raise APIError(400, str(e), "required_prefix_token_ids")

    def sampling_params(self, req, prompt_len: int):
        """The request's SamplingParams for one prompt (vLLM's `get_max_tokens` and `to_sampling_params`; fields
        the request leaves out take the per-model config's temperature, top_p, top_k and min_p)."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        wanted = getattr(req, "max_completion_tokens", None)
        wanted = req.max_tokens if wanted is None else wanted
        max_tokens = get_max_tokens(self.module.config.seq_length, wanted, prompt_len, {},
                                    truncate_prompt_tokens=req.truncate_prompt_tokens)
        params = req.to_sampling_params(max_tokens, self.defaults)
        if params.logprobs is None and params.logprob_token_ids is None:
            params.logprobs = 0  # generation_log_probs needs the sampled token's log-prob
        return params

    def prepare_completion(self, raw: bytes) -> _Job:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = _json(raw)
        _refuse_non_int_token_ids(body.get("prompt"))
        req = _parse(CompletionRequest, body)
        self.check_model(req.model)
        raw_prompts = req.prompt
        if raw_prompts is None or raw_prompts == "":
            raise APIError(400, "prompt: give a non-empty string, a list of token ids, or a list of those", "prompt")
        if isinstance(raw_prompts, str) or (raw_prompts and all(type(t) is int for t in raw_prompts)):
            raw_prompts = [raw_prompts]
        if not raw_prompts:
            raise APIError(400, "prompt: the list holds no prompt; give at least one", "prompt")
        tok_params = req.build_tok_params(self.limits)
        prompts, texts = [], []
        for i, p in enumerate(raw_prompts):
            if isinstance(p, str):
                prompts.append(self.tokenize_text(p, tok_params))
                texts.append(p)
            else:
                if not p:
                    raise APIError(400, f"prompt {i}: empty; every prompt needs at least one token", "prompt")
                prompts.append(self.check_ids(p, tok_params))
                texts.append(self.tokenizer.decode(prompts[-1]) if req.echo else None)
        return _Job(req, prompts, texts, [self.sampling_params(req, len(p)) for p in prompts])

    def prepare_chat(self, raw: bytes) -> _Job:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        req = _parse(ChatCompletionRequest, _json(raw))
        self.check_model(req.model)
        prompt = self.chat_prompt(req, req.build_tok_params(self.limits))
        return _Job(req, [prompt], [None], [self.sampling_params(req, len(prompt))])

    def tokenize(self, raw: bytes):
        from vllm.entrypoints.serve.tokenize.protocol import (
            TokenizeChatRequest,
            TokenizeCompletionRequest,
            TokenizeResponse,
        )

        body = _json(raw)
        req = _parse(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        self.check_model(req.model)
        text = self.render(req) if "messages" in body else req.prompt
        ids = self.tokenize_text(text, req.build_tok_params(self.limits))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.module.config.seq_length,
                                token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)

    def detokenize(self, raw: bytes):
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, DetokenizeResponse

        req = _parse(DetokenizeRequest, _json(raw))
        self.check_model(req.model)
        vocab = self.module.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            bad = next(t for t in req.tokens if not 0 <= t < vocab)
            raise APIError(400, f"tokens: {bad} is no token id of this model (0..{vocab - 1})",
                           "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

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
                top_logprobs.append({self.token_text(t): max(lp.logprob, -9999.0)
                                     for i, (t, lp) in enumerate(step.items()) if top == -1 or top >= i})
            offsets.append(text_offset if not offsets else offsets[-1] + len(tokens[-2]))
        return CompletionLogProbs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens,
                                  top_logprobs=top_logprobs)

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
            return cls(token=text, logprob=max(lp.logprob, -9999.0),
                       bytes=list(text.encode("utf-8", errors="replace")), **more)

        return ChatCompletionLogProbs(content=[
            entry(ChatCompletionLogProbsContent, token, step[token], top_logprobs=[
                entry(ChatCompletionLogProb, t, lp) for i, (t, lp) in enumerate(step.items())
                if top == -1 or i < top])
            for token, step in zip(sample.token_ids, sample.logprobs)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens=None):
        from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=None if cached_tokens is None
                         else PromptTokenUsageInfo(cached_tokens=cached_tokens))

    # ------------------------------------------------------------------ generation (on the event loop)

    async def run(self, job: _Job, stream: bool):
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
        async with contextlib.aclosing(module.stream(job.prompts, params, deltas=stream)) as outputs:  # closed: aborts
            async for i, output in outputs:
                yield i, output

    async def streamed(self, job: _Job, events):
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
                    yield f"data: {json.dumps(_error_body(e.status, e.message, e.param))}\n\n"
                except Exception as e:  # the engine failed mid-stream (a failed weight update, a shutdown)
                    yield f"data: {json.dumps(_error_body(500, f'{type(e).__name__}: {e}'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def chat(self, job: _Job):
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
                return ChatCompletionStreamResponse(id=response_id, object="chat.completion.chunk", created=created,
                                                    model=self.name, choices=choices, **fields)

            async def events(first, outputs):
                generated, cached = [0] * n, None
                usage = (lambda i: self.usage(len(prompt), generated[i])) if continuous else (lambda i: None)
                if first is not None:
                    cached = getattr(first[1], "num_cached_tokens", None)
                for i in range(n):
                    yield _sse(chunk([ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)],
                        prompt_token_ids=prompt, **({"usage": usage(i)} if continuous else {})))
                    if echo:
                        yield _sse(chunk([ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(content=echo), logprobs=None, finish_reason=None)],
                            **({"usage": usage(i)} if continuous else {})))
                async for _, output in _chain(first, outputs):
                    for sample in output.outputs:
                        if (not sample.text and not sample.token_ids and not generated[sample.index]
                                and not sample.finish_reason):
                            continue  # a chunked prefill step: nothing to say yet
                        generated[sample.index] += len(sample.token_ids)
                        yield _sse(chunk([ChatCompletionResponseStreamChoice(
                            index=sample.index, delta=DeltaMessage(content=sample.text), logprobs=logprobs_of(sample),
                            finish_reason=sample.finish_reason,
                            **({"stop_reason": sample.stop_reason} if sample.finish_reason else {}),
                            **_generated_fields(sample))], **({"usage": usage(sample.index)} if continuous else {})))
                if include_usage:
                    yield _sse(chunk([], usage=self.usage(len(prompt), sum(generated), cached)),
                               exclude_unset=True, exclude_none=True)

            return await self.streamed(job, events)

        ((_, output),) = [o async for o in self.run(job, stream=False)]
        choices = [ChatCompletionResponseChoice(
            index=s.index, finish_reason=s.finish_reason or "stop", stop_reason=s.stop_reason, logprobs=logprobs_of(s),
            message=ChatMessage(role="assistant", content=echo + s.text, prompt_token_ids=prompt,
                                generation_token_ids=list(s.token_ids), generation_log_probs=_sampled_logprobs(s),
                                generation_weight_versions=s.weight_versions))
            for s in sorted(output.outputs, key=lambda s: s.index)]
        generated = sum(len(s.token_ids) for s in output.outputs)
        return _json_response(ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", model=self.name, choices=choices, prompt_token_ids=prompt,
            prompt_logprobs=self.prompt_logprobs(output),
            usage=self.usage(len(prompt), generated, getattr(output, "num_cached_tokens", None))))

    async def completions(self, job: _Job):
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionResponse,
            CompletionResponseChoice,
            CompletionResponseStreamChoice,
            CompletionStreamResponse,
        )
        from vllm.entrypoints.serve.utils.api_utils import should_include_usage

        req, n = job.req, job.params[0].n
        echo_only = req.echo and req.max_tokens == 0  # the prompt alone (vLLM samples one token, returns none)

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
                                text, token_ids = job.texts[i] + sample.text, [*prompt, *sample.token_ids]
                                logprob_steps = [*steps, *(sample.logprobs or [])]
                        else:
                            if echo_only:
                                continue
                            text, token_ids, logprob_steps = sample.text, sample.token_ids, sample.logprobs
                            if (not text and not token_ids and not generated[k]
                                    and not sample.finish_reason):
                                continue  # a chunked prefill step: nothing to say yet
                        generated[k] += len(sample.token_ids)
                        logprobs = logprobs_of(token_ids, logprob_steps or [], offsets[k])
                        if logprobs is not None and logprobs.tokens:  # by the tokens, not the text (stop strings)
                            offsets[k] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                        yield _sse(CompletionStreamResponse(
                            id=response_id, object="text_completion", created=created, model=self.name,
                            choices=[CompletionResponseStreamChoice(
                                index=k, text=text, logprobs=logprobs,
                                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason, **fields)],
                            **({"usage": self.usage(len(prompt), generated[k])} if continuous else {})))
                if include_usage:
                    prompt_tokens = sum(map(len, job.prompts))
                    yield _sse(CompletionStreamResponse(
                        id=response_id, created=created, model=self.name, choices=[],
                        usage=self.usage(prompt_tokens, sum(generated), cached)), exclude_unset=False,
                        exclude_none=True)

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
                    steps = [*(prompt_logprobs or []), *s.logprobs] if req.logprobs is not None else None
                choices.append(CompletionResponseChoice(
                    index=len(choices), text=text, logprobs=logprobs_of(token_ids, steps),
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason, prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=prompt, **_generated_fields(s)))
        prompt_tokens = sum(len(job.prompts[i]) for i, _ in outputs)
        generated = sum(len(s.token_ids) for _, o in outputs for s in o.outputs)
        cached = getattr(outputs[-1][1], "num_cached_tokens", None) if outputs else None
        return _json_response(CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", model=self.name, choices=choices,
            usage=self.usage(prompt_tokens, generated, cached)))


def _refuse_non_int_token_ids(prompt) -> None:
    """pydantic would read `[true, false]` (or 1.0) as token ids [1, 0]: a prompt of ids must hold integers."""
    if not isinstance(prompt, list):
        return
    for i, p in enumerate(prompt):
        for t in (p if isinstance(p, list) else [p]):
            if not isinstance(t, str) and type(t) is not int:
                raise APIError(400, f"prompt: token ids are integers; found {json.dumps(t)} in "
                                    f"{'prompt ' + str(i) if isinstance(p, list) else 'the prompt'}", "prompt")


def _sampled_logprobs(sample) -> list:
    return [step[token].logprob for step, token in zip(sample.logprobs or (), sample.token_ids)]


def _generated_fields(sample) -> dict:
    """chatgen's fields of a sample (or of a streamed delta: its new tokens): the ids, the engine's log-prob of
    each and the weight version each was sampled under."""
    return {"token_ids": list(sample.token_ids), "generation_log_probs": _sampled_logprobs(sample),
            "generation_weight_versions": getattr(sample, "weight_versions", None)}


async def _chain(first, outputs):
    if first is None:
        return
    yield first
    async for item in outputs:
        yield item
