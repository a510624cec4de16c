"""One JSON POST to a peer chatgen does not control (a remote reward service), bounded in time and
size.

    body = post_json("http://127.0.0.1:8000/score", b'{"completions": []}', timeout=30.0)

The timeout bounds the whole request, start to the body's last byte, against a monotonic clock: a
socket timeout alone bounds each read, so a peer that sends a byte every few seconds would hold the
caller forever.
"""

import http.client
import socket
import threading
import time
import urllib.parse

MAX_ANSWER_BYTES = 1 << 20  # a reward service's answer: a list of numbers, far below this


class RedirectRefused(ValueError):
    """A 3xx answer while redirects are not followed."""


class HTTPStatusError(OSError):
    def __init__(self, status: int, reason: str):
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


def post_json(url: str, data: bytes, timeout: float, follow_redirects: bool = False) -> bytes:
    """POST `data` (JSON) to `url` and return the answer's body, all of it within `timeout`
    seconds of wall-clock time (a monotonic deadline; a timer shuts the socket at it, so an
    answer trickling a byte at a time ends there too: TimeoutError). The body is read up to
    MAX_ANSWER_BYTES (ValueError past it); a 3xx is an error naming its target unless
    `follow_redirects` (then up to 5 http(s) hops under the same deadline); a 4xx / 5xx is
    HTTPStatusError."""
    deadline = time.monotonic() + timeout
    for _ in range(6):
        parts = urllib.parse.urlsplit(url)
        left = deadline - time.monotonic()
        if left <= 0 or parts.scheme not in ("http", "https") or not parts.hostname:
            raise (TimeoutError if left <= 0 else ValueError)(
                f"{url}: past the deadline or not http(s)"
            )
        kind = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        conn = kind(parts.hostname, parts.port, timeout=left)
        cut = threading.Timer(left, _shut, (conn,))
        cut.daemon = True
        try:
            conn.connect()
            cut.args = (conn.sock,)  # its own reference: an HTTP/1.0 answer takes it from conn
            cut.start()
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if 300 <= response.status < 400:
                target = urllib.parse.urljoin(url, response.getheader("Location") or "")
                if not follow_redirects:
                    raise RedirectRefused(
                        f"redirected ({response.status}) to {target}; set follow_redirects: true to "
                        "follow it, or give that URL"
                    )
                url = target
                continue
            if response.status >= 400:
                raise HTTPStatusError(response.status, response.reason)
            length = int(response.getheader("Content-Length") or 0)
            body = response.read(MAX_ANSWER_BYTES + 1) if length <= MAX_ANSWER_BYTES else b""
            if time.monotonic() >= deadline:  # cut at the deadline: an answer read to its end
                raise TimeoutError(f"no complete answer within {timeout:g} s")
            if length > MAX_ANSWER_BYTES or len(body) > MAX_ANSWER_BYTES:
                raise ValueError(f"answered over {MAX_ANSWER_BYTES} bytes")
            return body
        except (OSError, http.client.HTTPException) as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no complete answer within {timeout:g} s") from None
            raise e if isinstance(e, OSError) else ConnectionError(f"{type(e).__name__}: {e}")
        finally:
            cut.cancel()
            conn.close()
    raise ValueError(f"more than 5 redirects from {url}")


def _shut(sock) -> None:
    """Unblock a read of `sock` from another thread (its request's deadline passed)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
