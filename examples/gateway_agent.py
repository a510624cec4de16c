# chatgen train configs/grpo_multiturn_tiny.yaml runtime.algorithm.environment=null runtime.algorithm.agent=examples.gateway_agent:solve
"""An agent written against the plain `openai` SDK, trained unmodified through chatgen's agent gateway
(docs/agents.md, "The agent gateway"): it knows nothing of token ids, log-probs or chatgen.

    answer = solve(base_url, api_key, {"prompt": "sort: 3 1 2 =", "answer": " 1 2 3"})

It asks the question, reads the model's reply, hands it a calculator's result and asks again; the reward
is the sort-digits rule on the final reply (the fraction of positions right, as
chatgen.tasks.sort_digits scores it). chatgen calls `solve` once
per episode with a base_url of the form http://127.0.0.1:PORT/sessions/ID/v1: the session id travels in
the URL, so the agent's code stays what it would be against any hosted model. Outside training, point it
at any OpenAI-compatible server.
"""

import re

import openai


def ask(client, messages: list) -> str:
    reply = client.chat.completions.create(model="any-model", messages=messages, max_tokens=16)
    return reply.choices[0].message.content


def calculator_result(prompt: str) -> str:
    return "".join(f" {d}" for d in sorted(re.findall(r"\d", prompt)))


def score(reply: str, answer: str) -> float:
    got, want = re.findall(r"\d", reply), re.findall(r"\d", answer)
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


def solve(base_url: str, api_key: str, task: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": task["prompt"]}]
    first = ask(client, messages)
    messages += [
        {"role": "assistant", "content": first},  # the reply's text, as any agent keeps it
        {"role": "tool", "content": calculator_result(task["prompt"])},
        {"role": "user", "content": task["prompt"]},
    ]
    final = ask(client, messages)
    return score(final, task["answer"])
