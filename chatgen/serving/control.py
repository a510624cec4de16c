"""Control endpoints of `chatgen serve --control`: pause / resume the engine, push new weights from
a trainer, reset the prefix cache. A FastAPI router that `build_app(module, routers=[...])` mounts
behind the API key.

    POST /control/pause                 stop stepping the engine (running and new requests wait)
    POST /control/resume                step it again
    POST /control/weights/begin         {"mode": "wait", "transport": "group", "port": null, "path": null} ->
                                        group: {"transport", "host", "port", "token"}: the server opens the
                                        rendezvous of a private 2-member torch.distributed group (gloo on CPU, NCCL
                                        on GPU) and waits there for one weight sync, which must prove `token` (a
                                        one-time secret of this begin: chatgen.param_sync.group); a client that
                                        gives the port of the group it already holds keeps using it.
                                        shm (a trainer on this machine): {"transport", "path"}: the file in the
                                        server's own /dev/shm directory the trainer writes the weights into; a
                                        client that gives the path it holds mapped keeps using it
        ... group: the trainer sends the weights over the group, in buckets: chatgen.param_sync.GroupSender
            shm: the trainer writes them into the file: chatgen.param_sync.ShmSender
    POST /control/weights/finish        group: no body; shm: {"header": ...} once the file is written ({"error":
                                        why} if the trainer stopped) -> {"weight_version", "tensors", "bytes",
                                        "seconds"} once the weights are in the engine, or 409 with the error
                                        (which says whether the engine kept its weights). A group update still
                                        running is stopped (finish answers within seconds).
    POST /control/reset_prefix_cache    -> {"reset": bool} (false while running requests hold cache blocks)

The trainer's side is `VLLMGeneration(mode="server")` (chatgen/generation/standalone.py). The
transfer is one of chatgen.param_sync's cross-process transports (`GroupReceiver.listen()`,
`ShmReceiver`): the trainer's manifest is checked against the engine before anything is written, the
engine checks every value for NaN / inf itself, and the write goes through `module.load_weights` in
`mode` (wait / keep / recompute / abort, see GenerationModule.load_weights). The group, or the
mapped file, stays open between the updates of one client; another client gets a new one. Every
control endpoint changes what the server computes, so beyond loopback it needs an API key: the
router refuses to be built for a non-loopback bind without one; the weight channels it opens are
authenticated too (the group by begin's one-time token, the shm file by the 0700 directory only the
server's user can write; its directory is named with the server's pid, and a server removes at start
the directories that killed servers of its user left, and its own at exit). No update locks out the
next: every step has a deadline (`timeout`), after which the update is given up and the engine keeps
its old weights (or, stopped mid-load, refuses to generate until the next complete sync).
"""

import asyncio
import threading
import time
from typing import Literal

from chatgen.core.imports import require

require("fastapi", "the weight-update endpoints (chatgen serve --control)")

from fastapi import APIRouter, Depends, Request  # noqa: E402
from pydantic import BaseModel, ConfigDict

from chatgen.core.distributed import LOOPBACK_HOSTS
from chatgen.generation.base import UPDATE_MODES
from chatgen.param_sync import GroupReceiver, ShmReceiver, remove_stale_segments
from chatgen.serving.app import APIError, api_key_dependency

DEFAULT_TIMEOUT_S = (
    120.0  # `chatgen serve --control-timeout`: the server's patience at each step of an update
)
STOP_WAIT_S = 5.0  # how long finish waits for a stopped update to wind down before it answers


class BeginRequest(BaseModel):
    mode: Literal[UPDATE_MODES] = "wait"  # VLLMModule.update_weights' modes
    transport: Literal["group", "shm"] = "group"
    port: int | None = (
        None  # group: the group the client holds from an earlier update; reused when still the server's
    )
    path: str | None = (
        None  # shm: the file the client holds mapped from an earlier update; reused likewise
    )


