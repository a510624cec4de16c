"""Control endpoints of `chatgen serve --control`: pause / resume the engine, push new weights from a trainer,
reset the prefix cache. A FastAPI router that `build_app(module, routers=[...])` mounts behind the API key.

    POST /control/pause                 stop stepping the engine (running and new requests wait)
    POST /control/resume                step it again
    POST /control/weights/begin         {"mode": "wait", "port": null} -> {"host", "port"}: the server opens the
                                        rendezvous of a private 2-member torch.distributed group (gloo on CPU,
                                        NCCL on GPU) and waits there for one weight sync; a client that gives the
                                        port of the group it already holds keeps using it
        ... the trainer sends the weights over that group, in buckets: chatgen.param_sync.SyncSender(host, port)
    POST /control/weights/finish        -> {"weight_version", "tensors", "bytes", "seconds"} once they are in the
                                        engine, or 409 with the error (which says whether the engine kept its weights)
    POST /control/reset_prefix_cache    -> {"reset": bool} (false while running requests hold cache blocks)

The trainer's side is `VLLMGeneration(mode="server")` (chatgen/generation/standalone.py). The transfer is the
cross-process channel of chatgen.param_sync (`SyncReceiver.receive_into`): the trainer's manifest and finiteness
are checked against the engine before anything is written, and the write goes through `module.update_weights`
in `mode` (wait / keep / recompute / abort, see VLLMModule.update_weights). The group stays open between the
updates of one client; another client gets a new one. Every control endpoint changes what the server computes,
so beyond loopback it needs an API key: the router refuses to be built for a non-loopback bind without one.
"""
import asyncio
import threading
import time
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from chatgen.distributed import LOOPBACK_HOSTS
from chatgen.generation.engine_loop import UPDATE_MODES
from chatgen.serving.app import APIError, api_key_dependency


CONNECT_TIMEOUT_S = 600  # after begin, how long the server waits for the trainer to join the group


class BeginRequest(BaseModel):
    mode: Literal[UPDATE_MODES] = "wait"  # VLLMModule.update_weights' modes
    port: int | None = None  # the group the client holds from an earlier update; reused when it is still the server's


class _WeightUpdates:
    """One receiver (rendezvous + group, opened at the first update) and the update in progress, if any."""

    def __init__(self, module, host: str):
        self.module, self.host = module, host
        self.receiver = None
        self.thread, self.result = None, None
        self.lock = threading.Lock()

    def begin(self, mode: str, port: int | None) -> int:
        from chatgen.param_sync import SyncReceiver

        with self.lock:
            if self.thread is not None:
                raise APIError(409, "a weight update is already in progress: finish it (POST /control/weights/finish)")
            if self.receiver is None or self.receiver.port != port:  # a new client: a new group
                self.receiver = SyncReceiver(self.host)
            self.result = {}
            self.thread = threading.Thread(target=self._receive, args=(mode,), name="chatgen-weight-update",
                                           daemon=True)
            self.thread.start()
            return self.receiver.port

    def _receive(self, mode: str) -> None:
        try:
            deadline = time.monotonic() + CONNECT_TIMEOUT_S  # a client that never connects frees the slot
            self.result["report"] = self.receiver.receive_into(self.module, alive=lambda: time.monotonic() < deadline,
                                                               mode=mode)
        except Exception as e:  # refused or failed: handed to finish
            self.result["error"] = f"{type(e).__name__}: {e}"

    def finish(self) -> dict:
        with self.lock:
            thread = self.thread
        if thread is None:
            raise APIError(409, "no weight update in progress: begin one first (POST /control/weights/begin)")
        thread.join()
        with self.lock:
            self.thread, result = None, self.result
        if "error" in result:
            raise APIError(409, result["error"])
        report = result["report"]
        return {"weight_version": self.module.weight_version, "tensors": report.tensors, "bytes": report.bytes,
                "seconds": report.seconds}


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError unless the control endpoints may run on `host`: beyond loopback only with an API key."""
    if api_key is None and host not in LOOPBACK_HOSTS:
        raise ValueError(f"--control on --host {host} without --api-key: anyone who reaches the port could replace "
                         "the model's weights; set --api-key, or bind 127.0.0.1")


def control_router(module, *, api_key: str | None, host: str) -> APIRouter:
    """The control endpoints for `module` (a started VLLMModule) served on `host`.

    With api_key set, every endpoint needs `Authorization: Bearer <api_key>` (401 otherwise). Without one the
    server must bind loopback only: a ValueError refuses a non-loopback `host`.
    """
    check_bind(host, api_key)
    from chatgen.generation import vllm_adapter

    loop = module.engine_loop
    updates = _WeightUpdates(module, host if host in LOOPBACK_HOSTS else "0.0.0.0")
    router = APIRouter(prefix="/control", dependencies=[Depends(api_key_dependency(api_key))])

    @router.post("/pause")
    async def pause():
        await asyncio.to_thread(loop.pause)
        return {"paused": True}

    @router.post("/resume")
    async def resume():
        await asyncio.to_thread(loop.resume)
        return {"paused": False}

    @router.post("/weights/begin")
    async def begin(request: Request, body: BeginRequest | None = None):
        body = body or BeginRequest()
        port = await asyncio.to_thread(updates.begin, body.mode, body.port)
        return {"host": host if host in LOOPBACK_HOSTS else request.url.hostname, "port": port}

    @router.post("/weights/finish")
    async def finish():
        return await asyncio.to_thread(updates.finish)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"reset": await asyncio.to_thread(loop.call, lambda: vllm_adapter.reset_prefix_cache(module.engine))}

    return router
