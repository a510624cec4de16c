"""A remote reward service chatgen does not control is bounded: the whole answer within `timeout`
seconds (a service trickling a byte at a time included), its size, redirects refused unless
`follow_redirects`, and a request stuck in a read never holds the process's exit. Real HTTP servers
on loopback (issue 50, findings 2, 5 and 14).

    pytest tests/unit/test_remote_reward_bounds.py
"""

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatgen.core.http_post import MAX_ANSWER_BYTES
from chatgen.rlhf.rewards import Rewards

REPO = Path(__file__).resolve().parents[2]


class Service(http.server.BaseHTTPRequestHandler):
    """`mode` (class attribute): ok (len of each completion), trickle (headers, then a byte every
    0.4 s), huge (2 MiB), redirect (303 to `target`)."""

    mode, target = "ok", ""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Service.mode == "redirect":
            self.send_response(303)
            self.send_header("Location", Service.target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        out = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
        if Service.mode == "huge":
            out = b" " * (2 * MAX_ANSWER_BYTES) + out
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if Service.mode != "trickle":
            self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if Service.mode == "trickle":
            try:
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.4)
            except OSError:  # the client gave up
                return
        self.wfile.write(out)

    def do_GET(self):  # where a 303 sends a client that follows it
        out = json.dumps({"rewards": [9.0, 9.0]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    servers = []
    for _ in range(2):  # the second: where a redirect points
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Service)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    Service.mode = "ok"
    urls = [f"http://127.0.0.1:{s.server_address[1]}/score" for s in servers]
    yield urls
    for server in servers:
        server.shutdown()
        server.server_close()


def score(url: str, **term) -> dict:
    reward = Rewards({"terms": {"remote": {"url": url, "retries": 0, **term}}}).start()
    try:
        return reward.score({"texts": ["a", "bb"], "answer": ["1", "2"]})
    finally:
        reward.shutdown()


def test_a_trickling_answer_ends_at_the_request_deadline(service):
    """Finding 2: the timeout bounded each socket read, so a byte every 2 s held the run forever."""
    Service.mode = "trickle"
    result, start = {}, time.monotonic()

    def call():
        try:
            score(service[0], timeout=1.5)
        except ConnectionError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), "the request outlived its deadline by over 13 s"
    assert time.monotonic() - start < 6
    assert "TimeoutError: no complete answer within 1.5 s" in result["error"]


def test_a_redirect_is_refused_unless_allowed_and_a_huge_answer_is_cut(service):
    """Findings 5 and 14: a redirect to any host was followed and its answer taken as rewards; an
    answer was read whole into memory."""
    Service.mode, Service.target = "redirect", service[1]
    with pytest.raises(ConnectionError, match=f"redirected \\(303\\) to {service[1]}"):
        score(service[0])
    # allowed: the target's answer (the same handler, answering ok once the mode changes back)
    Service.mode = "ok"
    assert score(service[0], follow_redirects=True)["rewards"].tolist() == [1.0, 2.0]
    Service.mode = "huge"
    with pytest.raises(ConnectionError, match=f"answered over {MAX_ANSWER_BYTES} bytes"):
        score(service[0])


def test_a_request_stuck_in_a_read_does_not_hold_the_exit(service):
    """Finding 2: the reward pool's threads were joined at exit, so a process whose reward hung
    never exited (after SIGTERM printed 'stopped cleanly')."""
    Service.mode = "trickle"
    code = (
        "import threading, time, sys\n"
        "from chatgen.rlhf.rewards import Rewards\n"
        f"r = Rewards({{'terms': {{'x': {{'url': {service[0]!r}, 'timeout': 300}}}}}}).start()\n"
        "threading.Thread(target=r.score, args=({'texts': ['a']},), daemon=True).start()\n"
        "time.sleep(1.5)\n"
        "print('leaving', flush=True)\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert time.monotonic() - start < 60  # the import of torch and chatgen, then out at once