# chatgen.param_sync.sync_header: what the trainer sends before the data
class WeightHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: str
    buckets: list[list[tuple[str, list[int]]]]
    nonfinite: list[str]
    validated: bool = False
    fingerprints: dict[str, list[int]] | None = None
    adapter: dict | None = None  # a LoRA adapter alone: its adapter_config.json


# shm only: the header once the file is written, or why the trainer stopped
class FinishRequest(BaseModel):
    header: WeightHeader | None = None
    error: str | None = None


class _WeightUpdates:
    """The update in progress, if any, and what carries the weights: a group receiver (rendezvous
    + group, opened at a client's first group update) or a shared-memory receiver (its /dev/shm
    directory, made at the first shm update, removed when the server exits).

    No update can hold the slot for longer than its deadlines: a group update's thread gives up
    when the trainer keeps it waiting `timeout` seconds at any step (connecting, the manifest, a
    bucket, the end), a shm update whose trainer did not finish within `timeout` seconds of its
    begin gives way to the next begin, and finish stops an update that is still running (at once
    while it waits; between buckets mid-stream)."""

    def __init__(self, module, host: str, timeout: float):
        self.module, self.host, self.timeout = module, host, timeout
        self.receiver = self.shm = None
        self.pending = None  # {"transport": "group", "thread", "result", "stop"}, or "shm" with "mode", "until"
        self.stopping = None  # the thread of a stopped group update, while it winds down
        self.lock = threading.Lock()
        self.finishing = threading.Lock()
        remove_stale_segments()  # what an earlier server of this user left when it was killed mid-update

    def begin(self, body: BeginRequest) -> dict:
        with self.lock:
            pending = self.pending
            if (
                pending is not None
                and pending["transport"] == "group"
                and not pending["thread"].is_alive()
            ):
                pending = None  # ended (done, refused, or past a deadline) and never finished: its slot is free
            if (
                pending is not None
                and pending["transport"] == "shm"
                and time.monotonic() > pending["until"]
            ):
                self.shm.drop()  # a shm update whose trainer never finished it
                pending = None
            if pending is not None:
                raise APIError(
                    409,
                    "a weight update is already in progress: finish it (POST /control/weights/finish),"
                    f" or wait: it ends when its trainer keeps it waiting {self.timeout:g} s",
                )
            if self.stopping is not None and self.stopping.is_alive():
                raise APIError(
                    409,
                    "the weight update stopped by the last finish is still winding down (its "
                    "channel's last operation times out within seconds); begin again shortly",
                )
            if body.transport == "shm":
                if self.shm is None:
                    self.shm = ShmReceiver()
                self.pending = {
                    "transport": "shm",
                    "mode": body.mode,
                    "until": time.monotonic() + self.timeout,
                }
                return {"transport": "shm", "path": self.shm.name(body.path)}
            if self.receiver is None or self.receiver.closed or self.receiver.port != body.port:
                # a new client: a new group (and the old one's rendezvous closed)
                if self.receiver is not None:
                    self.receiver.close()
                self.receiver = GroupReceiver.listen(self.host, timeout=self.timeout)
            # one-time: only the caller of this begin can send this update
            token = self.receiver.new_token()
            result, stop = {}, threading.Event()
            thread = threading.Thread(
                target=self._receive,
                args=(self.receiver, body.mode, result, stop),
                name="chatgen-weight-update",
                daemon=True,
            )
            self.pending = {"transport": "group", "thread": thread, "result": result, "stop": stop}
            thread.start()
            return {"transport": "group", "port": self.receiver.port, "token": token}

    def _receive(self, receiver, mode: str, result: dict, stop: threading.Event) -> None:
        try:
            result["report"] = receiver.receive_into(
                self.module, alive=lambda: not stop.is_set(), mode=mode
            )
        except Exception as e:  # refused, failed, or past a deadline: handed to finish
            result["error"] = f"{type(e).__name__}: {e}"

    def finish(self, body: FinishRequest | None) -> dict:
        with self.finishing:  # one finish at a time: a second one then finds nothing in progress
            with self.lock:
                pending = self.pending
            if pending is None:
                raise APIError(
                    409,
                    "no weight update in progress: begin one first (POST /control/weights/begin)",
                )
            result = {}
            if pending["transport"] == "group":
                thread, result = pending["thread"], pending["result"]
                # the trainer's own finish comes once its send returned: done by now
                thread.join(STOP_WAIT_S)
                # a finish by hand, or a trainer that gave up: stop the update
                if thread.is_alive():
                    pending["stop"].set()
                    thread.join(STOP_WAIT_S)
                # inside one last operation of the channel, which ends at its deadline
                if thread.is_alive():
                    self.stopping = thread
                    result = {
                        "error": "the weight update was stopped; the engine keeps its old weights unless it "
                        "had begun loading them (then it refuses to generate until the next complete "
                        f"sync: needs_resync = {self.module.needs_resync!r})"
                    }
            elif body is None or (body.header is None) == (body.error is None):
                raise APIError(
                    400,
                    'a shared-memory weight update finishes with {"header": ...} once the file is '
                    'written, or {"error": ...} when the trainer stopped; the update is still open',
                )
            elif body.error is not None:
                self.shm.drop()
                result["error"] = (
                    f"the trainer stopped before the weights were written, the engine keeps its old "
                    f"weights: {body.error}"
                )
            else:
                try:
                    result["report"] = self.shm.receive_into(
                        self.module, pending["mode"], header=body.header.model_dump()
                    )
                except Exception as e:  # the receiver dropped the file
                    result["error"] = f"{type(e).__name__}: {e}"
            with self.lock:
                if self.pending is pending:
                    self.pending = None
            if "error" in result:
                raise APIError(409, result["error"])
            report = result["report"]
            return {
                "weight_version": self.module.weight_version,
                "tensors": report.tensors,
                "bytes": report.bytes,
                "seconds": report.seconds,
            }


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError unless the control endpoints may run on `host`: beyond loopback only with an
    API key."""
    if api_key is None and host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"--control on --host {host} without an API key: anyone who reaches the port could replace "
            "the model's weights; set CHATGEN_API_KEY (or --api-key-file), or bind 127.0.0.1"
        )


def control_router(
    module, *, api_key: str | None, host: str, timeout: float = DEFAULT_TIMEOUT_S
) -> APIRouter:
    """The control endpoints for `module` (a started generation module, chatgen.generation.base)
    served on `host`.

    With api_key set, every endpoint needs `Authorization: Bearer <api_key>` (401 otherwise).
    Without one the server must bind loopback only: a ValueError refuses a non-loopback `host`.
    timeout: the seconds a weight update may keep the server waiting at any step before it is given
    up (the engine then keeps its old weights, or refuses to generate until the next complete sync
    if it had begun loading).
    """
    check_bind(host, api_key)
    updates = _WeightUpdates(module, host, timeout)
    router = APIRouter(prefix="/control", dependencies=[Depends(api_key_dependency(api_key))])

    @router.post("/pause")
    async def pause():
        await asyncio.to_thread(module.pause)
        return {"paused": True}

    @router.post("/resume")
    async def resume():
        await asyncio.to_thread(module.resume)
        return {"paused": False}

    @router.post("/weights/begin")
    async def begin(request: Request, body: BeginRequest | None = None):
        answer = await asyncio.to_thread(updates.begin, body or BeginRequest())
        if answer["transport"] == "group":
            answer["host"] = host if host in LOOPBACK_HOSTS else request.url.hostname
        return answer

    @router.post("/weights/finish")
    async def finish(body: FinishRequest | None = None):
        return await asyncio.to_thread(updates.finish, body)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"reset": await asyncio.to_thread(module.reset_prefix_cache)}

    return router
