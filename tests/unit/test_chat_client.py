"""chatgen.environments.ChatClient, the Runner's client of the run's server, against the official
`openai` SDK as the oracle: over real HTTP (a stdlib server answering canned chat completions in
chatgen's shape), the same request body reaches the server and the same assistant-message dict
comes back; an error answer raises the SDK's class with the SDK's message.

    .venv/bin/python -m pytest tests/unit/test_chat_client.py
"""

import http.server
import json
import threading

import openai
import pytest

from chatgen.environments import ChatClient

MESSAGE = {  # chatgen's server's message: its own fields, None values, a parsed tool call
    "role": "assistant",
    "content": None,
    "refusal": None,
    "reasoning_content": None,
    "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    ],
    "prompt_token_ids": [1, 5, 9],
    "generation_token_ids": [7, 2],
    "generation_log_probs": [-0.25, -1.5],
    "generation_weight_versions": None,
    "meta": {"kept": None},  # an extra field's inner None: the SDK keeps it
}


@pytest.fixture
def server():
    bodies, answers = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(
                (self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            )
            status, payload = answers[0]
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", bodies, answers
    finally:
        httpd.shutdown()
        httpd.server_close()


def completion(message):
    return {
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


REQUEST = {
    "model": "policy",
    "messages": [
        {"role": "user", "content": "sort: 3 1 2 ="},
        {
            "role": "assistant",
            "content": " 1 2",
            "prompt_token_ids": [1, 5],
            "generation_token_ids": [3],
        },
        {"role": "tool", "content": " result 0"},
    ],
    "temperature": 1.0,
    "max_tokens": 8,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none",
}


def test_the_same_request_and_the_same_message_as_the_openai_sdk(server):
    url, bodies, answers = server
    answers.append((200, completion(MESSAGE)))
    sdk = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    expected = (
        sdk.chat.completions.create(**REQUEST).choices[0].message.model_dump(exclude_none=True)
    )
    got = ChatClient(url + "/", "k").create(**REQUEST)
    assert got == expected
    assert "content" not in got and got["meta"] == {"kept": None}
    assert got["generation_token_ids"] == [7, 2]
    (sdk_path, sdk_body), (path, body) = bodies
    assert path == sdk_path == "/v1/chat/completions" and body == sdk_body == REQUEST


def test_an_error_answer_raises_the_sdks_error(server):
    url, _, answers = server
    error = {"error": {"message": "messages: the chat template refused them", "type": "x"}}
    answers.append((400, error))
    sdk = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as expected:
        sdk.chat.completions.create(**REQUEST)
    with pytest.raises(openai.BadRequestError) as got:
        ChatClient(url, "k").create(**REQUEST)
    assert str(got.value) == str(expected.value) and "template refused" in str(got.value)
    assert got.value.body == expected.value.body and got.value.status_code == 400
    answers[0] = (503, {"error": {"message": "overloaded"}})
    with pytest.raises(openai.InternalServerError, match="overloaded"):
        ChatClient(url, "k").create(**REQUEST)


def test_a_server_gone_raises_the_sdks_connection_error():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(openai.APIConnectionError):
        ChatClient(f"http://127.0.0.1:{port}/v1", "k").create(**REQUEST)
