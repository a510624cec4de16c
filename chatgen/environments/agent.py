"""An unmodified agent program as multi-turn GRPO's environment, through the agent gateway
(chatgen.serving.gateway; docs/agents.md, "The agent gateway").

    runtime: {algorithm: {name: grpo_multiturn, agent: 'my_agents:solve', agent_timeout_s: 600}}

    def solve(base_url: str, api_key: str, task: dict) -> float | None:     # my_agents.py
        client = openai.OpenAI(base_url=base_url, api_key=api_key)          # plain SDK code
        ...
        return reward          # or None: the harness POSTs it to /sessions/{id}/reward

Per episode `AgentRunner.episode` opens a gateway session with the policy's sampling (temperature,
per-turn token limit), calls the function on a daemon thread with that session's base_url, posts the
reward it returns (None: waits for the harness to post it), and reads the session's recorded turns
back over HTTP: the gateway may run in another process (the policy's Ray actor). A session not
closed within `agent_timeout_s` is dropped (Episode.dropped: counted, none of its tokens train); an
agent that raises after its first request ends its episode with reward 0 and `env/errors` 1, as a
protocol environment's failed step does; one that raises before it stops the run (nothing was
played: a bug or a config problem, said as it is).
"""

import concurrent.futures
import sys
import threading
import time

from chatgen.core.imports import import_object
from chatgen.environments.base import Episode, checked_reward


def check_name(name) -> str | None:
    """Why `name` names no agent entry point (None: it has the form; imported at start)."""
    module, _, function = str(name).partition(":")
    if not isinstance(name, str) or not module or not function:
        return (
            f"{name!r}: name the agent function as 'package.module:function' or 'file.py:function'"
        )
    return None


class AgentRunner:
    """The run's environment when runtime.algorithm.agent is set: `episode(record, temperature,
    max_tokens)` runs the agent function once, in a gateway session of its own."""

    def __init__(self, entry: str, base_url: str, api_key: str, timeout_s: float):
        from chatgen.environments import http_client

        self.entry, self.timeout_s = entry, timeout_s
        self.agent = import_object(entry, "function")
        self.root, self.api_key = base_url.removesuffix("/v1"), api_key
        self.http = http_client(timeout_s=None)
        self.http.base_url = self.root
        self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.reported = False

    def call(self, method: str, path: str, **kwargs) -> dict:
        if method != "GET":  # the app takes JSON bodies only (chatgen.serving.http.require_json)
            kwargs.setdefault("json", {})
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(
                f"agent gateway: {method} {path}: {response.status_code} {response.text}"
            )
        return response.json()

    def episode(self, record: dict, temperature: float, max_tokens: int) -> Episode:
        deadline = time.monotonic() + self.timeout_s
        sampling = {"temperature": temperature, "max_tokens": max_tokens}
        sid = self.call("POST", "/sessions", json={"sampling": sampling})["session_id"]
        done = concurrent.futures.Future()

        def target():
            try:
                done.set_result(self.agent(f"{self.root}/sessions/{sid}/v1", self.api_key, record))
            except BaseException as e:  # handed to the episode
                done.set_exception(e)

        threading.Thread(target=target, daemon=True, name=f"agent-{sid}").start()
        error = None
        try:
            reward = done.result(timeout=max(0.0, deadline - time.monotonic()))
            if reward is not None:
                reward = checked_reward(reward, self.entry)
                self.call("POST", f"/sessions/{sid}/reward", json={"reward": reward})
        except concurrent.futures.TimeoutError:
            pass  # the session is dropped below, unless the harness closed it meanwhile
        except Exception as e:
            error = e
        wait = max(0.0, deadline - time.monotonic()) if error is None else 0.0
        state = self.call("GET", f"/sessions/{sid}", params={"wait": wait})
        if error is not None and state["status"] == "open":
            if not state["turns"]:
                self.call("DELETE", f"/sessions/{sid}")
                raise RuntimeError(
                    f"runtime.algorithm.agent {self.entry} failed before its first request: {error}"
                ) from error
            self.report(error)
            state = {**state, "status": "closed", "reward": 0.0}
        final = self.call("DELETE", f"/sessions/{sid}")  # forget it, or drop it if still open
        if state["status"] == "open":
            state = final
        if state["status"] != "closed":  # dropped: not closed in time
            return Episode([], 0.0, dropped=True)
        turns = state["turns"]
        text = turns[-1]["content"] if turns else ""
        return Episode(turns, state["reward"], text, {"errors": float(error is not None)})

    def report(self, error) -> None:
        if not self.reported:  # counted in env/errors; said once
            self.reported = True
            print(f"[chatgen] agent {self.entry}: an episode failed: {error}", file=sys.stderr)
