"""The bounds of one HTTP connection to a chatgen server, and the uvicorn config that carries them.

    server = uvicorn.Server(uvicorn_config(app))          # `chatgen serve`, EmbeddedServer
    server.run(sockets=[sock])

A request's head (request line + headers) may hold at most `MAX_HEAD_BYTES` bytes (431 and the
connection closed past it, before the headers are parsed or the API key checked) and must arrive
within `HEAD_TIMEOUT_S` of the connection opening or of the previous response (slowloris); a
connection idle after a response closes after `IDLE_TIMEOUT_S`; on SIGTERM, requests still running
after `SHUTDOWN_GRACE_S` are cancelled (their engine requests aborted), so the process exits in
bounded time whatever its clients do. uvicorn's httptools parser has no head limit of its own (h11
has one): `LimitedHttpTools` adds both bounds.
"""

import uvicorn

MAX_HEAD_BYTES = 64 << 10  # nginx allows 4 x 8 KiB; an API key or a JWT is well under 8 KiB
HEAD_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 5  # uvicorn's default keep-alive
SHUTDOWN_GRACE_S = 10.0  # `chatgen serve --shutdown-timeout`


def _limited_httptools():
    """uvicorn's httptools protocol, the head bounded in size and time (None without httptools)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol, bounded by h11's own limit
        return None

    class LimitedHttpTools(HttpToolsProtocol):
        """Counts the bytes a request's head takes, feeding the parser no further than
        `MAX_HEAD_BYTES`; closes a connection whose head does not arrive within `HEAD_TIMEOUT_S`."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._in_head, self._head_timer = 0, True, None
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._in_head and self._head_bytes + len(data) > MAX_HEAD_BYTES:
                budget = MAX_HEAD_BYTES - self._head_bytes
                super().data_received(data[:budget])  # the head may end within it (a body follows)
                if self._in_head:
                    return self._refuse_head()
                if self.transport.is_closing():
                    return
                data = data[budget:]
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # a pipelined request's head may follow in the same data

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

        def _head_timeout(self) -> None:
            if self._in_head and not self.transport.is_closing():
                self.transport.close()

        def _refuse_head(self) -> None:
            body = (
                f"the request's headers exceed this server's limit of {MAX_HEAD_BYTES} bytes; "
                "send smaller headers"
            ).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            self.transport.close()

    return LimitedHttpTools


def uvicorn_config(app, shutdown_grace_s: float = SHUTDOWN_GRACE_S, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for `app` with this module's bounds (kwargs: any other uvicorn option)."""
    protocol = _limited_httptools()
    return uvicorn.Config(
        app,
        log_level="warning",
        http=protocol or "h11",
        timeout_keep_alive=IDLE_TIMEOUT_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=shutdown_grace_s,
        **kwargs,
    )
