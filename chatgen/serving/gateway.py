"""The agent gateway: the OpenAI server's chat completions, recorded per session, token-exactly, for
training an unmodified agent program (docs/agents.md, "The agent gateway").

    app = build_app(module, api_key="KEY", gateway=Gateway())  # EmbeddedServer(..., gateway=True)

    POST /sessions            {"sampling": {"temperature": 1.0, "max_tokens": 64}}
                              -> {"session_id": "s-...", "base_url": "/sessions/s-.../v1"}
    POST /sessions/{id}/v1/chat/completions     the agent's requests (base_url=HOST + base_url)
    POST /v1/chat/completions   the same, with the header X-Session-Id: {id}
    GET  /sessions/{id}/v1/models               what the SDK lists
    POST /sessions/{id}/reward  {"reward": 0.5}: closes the session (the harness)
    GET  /sessions/{id}?wait=S  the trajectory, once closed or after S seconds
    DELETE /sessions/{id}       forget a closed session; drop an open one (its later requests: 409)

Every endpoint is behind the app's API key (a reward changes what trains). A session is one linear
chat: each request must send back the previous reply's text as its last assistant message (plain
`{"role": "assistant", "content": reply}` is enough), and the gateway then starts the prompt with
the exact ids of that reply (`required_prefix_token_ids`, chatgen.generation.chat_tokens), so the
session is one token sequence whatever the text re-tokenizes to. Each turn is recorded with what the
engine returned: prompt ids (the chat template's rendering), generated ids, their log-probs and
weight versions. A session's `sampling` overrides the agent's (the policy's temperature and per-turn
limit: the trainer's log-probs assume them); the agent's model name is ignored (it names whatever
model it was written for). Streaming and n > 1 are refused with a 400 (one recorded reply per
request).
"""

import asyncio
import json
import math
import secrets

from fastapi import APIRouter, Request

from chatgen.serving.http import APIError
from chatgen.serving.requests import read_json

# sampling keys an agent may send that would make the engine sample from another distribution
# than the one the trainer's log-probs assume: dropped while a session's `sampling` is set
RESHAPING = (
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "max_completion_tokens",
)
TURN_FIELDS = (
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "generation_weight_versions",
)


class Session:
    def __init__(self, sampling: dict):
        self.sampling, self.turns, self.status, self.reward = sampling, [], "open", None
        self.busy, self.closed = False, asyncio.Event()
        self.last_messages = None  # of the request that made turns[-1]: a retry sends them again

    def state(self, sid: str) -> dict:
        return {
            "session_id": sid,
            "status": self.status,
            "reward": self.reward,
            "turns": self.turns,
        }


