"""The OpenAI-compatible HTTP app over a started generation module (FastAPI; `chatgen serve` runs it
with uvicorn).

    app = build_app(module, api_key="KEY")                       # module: a started VLLMModule
    app = build_app(module, api_key="KEY", routers=[control])    # more endpoints behind the same key
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions and /v1/completions (streaming or
not), POST /tokenize and /detokenize. Requests and responses are vLLM's OpenAI protocol models, and
a request is read the way vLLM's own server reads it: its sampling parameters by the protocol's
`to_sampling_params`, its prompt's length limits and truncation by the protocol's `TokenizeParams`,
the token strings of log-probs by vLLM's `convert_ids_list_to_tokens`; docs/serving.md lists what
still differs. Every request is one `module.stream` call (the generation contract,
chatgen.generation.base), so requests run together in the engine (continuous batching) and a weight
update (`module.load_weights`) lands between two engine steps.

Beyond vLLM's fields, each chat choice's `message` carries `prompt_token_ids`,
`generation_token_ids`, `generation_log_probs` and `generation_weight_versions` (completion choices:
`prompt_token_ids`, `token_ids`, ...; streamed chunks: the same for their new tokens); a chat
request may give `required_prefix_token_ids` (or carry them on its last assistant message as
`prompt_token_ids` + `generation_token_ids`), and its prompt then begins with exactly those ids
(chatgen.generation.chat_tokens).

Bad requests get a 4xx with an OpenAI-style error body (vLLM's message for what vLLM validates: its
client-error type is answered in one handler); bodies over `max_request_bytes` get 413 before they
are parsed; parsing and tokenizing run on a worker thread, so a huge request never stalls /health or
the streams of others.

Next to it: chatgen.serving.endpoints (the generating endpoints), chatgen.serving.responses (the
answers' shapes), chatgen.serving.http (error bodies, guards, middleware), chatgen.serving.requests
(a request read and tokenized into a Job).
"""

from chatgen.core.imports import require

require("fastapi", "the OpenAI server (chatgen serve, chatgen.serving)")
require("vllm", "the OpenAI server (its request and response schemas are vLLM's)")

from fastapi import APIRouter, Depends, FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from chatgen.serving.endpoints import OpenAIServer

# DEFAULT_MAX_REQUEST_BYTES, APIError, api_key_dependency, ...: importable from here too
from chatgen.serving.http import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,  # noqa: F401
    BodyLimit,
    HostCheck,
    api_key_dependency,
    cancel_on_disconnect,
    error_response,
    require_json,
)
from chatgen.serving.requests import pydantic_errors
from chatgen.serving.responses import json_response
from chatgen.serving.tool_calls import ToolCalls


def build_app(
    module,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    routers=(),
    max_request_bytes: int | None = None,
    allowed_hosts=(),
    tool_call_parser: str | None = None,
    gateway=None,
) -> FastAPI:
    """The FastAPI app serving `module` (a started VLLMModule) under `model_name` (default: its
    `load` path).

    api_key: when set, every endpoint (also those of `routers`) needs `Authorization: Bearer
    <api_key>`, and the interactive docs (/docs, /redoc, /openapi.json) are off (a browser cannot
    send the key). routers: more `fastapi.APIRouter`s to mount (e.g. weight-update control
    endpoints); they can reach the module as `request.app.state.module`. max_request_bytes: a larger
    request body is answered 413 without being read (None: 16 MiB). allowed_hosts: names clients may
    give in the Host header beyond IP addresses, localhost and this machine's names ("*": any;
    `HostCheck`). A POST must be JSON (`require_json`). tool_call_parser: vLLM's tool-call parser by
    name (`--tool-call-parser`; chatgen.serving.tool_calls): chat replies are parsed into
    `tool_calls` (None: `tool_choice` other than "none" is a 400). gateway: a
    chatgen.serving.gateway.Gateway: chat completions are recorded per agent session, and one
    without a session id is a 400 (the agent gateway, docs/agents.md).
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
    server = OpenAIServer(module, name)
    if tool_call_parser is not None:
        server.tool_calls = ToolCalls(tool_call_parser, module.tokenizer)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(VLLMClientError)
    # what vLLM validates, answered with vLLM's message
    async def vllm_client_error(request, e: VLLMClientError):
        error = create_error_response(e)
        return JSONResponse(error.model_dump(), error.error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        return error_response(400, "invalid request: " + pydantic_errors(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    # a bug, not the client's fault: say so, keep serving
    async def internal_error(request, e: Exception):
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

        return json_response(
            ModelList(
                data=[
                    ModelCard(
                        id=name,
                        owned_by="chatgen",
                        root=str(module.config.load),
                        max_model_len=module.config.seq_length,
                    ),
                    *[  # served LoRA adapters (chatgen serve --lora-modules), as vLLM lists them
                        ModelCard(id=n, owned_by="chatgen", root=r.lora_path, parent=name)
                        for n, r in getattr(module, "lora_adapters", {}).items()
                    ],
                ]
            )
        )

    @router.post("/tokenize")
    @cancel_on_disconnect
    async def tokenize(request: Request):
        return json_response(await server.off_loop(server.tokenize, await request.body()))

    @router.post("/detokenize")
    @cancel_on_disconnect
    async def detokenize(request: Request):
        return json_response(await server.off_loop(server.detokenize, await request.body()))

    @router.post("/v1/chat/completions")
    @cancel_on_disconnect
    async def chat(request: Request):
        if gateway is not None:  # the session id in a header
            sid = request.headers.get("x-session-id")
            return await gateway.chat(server, await request.body(), sid)
        return await server.chat(await server.off_loop(server.prepare_chat, await request.body()))

    @router.post("/v1/completions")
    @cancel_on_disconnect
    async def completions(request: Request):
        return await server.completions(
            await server.off_loop(server.prepare_completion, await request.body())
        )

    app.include_router(router)
    if gateway is not None:
        app.include_router(gateway.router(server), dependencies=guards)
    for extra in routers:
        app.include_router(extra, dependencies=guards)
    return app
