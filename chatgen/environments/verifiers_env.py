"""The verifiers adapter: an environment written in verifiers' classic API (`vf.MultiTurnEnv`,
`vf.SingleTurnEnv`, `vf.ToolEnv`, ... with a `vf.Rubric`) as a chatgen protocol environment.

    runtime.algorithm.environment: verifiers:ENV_ID            # vf.load_environment(ENV_ID, **args)
    runtime.algorithm.environment_args: {...}                  # load_environment's keywords

ENV_ID is what `vf.load_environment` takes: an installed environment package (`my-env` imports
`my_env`) or any module with a `load_environment` function (`chatgen.environments.verifiers_sort`).
The environment is loaded once per process; each episode has its own verifiers `State`.

chatgen drives the turns, so every turn keeps the server's exact token ids: reset(record) is
verifiers' `init_state` + `setup_state` on the record (its `prompt` as messages, or as text put
after the environment's `system_prompt` and `few_shot`; `answer`, `info`, `task` as given), and each
model turn is added to the state's trajectory, then the environment's stop conditions
(`is_completed`) decide: not done, its `env_response` is the next observation; done, its rubric
scores the rollout (`rubric.score_rollout`) and `state["reward"]` is the episode's reward (all of it
on the last turn; `state["metrics"]` logged as `env/<name>`). The environment's tools
(`tool_defs`) are sent with every request. A rubric function that returns no finite number raises
RewardNotANumber (verifiers itself would count it 0); an error the environment records
(`state["error"]`, a `vf.Error` from `env_response`) ends the episode as an EnvironmentStepError.

Needs verifiers 0.3.1 (`verifiers.legacy`) installed beside chatgen's stack:
`pip install --no-deps -r requirements-verifiers.txt` (docs/agents.md says why `--no-deps`).
"""

import contextvars
import functools
import inspect
import signal
import threading

import verifiers as vf
from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient
from verifiers.legacy.utils.message_utils import normalize_messages

from chatgen.environments.base import (
    Environment,
    EnvironmentStepError,
    RewardNotANumber,
    Step,
    checked_reward,
    run_async,
)

_loaded, _load_lock = {}, threading.Lock()
# the rubric errors of the scoring that is running (one list per asyncio task)
_reward_errors = contextvars.ContextVar("chatgen_reward_errors", default=None)


def checking(func):
    """`func` (a rubric function) as verifiers calls it (same signature), recording a result that is
    not a finite number instead of letting verifiers' `float()` turn it into 0 or a number."""
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        value = func(*args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
        errors = _reward_errors.get()
        if isinstance(value, bool):  # verifiers' rubrics may answer True / False: 1.0 / 0.0
            return value
        try:
            checked_reward(value, f"the rubric function {name}")
        except RewardNotANumber as e:
            if errors is not None:
                errors.append(e)
        return value

    wrapper.chatgen_checked = True
    return wrapper


def check_rubric(rubric):
    """Wraps the reward functions of `rubric` and of every rubric in it (a RubricGroup)."""
    for inner in getattr(rubric, "rubrics", None) or []:
        check_rubric(inner)
    funcs = getattr(rubric, "funcs", None)
    if funcs:
        rubric.funcs = [f if getattr(f, "chatgen_checked", False) else checking(f) for f in funcs]


def load(env_id: str, args: dict):
    """The verifiers environment ENV_ID made with `args`, once per process (VerifiersEnv.prepare
    calls it on the run's main thread: verifiers' Environment sets SIGINT / SIGTERM handlers as it
    is made, which only the main thread may; chatgen's own handlers are put back after it)."""
    key = (env_id, repr(sorted(args.items())))
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
        main = threading.current_thread() is threading.main_thread()
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            env = vf.load_environment(env_id, **args)
        except (ImportError, AttributeError, RuntimeError, ValueError) as e:
            raise ValueError(
                f"environment verifiers:{env_id}: verifiers cannot load it ({e}); name an "
                "installed environment package or a module with a load_environment function"
            ) from e
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        if not isinstance(env, vf.MultiTurnEnv):
            raise ValueError(
                f"environment verifiers:{env_id}: load_environment returned "
                f"{type(env).__name__}; the adapter plays a vf.MultiTurnEnv (SingleTurnEnv, "
                "ToolEnv, ... are ones)"
            )
        check_rubric(env.rubric)
        _loaded[key] = env
        return env


class NoModel(OpenAIChatCompletionsClient):
    """The state's client: chatgen calls the model itself, so the environment never should."""

    def __init__(self):
        super().__init__(None)

    async def get_native_response(self, *args, **kwargs):
        raise EnvironmentStepError("the verifiers adapter drives the model; the env called it")


async def as_dicts(messages) -> list:
    """verifiers' messages as OpenAI chat dicts (their own conversion)."""
    native, _ = await NoModel().to_native_prompt(list(messages))
    return [{k: v for k, v in dict(m).items() if v is not None} for m in native]


class VerifiersEnv(Environment):
    @staticmethod
    def prepare(env_id: str, args: dict):
        load(env_id, args)

    def __init__(self, env_id: str, **load_kwargs):
        self.name = f"verifiers:{env_id}"
        self.env = load(env_id, load_kwargs)
        self.tools = [
            {"type": "function", "function": tool.model_dump(exclude_none=True)}
            for tool in self.env.tool_defs or []
        ]

    def reset(self, record: dict) -> list:
        return run_async(self._reset(record))

    def step(self, message: dict) -> Step:
        return run_async(self._step(message))

    async def _reset(self, record: dict) -> list:
        row = {"example_id": 0, **record}
        if isinstance(row.get("prompt"), str):  # as verifiers formats a dataset's `question`
            system = [{"role": "system", "content": self.env.system_prompt}]
            few_shot = list(self.env.few_shot or [])
            user = [{"role": "user", "content": row["prompt"]}]
            row["prompt"] = (system if self.env.system_prompt else []) + few_shot + user
        state = await self.env.init_state(row, NoModel(), "policy")
        state = await self.env.setup_state(state) or state
        self.state, self.prompt = state, state["prompt"]
        return await as_dicts(self.prompt)

    async def _step(self, message: dict) -> Step:
        env, state = self.env, self.state
        reply = {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k)}
        completion = normalize_messages([{"role": "assistant", **reply}], field_name="message")
        turn = dict(prompt=self.prompt, completion=completion, response=None, tokens=None)
        turn.update(reward=None, advantage=None, is_truncated=False, extras={})
        await env.add_trajectory_step(state, {**turn, "trajectory_id": state["trajectory_id"]})
        if not await env.is_completed(state):
            try:
                prompt = await env.get_prompt_messages(state)  # calls env_response
            except vf.Error as e:
                state["error"] = e
            else:
                if not await env.is_completed(state):  # final_env_response ends it
                    observation = prompt[len(self.prompt) + len(completion) :]
                    self.prompt = prompt
                    return Step(messages=await as_dicts(observation))
        return await self._score()

    async def _score(self) -> Step:
        env, state = self.env, self.state
        await env.cleanup(state)  # renders state["completion"], runs the env's cleanup handlers
        if state.get("error") is not None:
            raise EnvironmentStepError(f"{self.name}: the environment failed: {state['error']!r}")
        errors = []
        _reward_errors.set(errors)
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        if errors:
            raise errors[0]
        reward = checked_reward(state["reward"], f"{self.name}'s rubric")
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        truncated = bool(state.get("is_truncated"))
        return Step(reward=reward, done=not truncated, truncated=truncated, metrics=metrics)
