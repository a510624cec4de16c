"""Tool calls in the OpenAI server (chatgen.serving.tool_calls): vLLM's own parsers for four families,
through the real HTTP server (EmbeddedServer) and the official `openai` client's `tools=`, streamed
and not. The engine is replaced by a script of the model's reply (the generated text, at the parser
boundary): a tiny random model cannot be made to write a tool call.

    .venv/bin/python -m pytest tests/unit/test_tool_calls.py
"""

import json
import types

import openai
import pytest
from transformers import AutoTokenizer
from vllm.tokenizers.hf import get_cached_tokenizer

from chatgen.serving.embedded import EmbeddedServer
from chatgen.serving.tool_calls import ToolCalls, parser_class

KEY = "k"
# renders the tools, the assistant's calls (arguments as JSON objects) and the tool's answers; a null
# content would fail it, as it fails SmolLM2's template
TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}CALL {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MARKERS = ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<tool_call>", "</tool_call>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
# each family's way of writing add(a=1, b=2), as the model would generate it
REPLIES = {
    "hermes": 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    "pythonic": "[add(a=1, b=2)]",
    "qwen3_xml": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n"
    "</parameter>\n</function>\n</tool_call>",
}
CONTENT = {"hermes": "Sure. "}  # the text before the call, where a family keeps it


class ScriptedModule:
    """What the server asks of a generation module, with the reply scripted: `reply` is the text the
    model 'generates' (its tokens, one streamed delta each)."""

    weight_version, health_problem, needs_resync, vocab_size = 0, None, None, 32000

    def __init__(self, tokenizer):
        self.tokenizer, self.reply = tokenizer, ""
        self.config = types.SimpleNamespace(
            temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seq_length=512, load="scripted"
        )
        self.prompts = []

    def is_sleeping(self):
        return False

    async def stream(self, prompts, params, deltas=False, **_):
        self.prompts.append(prompts[0])
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        steps = [(ids[: k + 1], [ids[k]]) for k in range(len(ids))] if deltas else [(ids, ids)]
        text = ""
        for k, (upto, new) in enumerate(steps):
            current = self.tokenizer.decode(upto)
            last = k == len(steps) - 1
            sample = types.SimpleNamespace(
                index=0,
                text=current[len(text) :] if deltas else current,
                token_ids=new,
                logprobs=[{t: types.SimpleNamespace(logprob=-0.5)} for t in new],
                finish_reason="stop" if last else None,
                stop_reason=None,
                weight_versions=[0] * len(new),
            )
            text = current
            yield 0, types.SimpleNamespace(outputs=[sample], prompt_logprobs=None)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = TEMPLATE
    return get_cached_tokenizer(tok)  # as the engine hands it out


@pytest.fixture(scope="module", params=sorted(REPLIES))
def served(request, tokenizer):
    module = ScriptedModule(tokenizer)
    server = EmbeddedServer(module, api_key=KEY, model_name="m", tool_call_parser=request.param)
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=30)
    module.reply = REPLIES[request.param]
    yield request.param, module, client
    server.close()


def ask(client, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": "1 + 2?"}])
    return client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **kwargs)


def test_a_call_is_parsed_and_goes_back_to_the_template(served):
    family, module, client = served
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert (choice.message.content or "") == CONTENT.get(family, "")
    # the round trip: the call and its answer back into the chat. With its token ids, the next
    # prompt begins with exactly the generated tokens (what RL trains on) ...
    message = choice.message.model_dump(exclude_none=True)
    answer = {"role": "tool", "tool_call_id": call.id, "content": "3"}
    history = [{"role": "user", "content": "1 + 2?"}, message, answer]
    second = ask(client, messages=history)
    assert second.prompt_token_ids[: len(first_ids := message["prompt_token_ids"])] == first_ids
    generated = message["generation_token_ids"]
    assert second.prompt_token_ids[len(first_ids) :][: len(generated)] == generated
    # ... without them, the template renders the call, its arguments as an object
    plain = {k: v for k, v in message.items() if not k.startswith(("prompt_", "generation_"))}
    third = ask(client, messages=[history[0], plain, answer])
    rendered = module.tokenizer.decode(third.prompt_token_ids)
    assert 'CALL add {"a": 1, "b": 2}' in rendered and "<|tool|>3" in rendered


