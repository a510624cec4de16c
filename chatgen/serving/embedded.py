"""An OpenAI server over a module of this process, on a daemon thread: how an RLHF run hands its
policy to environments that chat with it over HTTP (docs/multiturn_rl.md), and how a script serves
the model it holds.

    server = EmbeddedServer(module, api_key="KEY")    # a started generation module; binds 127.0.0.1, a free port
    client = openai.OpenAI(base_url=server.url, api_key="KEY")
    server.close()

The app is chatgen.serving.app's (the same endpoints as `chatgen serve`); requests join the module's
engine loop alongside its other calls.
"""

import errno
import socket
import threading
import time

from chatgen.core.imports import require

require("uvicorn", "the embedded OpenAI server (chatgen.serving.embedded)")

import uvicorn  # noqa: E402

from chatgen.serving.app import build_app  # noqa: E402
from chatgen.serving.gateway import Gateway  # noqa: E402
from chatgen.serving.limits import uvicorn_config  # noqa: E402

START_TIMEOUT_S = 60


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one), for uvicorn's `run(sockets=[...])`:
    taken before an engine loads, so that a port in use (or a host that is not an address of this
    machine) is an OSError naming it right away, and the port cannot be taken by anyone else
    meanwhile."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise OSError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    # a restart while old connections linger
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(
                f"--port {port}: {host}:{port} is in use (another server?); choose another port, or "
                "--port 0 for a free one"
            ) from None
        raise OSError(f"--host {host}: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class EmbeddedServer:
    """uvicorn serving `build_app(module, ...)` from a daemon thread. `url` is
    `http://HOST:PORT/v1` (for `openai.OpenAI(base_url=...)`); port 0 picks a free port. Binds to
    loopback unless `host` says otherwise. tool_call_parser: vLLM's parser name
    (chatgen.serving.tool_calls): replies carry parsed `tool_calls`. gateway: record chat
    completions per agent session (chatgen.serving.gateway)."""

    def __init__(
        self,
        module,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_name: str | None = None,
        tool_call_parser: str | None = None,
        gateway: bool = False,
    ):
        app = build_app(
            module,
            api_key=api_key,
            model_name=model_name,
            tool_call_parser=tool_call_parser,
            gateway=Gateway() if gateway else None,
        )
        sock = listen(host, port)
        self._server = uvicorn.Server(uvicorn_config(app))
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"{getattr(module, 'name', 'model')}-server",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                sock.close()
                raise RuntimeError(
                    f"the OpenAI server did not start on {host}:{sock.getsockname()[1]}"
                )
            time.sleep(0.01)
        self.url = f"http://{host}:{sock.getsockname()[1]}/v1"

    def close(self) -> None:
        """Stop serving (requests in flight end); safe to call twice."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
