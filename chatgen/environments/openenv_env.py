"""The OpenEnv adapter: an OpenEnv environment server (openenv-core's `create_app`, TRL's
environments) as a chatgen protocol environment, one WebSocket session per episode.

    runtime.algorithm.environment: openenv:http://127.0.0.1:8000        # a server already running
    runtime.algorithm.environment: openenv:package.module:app           # chatgen serves that app
    runtime.algorithm.environment_args:
      action_field: answer          # the action's field the model's text goes to (default: its one str field)
      observation_field: prompt     # the observation's field shown to the model (default: its one own field)
      startup_timeout_s: 120        # the served app must answer /health by then

`openenv:package.module:app` starts `python -m uvicorn package.module:app` on a free loopback port
once per process (no Docker), waits for `/health`, and stops it (its process group) when the
process exits. reset(record) sends the record as `reset`'s keyword arguments (the server passes an
environment the ones its `reset` declares); the observation is the user turn. Each model turn's
text is the action (`{action_field: text}`); the observation's `reward` is the turn's reward (none:
0), `done` ends the episode. A server that refuses a session (OpenEnv allows one at a time unless
the app sets `max_concurrent_envs`) stops the run at reset with the server's message.

Needs openenv-core and its light server dependencies installed `--no-deps`:
`pip install --no-deps -r requirements-verifiers.txt` (docs/agents.md says why).
"""

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from openenv.core.generic_client import GenericEnvClient

from chatgen.environments.base import (
    Environment,
    EnvironmentStepError,
    Step,
    checked_reward,
    run_async,
)

STANDARD = {"done", "reward", "metadata"}  # fields of every OpenEnv observation
_servers, _lock = {}, threading.Lock()  # target -> (url, its /schema)
_served = []  # the app servers this process started


def stop(proc: subprocess.Popen) -> None:
    """Ends the served app and anything it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@atexit.register
def stop_served() -> None:
    """Stops every app server this process started (at exit; a test may call it sooner)."""
    with _lock:
        while _served:
            stop(_served.pop())
        _servers.clear()


def serve(name: str, app: str, timeout_s: float) -> str:
    """Serves the ASGI app `app` with uvicorn on a free loopback port; its URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        command + ["--log-level", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _served.append(proc)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise ValueError(
                f"environment {name}: its server exited ({' / '.join(tail)}); name an OpenEnv "
                "app as 'package.module:app' (importable here) or a running server's http:// URL"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise ValueError(
                f"environment {name}: its server did not answer {url}/health within "
                f"{timeout_s:g} s (environment_args.startup_timeout_s)"
            )
        time.sleep(0.2)


def only(fields: list, what: str, key: str, name: str) -> str:
    if len(fields) != 1:
        raise ValueError(
            f"environment {name}: its {what} has the fields {fields}; say which one is the text "
            f"with runtime.algorithm.environment_args.{key}"
        )
    return fields[0]


def spec(target: str, action_field=None, observation_field=None, startup_timeout_s=120.0):
    """(url, action field, observation field) of `target`, its server started once per process."""
    name = f"openenv:{target}"
    with _lock:
        if target not in _servers:
            if target.startswith(("http://", "https://")):
                url = target.rstrip("/")
            else:
                url = serve(name, target, startup_timeout_s)
            try:
                schema = httpx.get(url + "/schema", timeout=30).raise_for_status().json()
            except httpx.HTTPError as e:
                raise ValueError(
                    f"environment {name}: no OpenEnv schema at {url}/schema ({e})"
                ) from e
            _servers[target] = url, schema
        url, schema = _servers[target]
    action = schema["action"].get("properties", {})
    if action_field is None:
        strings = [k for k, v in action.items() if v.get("type") == "string"]
        action_field = only(strings, "action", "action_field", name)
    elif action_field not in action:
        raise ValueError(
            f"environment {name}: environment_args.action_field {action_field!r} is not a field "
            f"of its action ({sorted(action)})"
        )
    if observation_field is None:
        own = [k for k in schema["observation"].get("properties", {}) if k not in STANDARD]
        observation_field = only(own, "observation", "observation_field", name)
    return url, action_field, observation_field


class OpenEnvEnv(Environment):
    @staticmethod
    def prepare(target: str, args: dict):
        spec(target, **args)

    def __init__(self, target: str, **args):
        self.name, self.client = f"openenv:{target}", None
        self.url, self.action_field, self.observation_field = spec(target, **args)

    def text(self, observation: dict) -> list:
        return [{"role": "user", "content": str(observation.get(self.observation_field, ""))}]

    def reset(self, record: dict) -> list:
        self.client = GenericEnvClient(base_url=self.url)
        return self.text(run_async(self.client.reset(**record)).observation)

    def step(self, message: dict) -> Step:
        action = {self.action_field: message.get("content") or ""}
        try:
            result = run_async(self.client.step(action))
        except (RuntimeError, ConnectionError, TimeoutError) as e:
            self.close()
            raise EnvironmentStepError(f"{self.name}: the server's step failed: {e}") from e
        reward = 0.0 if result.reward is None else checked_reward(result.reward, self.name)
        if result.done:
            self.close()
        observation = [] if result.done else self.text(result.observation)
        return Step(messages=observation, reward=reward, done=bool(result.done))

    def close(self, wait: bool = True):
        if self.client is not None:
            client, self.client = self.client, None
            run_async(client.disconnect(), wait)

    def __del__(self):  # an episode cut by max_turns: its session closed with it
        self.close(wait=False)
