"""Tool calls in the OpenAI server: vLLM's own tool parsers (vllm/tool_parsers: hermes, llama3_json,
mistral, pythonic, qwen3_xml, ...) read the model's reply into OpenAI `tool_calls`.

    chatgen serve --model DIR --enable-auto-tool-choice --tool-call-parser hermes
    EmbeddedServer(module, tool_call_parser="hermes")          # the server of a multi-turn RL run

This file is the one adapter over vLLM's abstract `ToolParser` (its constructor,
`extract_tool_calls`, `extract_tool_calls_streaming`, `get_remaining_unstreamed_args`,
`ToolParserManager`); the endpoints call `ToolCalls.parse` on a finished reply and a
`ToolCalls.streamer` per streamed choice.

`tool_choice`: "none" renders the tools and parses nothing; "auto" (the default when tools are
sent), "required" and a named function parse the reply with the server's parser. chatgen does not
constrain decoding (no guided JSON), so "required" and a named function are parsed like "auto" (as
vLLM does for parsers with `supports_required_and_named = False`): a reply may hold no call, and the
answer then has none. finish_reason is "tool_calls" when calls were parsed (except for a named
function: "stop", as OpenAI's API).
"""

import json

from chatgen.serving.http import APIError


def parser_names() -> list:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def parser_class(name: str):
    """vLLM's ToolParser class registered as `name`; a ValueError naming --tool-call-parser and
    the valid names otherwise (at start, before any engine loads)."""
    from vllm.tool_parsers import ToolParserManager

    names = parser_names()
    if name not in names:
        raise ValueError(
            f"--tool-call-parser {name!r}: no such tool-call parser; vLLM's are {', '.join(names)}"
        )
    return ToolParserManager.get_tool_parser(name)


def check_tool_schemas(tools) -> None:
    """A 400 naming `tools.<i>.function.parameters` for a parameters object that is not a JSON
    Schema (the parsers and chat templates would otherwise fail on it mid-reply)."""
    import jsonschema

    for i, tool in enumerate(tools or ()):
        parameters = tool.function.parameters
        if parameters is None:
            continue
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise APIError(
                400,
                f"tools.{i}.function.parameters: not a valid JSON Schema ({e.message})",
                "tools",
            ) from None


def named_function(req) -> str | None:
    choice = req.tool_choice
    return None if choice is None or isinstance(choice, str) else choice.function.name


class ToolCalls:
    """The server's tool-call parser (`name`, vLLM's registry name) over the model's tokenizer;
    None in the server when it was started without --enable-auto-tool-choice."""

    def __init__(self, name: str, tokenizer):
        self.name, self.cls, self.tokenizer = name, parser_class(name), tokenizer
        try:  # a tokenizer without the parser's marker tokens fails here, at start
            self.cls(tokenizer)
        except Exception as e:
            raise ValueError(
                f"--tool-call-parser {name}: vLLM's parser does not fit this model's tokenizer "
                f"({type(e).__name__}: {e}); choose the parser of the model's tool-call format"
            ) from e

    def applies(self, req) -> bool:
        return bool(req.tools) and req.tool_choice != "none"

    def parse(self, text: str, req) -> tuple:
        """(content, [vLLM ToolCall]) of a finished reply."""
        info = self.cls(self.tokenizer, req.tools).extract_tool_calls(text, req)
        if not info.tools_called:
            return text, []
        return info.content, list(info.tool_calls)

    def streamer(self, req) -> "Streamer":
        return Streamer(self.cls(self.tokenizer, req.tools), req)


class Streamer:
    """One streamed choice's parser state: `delta(text, ids, finished)` gives the DeltaMessage to
    send for the new text (None: nothing yet, the parser holds it back, e.g. a partial marker)."""

    def __init__(self, parser, req):
        self.parser, self.req = parser, req
        self.text, self.ids, self.called = "", [], False

    def delta(self, text: str, ids: list, finished: bool):
        previous_text, previous_ids = self.text, self.ids
        self.text, self.ids = previous_text + text, previous_ids + list(ids)
        message = self.parser.extract_tool_calls_streaming(
            previous_text, self.text, text, previous_ids, self.ids, list(ids), self.req
        )
        if finished:
            message = self.flush(message)
        if message is not None and message.tool_calls:
            self.called = True
        return message

    def flush(self, message):
        """What the parser still holds when the reply ends: an engine-based parser's buffer
        (`finish_streaming`, e.g. mistral's), or the arguments a parser had read but not sent."""
        from vllm.entrypoints.generate.base.protocol import (
            DeltaFunctionCall,
            DeltaMessage,
            DeltaToolCall,
        )

        held = None
        if getattr(self.parser, "engine_based_streaming", False):
            held = self.parser.finish_streaming()
        elif self.called or (message is not None and message.tool_calls):
            rest = self.parser.get_remaining_unstreamed_args()
            if rest:
                index = len(self.parser.prev_tool_call_arr) - 1
                call = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=rest))
                held = DeltaMessage(tool_calls=[call])
        if held is None:
            return message
        if message is None:
            return held
        if held.content:
            message.content = (message.content or "") + held.content
        message.tool_calls = [*message.tool_calls, *held.tool_calls]
        return message


def template_messages(messages: list) -> list:
    """Assistant tool calls with their `arguments` as objects, as vLLM hands them to chat
    templates (OpenAI sends them as JSON strings; templates write them with `tojson`), and a
    call's null content as "" (templates that write `'...' + message['content']`, as SmolLM2's,
    fail on null)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_arguments_as_object(c) for c in calls]}
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def _arguments_as_object(call) -> dict:
    call = dict(call)
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass  # not JSON: the template gets the text the client sent
    call["function"] = function
    return call
