"""Environments of multi-turn RL, named by `runtime.algorithm.environment` (docs/agents.md):

    calculator                the built-in sort-digits + calculator chat (configs/grpo_multiturn_tiny.yaml)
    tool_math                 chat arithmetic with a `python` tool run in chatgen.sandbox
    search                    Search-R1-style questions with a local BM25 `search` tool (bm25s)
    gymnasium:ENV_ID          a gymnasium environment with text observations and actions (extra: gymnasium)
    verifiers:ENV_ID          a verifiers environment (vf.load_environment's id; extra: verifiers)
    openenv:URL | openenv:package.module:app
                              an OpenEnv environment server, running or served by chatgen (extra: openenv)
    package.module:Object     your own: a protocol environment class or factory (reset / step), or a
                              class with `episode(record, temperature, max_tokens)` (docs/multiturn_rl.md)

An unmodified agent program (`runtime.algorithm.agent: 'package.module:function'`) plays its episodes
itself through the agent gateway: chatgen.environments.agent.

Protocol environments are played by `Runner` (chatgen.environments.base.play) over the policy's
OpenAI endpoint; an adapter's library is imported only when a config names it.
"""

import sys

from chatgen.core.imports import import_object, require
from chatgen.environments.base import Environment, Episode, Step, play  # noqa: F401

BUILT_IN = {
    "calculator": "chatgen.environments.calculator:CalculatorEnv",
    "tool_math": "chatgen.environments.tool_math:ToolMathEnv",
    "search": "chatgen.environments.search:SearchEnv",
}
# adapter name -> (its class, the package it needs)
ADAPTERS = {
    "gymnasium": ("chatgen.environments.gymnasium_env:GymnasiumEnv", "gymnasium"),
    "verifiers": ("chatgen.environments.verifiers_env:VerifiersEnv", "verifiers"),
    "openenv": ("chatgen.environments.openenv_env:OpenEnvEnv", "openenv"),
}


def check_name(name) -> str | None:
    """Why `name` names no environment (None: it does; a user's module is imported at start)."""
    if not isinstance(name, str) or not name:
        return f"give an environment: one of {', '.join(BUILT_IN)}, ADAPTER:ID or 'package.module:Object'"
    adapter, sep, rest = name.partition(":")
    if name in BUILT_IN or (adapter in ADAPTERS and rest) or (sep and rest and adapter):
        return None
    return (
        f"{name!r} is no environment: use a built-in ({', '.join(BUILT_IN)}), an adapter "
        f"({', '.join(a + ':ID' for a in ADAPTERS)}) or 'package.module:Object'"
    )


def factory(name: str, args: dict):
    """(make, is_protocol): `make()` builds one protocol environment per episode; for a class
    with `episode` (the older interface) make(url, api_key, model) builds the one instance of the
    run."""
    problem = check_name(name)
    if problem:
        raise ValueError(f"runtime.algorithm.environment: {problem}")
    adapter, _, rest = name.partition(":")
    if name in BUILT_IN:
        obj = import_object(BUILT_IN[name], "class")
    elif adapter in ADAPTERS:
        path, package = ADAPTERS[adapter]
        require(package, f"the {adapter} environment adapter")
        cls = import_object(path, "class")
        if hasattr(cls, "prepare"):  # what it loads once, on the run's main thread
            cls.prepare(rest, args)
        return (lambda: cls(rest, **args)), True
    else:
        obj = import_object(name, "object")
    if hasattr(obj, "episode"):
        return obj, False
    return (lambda: obj(**args)), True


def http_client(timeout_s: float | None = 600.0):
    """An httpx client for the run's server that opens a connection per request (loopback: cheap).
    Reusing idle ones raced the server closing them (it closes a connection idle for 5 s, and httpx
    keeps one for 5 s too): with hundreds of conversations pausing between turns, a request sent
    on a connection being closed was reset and stopped the run."""
    import httpx

    return httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))