class Gateway:
    """The sessions of one app (all on its event loop: no locks)."""

    def __init__(self):
        self.sessions = {}

    def get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise APIError(
                404,
                f"session {sid!r} is unknown (never opened, or already fetched and deleted); "
                "open one with POST /sessions",
                "session_id",
            )
        return session

    async def chat(self, server, raw: bytes, sid: str | None):
        """A chat completion of session `sid`: the request made to continue the session's tokens,
        answered as the plain server answers it, and recorded."""
        if not sid:
            raise APIError(
                400,
                "this server records agent sessions: send chat requests to base_url "
                "http://HOST:PORT/sessions/{id}/v1 (or with the header X-Session-Id: {id}); open a "
                "session with POST /sessions",
                "session_id",
            )
        session = self.get(sid)
        if session.status != "open":
            raise APIError(
                409, f"session {sid!r} is {session.status}: it takes no more requests", "session_id"
            )
        if session.busy:
            raise APIError(
                409,
                f"session {sid!r} has a request running: a session is one linear chat; send the "
                "next request once the previous one answered, or open another session",
                "session_id",
            )
        body = read_json(raw)
        if body.get("stream"):
            raise APIError(400, "the gateway records whole replies: set stream false", "stream")
        if body.get("n") not in (None, 1):
            raise APIError(400, "a session records one reply per request: set n 1", "n")
        body["model"] = server.name
        if session.sampling:  # the agent may ask for fewer tokens, not for more
            asked = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
            for key in RESHAPING:
                body.pop(key, None)
            body.update(session.sampling)
            limits = [v for v in (session.sampling.get("max_tokens"), *asked) if type(v) is int]
            if limits:
                body["max_tokens"] = min(limits)
        # the SDK retries a request whose answer it lost (a dropped connection): the same messages
        # again, answered anew in place of the turn they made
        messages = json.dumps(body.get("messages"), sort_keys=True)
        retry = bool(session.turns) and messages == session.last_messages
        before = session.turns[:-1] if retry else session.turns
        if before:
            body["required_prefix_token_ids"] = self.prefix(sid, before[-1], body.get("messages"))
        session.busy = True
        try:
            job = await server.off_loop(server.prepare_chat, json.dumps(body).encode())
            response = await server.chat(job)
        finally:
            session.busy = False
        message = json.loads(response.body)["choices"][0]["message"]
        if session.status == "open":  # not dropped meanwhile
            turn = {key: message.get(key) for key in TURN_FIELDS}
            session.turns = [*before, {**turn, "content": message.get("content") or ""}]
            session.last_messages = messages
        return response

    @staticmethod
    def prefix(sid: str, last: dict, messages) -> list:
        """The previous turn's prompt + generated ids, which this request's prompt begins with; a
        409 when the request does not continue that turn."""
        assistant = [
            m for m in messages or [] if isinstance(m, dict) and m.get("role") == "assistant"
        ]
        content = assistant[-1].get("content") if assistant else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content != last["content"]:
            raise APIError(
                409,
                f"session {sid!r}: this request does not continue the session's last reply (its "
                "last assistant message must be that reply's text, unchanged); a session is one "
                "linear chat: open another session for another chat",
                "messages",
            )
        return last["prompt_token_ids"] + last["generation_token_ids"]

    def router(self, server) -> APIRouter:
        router = APIRouter()

        @router.post("/sessions")
        async def open_session(request: Request):
            raw = await request.body()
            body = read_json(raw) if raw else {}
            sid = body.get("session_id") or f"s-{secrets.token_hex(8)}"
            if not isinstance(sid, str) or "/" in sid:
                raise APIError(400, "session_id: a string without '/'", "session_id")
            if sid in self.sessions:
                raise APIError(409, f"session {sid!r} exists; choose another id", "session_id")
            sampling = body.get("sampling") or {}
            if not isinstance(sampling, dict):
                raise APIError(
                    400, "sampling: an object such as {temperature, max_tokens}", "sampling"
                )
            self.sessions[sid] = Session(sampling)
            return {"session_id": sid, "base_url": f"/sessions/{sid}/v1"}

        @router.post("/sessions/{sid}/v1/chat/completions")
        async def session_chat(sid: str, request: Request):
            return await self.chat(server, await request.body(), sid)

        @router.get("/sessions/{sid}/v1/models")
        async def session_models(sid: str):
            self.get(sid)
            return {"object": "list", "data": [{"id": server.name, "object": "model"}]}

        @router.post("/sessions/{sid}/reward")
        async def reward(sid: str, request: Request):
            session = self.get(sid)
            value = read_json(await request.body()).get("reward")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise APIError(400, f"reward: a finite number, got {value!r}", "reward")
            if session.status != "open":
                raise APIError(409, f"session {sid!r} is already {session.status}", "session_id")
            session.status, session.reward = "closed", float(value)
            session.closed.set()
            return {"session_id": sid, "status": "closed", "turns": len(session.turns)}

        @router.get("/sessions/{sid}")
        async def trajectory(sid: str, wait: float = 0.0):
            session = self.get(sid)
            if session.status == "open" and wait > 0:
                try:
                    await asyncio.wait_for(session.closed.wait(), wait)
                except TimeoutError:
                    pass
            return session.state(sid)

        @router.delete("/sessions/{sid}")
        async def delete(sid: str):
            session = self.get(sid)
            state = session.state(sid)
            if session.status == "open":  # kept, so that its agent's late requests get a 409
                session.status = state["status"] = "dropped"
                session.turns = []
                session.closed.set()
            else:
                del self.sessions[sid]
            return state

        return router
