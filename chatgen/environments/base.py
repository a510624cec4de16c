"""The environment protocol of multi-turn RL: reset / step over chat messages, with per-turn
rewards.

    class MyEnv(Environment):
        tools = [PYTHON_TOOL.schema]                   # OpenAI tool schemas offered to the model
        def reset(self, record: dict) -> list:         # the opening messages
            return [{"role": "user", "content": record["prompt"]}]
        def step(self, message: dict) -> Step:         # the model's message, its tool_calls parsed
            return Step(messages=[...], reward=1.0, done=True)

One instance per episode (made by a factory: the class, called with no arguments, or a function).
`play` drives one episode through the policy's OpenAI endpoint: it sends the chat with the
environment's tools, hands each assistant message to `step` as the server returned it (content,
`tool_calls` parsed by the server's tool-call parser, the token ids), appends the messages `step`
answers with, and stops at `done`, at `truncated`, or after `max_turns` model turns (truncated).
The episode's reward is the sum of its turn rewards (`Episode.turn_rewards` keeps each one, and
`Episode.turn_states` the state each turn answered: a digest of the messages the environment wrote
before it, what the step-wise `gigpo` advantage groups turns by). With `max_episode_tokens` each
request asks for at most the tokens left of the budget (every token after the first prompt), and the
episode stops, truncated, once the budget is spent.

Errors of an environment are named (`EnvironmentStepError` and subclasses): a reward that is not a
number, a step that does not return within `step_timeout_s` (a tool that never returns). After the
first model turn such an error ends the episode with reward 0 and `env/errors` 1 (its tokens still
train, as any other episode's): one bad episode does not stop a run. A request the server refuses
after the first turn (a chat grown past `seq_length`) ends the episode too, truncated, with the
rewards so far.
"""

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import numbers
import threading


@dataclasses.dataclass
class Step:
    """What an environment answers to one model turn."""

    messages: list = dataclasses.field(default_factory=list)  # tool / user turns to append
    reward: float = 0.0  # this turn's reward
    done: bool = False  # the episode ended (terminated)
    truncated: bool = False  # the episode was cut (a budget, not the task, ended it)
    metrics: dict = dataclasses.field(default_factory=dict)  # numbers to log, as env/<key>


@dataclasses.dataclass
class Episode:
    """One played episode, what multi-turn GRPO trains on.

    turns: the server's assistant messages, in order, as dicts (`message.model_dump()`): each holds
    `prompt_token_ids`, `generation_token_ids`, `generation_log_probs` (docs/serving.md); every
    turn's prompt must begin with the previous turn's prompt + generation (send each assistant
    message back to the server as it came: its token ids keep the chat token-exact). reward: the
    episode's reward. text: the final reply. metrics: more per-episode numbers to log (averaged, as
    `env/<key>`). turn_rewards: each model turn's reward (protocol environments); truncated: cut by
    max_turns, max_episode_tokens or the environment. turn_states: per model turn, a digest of the
    state it answered (state_key). dropped: the episode never ended (an agent session that was not
    closed in time, chatgen.environments.agent): none of its tokens train, and it is counted.
    """

    turns: list
    reward: float
    text: str = ""
    metrics: dict = dataclasses.field(default_factory=dict)
    turn_rewards: list = dataclasses.field(default_factory=list)
    truncated: bool = False
    turn_states: list = dataclasses.field(default_factory=list)
    dropped: bool = False


class Environment:
    """The protocol (subclassing is optional: any object with `tools`, `reset` and `step`)."""

    tools: list = []  # OpenAI tool schemas ({"type": "function", "function": {...}})

    def reset(self, record: dict) -> list:
        raise NotImplementedError

    def step(self, message: dict) -> Step:
        raise NotImplementedError


class EnvironmentStepError(RuntimeError):
    """An environment failed during an episode (the episode ends, the run goes on)."""


class RewardNotANumber(EnvironmentStepError):
    pass


class StepTimeout(EnvironmentStepError):
    pass


def checked_reward(reward, where: str) -> float:
    if (
        isinstance(reward, bool)
        or not isinstance(reward, numbers.Real)
        or not math.isfinite(reward)
    ):
        raise RewardNotANumber(
            f"{where} returned the reward {reward!r} ({type(reward).__name__}); a reward is a "
            "finite number"
        )
    return float(reward)