class ChatClient:
    """POST /v1/chat/completions to the run's server, the answer's first message as the `openai`
    SDK gives it (`ChatCompletionMessage.model_dump(exclude_none=True)`: the SDK's own model, so
    the recorded turn is the same dict). Not the SDK's `create`: it walks every value of the
    request against its types first (`_transform_recursive`), every token id of every earlier
    turn included: 2.5 of its 3.3 ms a turn on this CPU against 0.4 ms here, CPU the engines
    share. Errors: the SDK's (openai.BadRequestError for a 400, ..., openai.APIConnectionError,
    openai.APITimeoutError), no retries."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float | None = 600.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.http = http_client(timeout_s)

    def create(self, **body) -> dict:
        import httpx
        import openai
        from openai.types.chat import ChatCompletionMessage

        try:
            response = self.http.post(self.url, json=body, headers=self.headers)
        except httpx.TimeoutException as e:
            raise openai.APITimeoutError(request=e.request) from e
        except httpx.TransportError as e:
            raise openai.APIConnectionError(message=str(e), request=e.request) from e
        if response.status_code >= 400:
            raise status_error(response)
        message = response.json()["choices"][0]["message"]
        return ChatCompletionMessage.model_validate(message).model_dump(exclude_none=True)


def status_error(response):
    """The `openai` SDK's error for an HTTP error answer (its class per status, its message)."""
    import openai

    message = f"Error code: {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        body = response.text.strip()
    error = body.get("error", body) if isinstance(body, dict) else body
    text = error.get("message") if isinstance(error, dict) else None
    if isinstance(text, str) and text:
        message += f" - {text}"
    cls = {
        400: openai.BadRequestError,
        401: openai.AuthenticationError,
        403: openai.PermissionDeniedError,
        404: openai.NotFoundError,
        409: openai.ConflictError,
        422: openai.UnprocessableEntityError,
        429: openai.RateLimitError,
    }.get(response.status_code)
    if cls is None:
        cls = openai.InternalServerError if response.status_code >= 500 else openai.APIStatusError
    return cls(message, response=response, body=error)


class Runner:
    """The run's environment as multi-turn GRPO calls it: `episode(record, temperature,
    max_tokens)` plays one protocol episode through the policy's OpenAI endpoint."""

    def __init__(
        self,
        make,
        name,
        base_url,
        api_key,
        model,
        *,
        max_turns=8,
        step_timeout_s=60.0,
        parse=False,
        max_episode_tokens=None,
    ):
        """make: builds one protocol environment per episode; name: the config's environment
        name; the policy's OpenAI endpoint (base_url, api_key, model); max_turns, step_timeout_s
        and max_episode_tokens bound an episode (chatgen.environments.base.play); parse: the
        server parses tool calls (a tool_call_parser is set)."""
        self.make, self.name, self.model = make, name, model
        self.max_episode_tokens = max_episode_tokens
        # without a tool-call parser the tools are still rendered (tool_choice none) and the model's
        # calls reach the environment as text (e.g. Search-R1's <search> tags)
        self.tool_choice = {} if parse else {"tool_choice": "none"}
        self.max_turns, self.step_timeout_s = max_turns, step_timeout_s
        self.client = ChatClient(base_url, api_key)
        self.reported = False

    def episode(self, record: dict, temperature: float, max_tokens: int) -> Episode:
        turn_tokens = max_tokens

        def chat(messages, tools, max_tokens=max_tokens):  # play's: what the episode has left
            # with the token ids and log-probs, and the parsed tool_calls
            return self.client.create(
                model=self.model,
                messages=messages,
                temperature=temperature,
                max_tokens=min(max_tokens, turn_tokens),
                **({"tools": tools, **self.tool_choice} if tools else {}),
            )

        episode, error = play(
            self.make(),
            chat,
            record,
            self.max_turns,
            self.step_timeout_s,
            self.name,
            self.max_episode_tokens,
        )
        if error is not None and not self.reported:  # counted in env/errors; said once
            self.reported = True
            print(f"[chatgen] environment {self.name}: an episode failed: {error}", file=sys.stderr)
        return episode


def build(name: str, args: dict, base_url, api_key, model, **runner_args):
    """The run's environment object: a Runner of the protocol environment `name` (built with
    `args`; `runner_args` are Runner's keywords: max_turns, step_timeout_s, parse,
    max_episode_tokens), or the instance of a class with `episode`, which plays on its own."""
    make, protocol = factory(name, args)
    if not protocol:
        return make(base_url, api_key, model)
    return Runner(make, name, base_url, api_key, model, **runner_args)