def test_a_streamed_call_equals_the_whole_one(served):
    family, module, client = served
    chunks = list(ask(client, stream=True))
    names, arguments, content, ids = {}, {}, "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        ids += chunk.choices[0].model_extra.get("token_ids") or []
        for call in delta.tool_calls or ():
            if call.function and call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (
                call.function and call.function.arguments or ""
            )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert names == {0: "add"} and json.loads(arguments[0]) == {"a": 1, "b": 2}
    assert content == CONTENT.get(family, "")
    # every generated token still reaches the client (the trainer learns from them)
    assert ids == module.tokenizer.encode(module.reply, add_special_tokens=False)


def test_tool_choice_none_parses_nothing_and_named_finishes_with_stop(served):
    family, module, client = served
    plain = ask(client, tool_choice="none").choices[0]
    assert plain.message.tool_calls in (None, []) and plain.finish_reason == "stop"
    assert plain.message.content == module.reply
    named = ask(client, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert named.finish_reason == "stop" and named.message.tool_calls[0].function.name == "add"
    required = ask(client, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"


def test_a_reply_without_a_call_is_content(served):
    family, module, client = served
    reply, module.reply = module.reply, "It is 3."
    try:
        choice = ask(client).choices[0]
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, stream=True))
    finally:
        module.reply = reply
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "It is 3." == streamed


def test_a_bad_tool_schema_is_a_400_and_the_server_keeps_serving(served):
    _, _, client = served
    bad = [{"type": "function", "function": {"name": "add", "parameters": {"type": "nonsense"}}}]
    with pytest.raises(openai.BadRequestError, match=r"tools\.0\.function\.parameters"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=bad
        )
    assert ask(client).choices[0].message.tool_calls


def test_an_unknown_parser_is_refused_naming_the_flag_and_the_valid_names(tokenizer):
    with pytest.raises(ValueError, match=r"--tool-call-parser 'hermez'.*hermes.*pythonic"):
        parser_class("hermez")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolCalls("nope", tokenizer)


def test_a_parser_that_does_not_fit_the_tokenizer_is_refused_at_start(tiny_llama_dir):
    plain = get_cached_tokenizer(AutoTokenizer.from_pretrained(tiny_llama_dir))  # no <|python_tag|>
    with pytest.raises(
        ValueError, match="--tool-call-parser llama3_json: vLLM's parser does not fit"
    ):
        ToolCalls("llama3_json", plain)


def test_without_a_parser_only_tool_choice_none_is_served(tokenizer):
    module = ScriptedModule(tokenizer)
    module.reply = REPLIES["hermes"]
    server = EmbeddedServer(module, api_key=KEY, model_name="m")
    try:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            ask(client)
        out = ask(client, tool_choice="none").choices[0]
        assert out.message.content == module.reply and not out.message.tool_calls
    finally:
        server.close()


def test_chatgen_serve_refuses_an_unknown_parser_before_the_engine(tiny_llama_dir, capsys):
    from chatgen import cli

    model = ["serve", "--model", str(tiny_llama_dir), "--port", "0"]
    assert cli.main([*model, "--enable-auto-tool-choice", "--tool-call-parser", "hermez"]) == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser 'hermez': no such tool-call parser" in err and "llama3_json" in err
    assert cli.main([*model, "--tool-call-parser", "hermes"]) == 2
    assert (
        "--enable-auto-tool-choice and --tool-call-parser NAME go together"
        in capsys.readouterr().err
    )
