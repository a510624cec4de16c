"""The HTTP layer of the OpenAI server (chatgen.serving.app): the error body every refusal answers
with, the API key and JSON-only guards, the middleware that refuses an oversized body or a foreign
Host before anything is read, and the cancelling of a request whose client left.
"""

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import json
import socket

from fastapi import Request
from fastapi.responses import JSONResponse

# a 128k-token prompt is ~1 MB of text; a batch of token-id prompts ~7 B/id
DEFAULT_MAX_REQUEST_BYTES = 16 << 20


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "code"}}` with HTTP
    `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param=None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, param=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status)


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency that refuses (401) requests without `Authorization: Bearer
    <api_key>`; a no-op when api_key is None. `build_app` puts it on every route, including those
    of `routers`."""

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                "the key the server was started with (--api-key)",
            )

    return require_api_key


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app reads
    any of it (by its Content-Length, or as its chunks arrive), so an oversized request costs
    neither parsing nor memory."""

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
        body = json.dumps(
            error_body(
                413,
                f"the request body has {size} bytes, over this server's limit of "
                f"{self.limit} bytes; send less per request (e.g. fewer prompts), or "
                "start the server with a larger --max-request-bytes",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def require_json(request: Request) -> None:
    """A FastAPI dependency (after the API key's) on every route: a request with a body (any
    method but GET and HEAD) must be `Content-Type: application/json`, 415 otherwise. A web page
    can send text/plain, a form or no type at all to any server without asking it first; JSON it
    cannot without a CORS preflight, which this server never approves (it sends no CORS headers)."""
    if request.method in ("GET", "HEAD"):
        return
    given = request.headers.get("content-type")
    if (given or "").split(";")[0].strip().lower() != "application/json":
        gave = f"this request gave {given!r}" if given else "none given"
        raise APIError(
            415,
            f"{request.method} requests take a JSON body: send the header "
            f"'Content-Type: application/json' ({gave}), even with an empty "
            "body {}",
        )


class HostCheck:
    """ASGI middleware: the `Host` header must be an IP address or a name of this server (400
    otherwise, before anything else is read). DNS rebinding points a web page's own name at
    127.0.0.1: its requests then reach a server on the user's machine, carrying that name. Names:
    localhost, this machine's host names and `allowed_hosts`; "*" accepts any (behind a proxy
    that checks the name itself)."""

    def __init__(self, app, allowed_hosts=()):
        self.app = app
        names = {"localhost", socket.gethostname(), socket.getfqdn(), *allowed_hosts}
        self.names = None if "*" in names else {n.lower().rstrip(".") for n in names}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.names is not None:
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            problem = host is not None and self.problem(host.decode("latin-1").strip())
            if problem:
                return await error_response(400, problem)(scope, receive, send)
        return await self.app(scope, receive, send)

    def problem(self, host: str) -> str | None:
        name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
        try:
            ipaddress.ip_address(name)
            return None
        except ValueError:
            pass
        if name.lower().rstrip(".") in self.names:
            return None
        return (
            f"Host {host!r} is not a name of this server (an IP address, localhost, this "
            "machine's name or one of --allowed-hosts); behind a proxy, start the server with "
            f"--allowed-hosts {name} (or '*' if the proxy checks the name itself)"
        )


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