def call_with_timeout(fn, timeout_s: float, what: str):
    """fn() on a daemon thread, a StepTimeout naming `what` when it takes longer than timeout_s
    (a Python thread cannot be killed: the stuck call is left behind, its episode ended)."""
    future = concurrent.futures.Future()

    def target():
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller
            future.set_exception(e)

    threading.Thread(target=target, daemon=True, name="env-step").start()
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StepTimeout(
            f"{what} did not return within {timeout_s:g} s (step_timeout_s); a tool that "
            "never returns needs its own time limit (chatgen.sandbox)"
        ) from None


_loop, _loop_lock = None, threading.Lock()


def run_async(coro, wait: bool = True):
    """Runs `coro` on the process's one event loop for async environment libraries (a daemon
    thread): chatgen's episodes call reset / step on threads of their own. wait=False: only
    schedules it (from a finalizer, which may run on the loop's own thread)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="env-async").start()
    future = asyncio.run_coroutine_threadsafe(coro, _loop)
    return future.result() if wait else future


def state_key(messages: list) -> str:
    """A digest of the messages the environment wrote before a model turn: the state that turn
    answered (GiGPO's anchor state). Equal observations give equal keys across episodes."""
    text = json.dumps(messages, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def used_tokens(turns: list) -> int:
    """Tokens of the episode after its first prompt (what max_episode_tokens bounds)."""
    last, first = turns[-1], turns[0]
    return (
        len(last["prompt_token_ids"])
        + len(last["generation_token_ids"])
        - len(first["prompt_token_ids"])
    )


def play(
    env,
    chat,
    record: dict,
    max_turns: int,
    step_timeout_s: float,
    name: str,
    max_episode_tokens: int | None = None,
) -> Episode:
    """One episode of `env` (the protocol) on `record`; chat(messages, tools) -> the server's
    assistant message as a dict (chat(messages, tools, max_tokens=LEFT) under max_episode_tokens).
    See the module docstring for the rules."""
    messages = list(env.reset(record))
    turns, rewards, states, metrics, truncated = [], [], [], {}, False
    seen = 0  # messages before this one belong to earlier states
    for _ in range(max_turns):
        budget = {}
        if max_episode_tokens is not None:
            left = max_episode_tokens - (used_tokens(turns) if turns else 0)
            if left <= 0:
                truncated = True
                break
            budget = {"max_tokens": left}
        try:
            reply = chat(messages, list(getattr(env, "tools", None) or []), **budget)
        except Exception as e:
            if not turns:  # nothing to train on: a server or config problem, said as it is
                raise
            # a later turn the server refuses (the chat outgrew seq_length): the episode ends there
            rewards, text = rewards + [0.0] * (len(turns) - len(rewards)), turns[-1].get("content")
            failed = {"errors": 1.0}
            return Episode(turns, sum(rewards), text or "", failed, rewards, True, states), e
        states.append(state_key(messages[seen:]))
        turns.append(reply)
        messages.append(reply)
        seen = len(messages)
        try:
            step = call_with_timeout(lambda: env.step(reply), step_timeout_s, f"{name}.step")
            if not isinstance(step, Step):
                raise EnvironmentStepError(
                    f"{name}.step returned {type(step).__name__}; return a "
                    "chatgen.environments.Step"
                )
            rewards.append(checked_reward(step.reward, f"{name}.step"))
        except EnvironmentStepError as e:
            rewards.append(0.0)
            failed = {"errors": 1.0}
            text = reply.get("content") or ""
            return Episode(turns, 0.0, text, failed, rewards, True, states), e
        metrics.update(step.metrics)
        messages += step.messages
        if step.done or step.truncated:
            truncated = step.truncated
            break
    else:
        truncated = True
    if max_episode_tokens is not None and used_tokens(turns) > max_episode_tokens:
        truncated = True  # the environment's tokens took the last turn past the budget: cut
    text = turns[-1].get("content") or ""
    metrics = {**metrics, "errors": 0.0, "truncated": float(truncated)}
    return Episode(turns, sum(rewards), text, metrics, rewards, truncated, states), None
