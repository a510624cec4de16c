"""The gymnasium adapter: a gymnasium environment whose observations and actions are text, as a
chat.

    runtime.algorithm.environment: gymnasium:chatgen/SortDigits-v0     # any registered id
    runtime.algorithm.environment_args: {max_episode_steps: 3}         # gymnasium.make's keywords

reset(record) is `env.reset(seed=record.get("seed"), options=record)` (the JSONL record reaches the
environment as its reset options); its observation is the first user message. Each model turn's text
is the action; `env.step` gives the observation (the next user message), the turn's reward,
`terminated` (done) and `truncated`. A non-text observation is sent as `str(observation)`.

Needs `pip install 'chatgen[gymnasium]'`; imported only when a config names a gymnasium environment.
"""

import gymnasium

from chatgen.environments.base import Environment, Step
from chatgen.tasks import REWARDS


class GymnasiumEnv(Environment):
    def __init__(self, env_id: str, **make_kwargs):
        try:
            self.env = gymnasium.make(env_id, **make_kwargs)
        except gymnasium.error.Error as e:
            raise ValueError(
                f"environment gymnasium:{env_id}: gymnasium cannot make it ({e})"
            ) from e

    def reset(self, record: dict) -> list:
        observation, _ = self.env.reset(seed=record.get("seed"), options=record)
        return [{"role": "user", "content": str(observation)}]

    def step(self, message: dict) -> Step:
        observation, reward, terminated, truncated, _ = self.env.step(message.get("content") or "")
        ended = terminated or truncated
        return Step(
            messages=[] if ended else [{"role": "user", "content": str(observation)}],
            reward=reward,
            done=bool(terminated),
            truncated=bool(truncated and not terminated),  # TimeLimit sets both on a last step
        )


class SortDigitsText(gymnasium.Env):
    """A text environment in gymnasium's own API (the gymnasium_tiny recipe): sort the digits of
    the record's prompt; after a wrong first answer the observation is the digits sorted (a
    hint), and the second answer is scored. Reward: the sort_digits rule (the fraction of
    positions right)."""

    observation_space = gymnasium.spaces.Text(256)
    action_space = gymnasium.spaces.Text(256)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.record, self.attempts = options, 0
        return options["prompt"], {}

    def step(self, action: str):
        self.attempts += 1
        score = REWARDS["sort_digits"](action, self.record["answer"])
        if self.attempts == 1 and score < 1.0:  # the hint, then the question again
            hint = " ".join(sorted(c for c in self.record["prompt"] if c.isdigit()))
            return f"hint: {hint} {self.record['prompt']}", 0.0, False, False, {}
        return "", score, True, False, {}


gymnasium.register(
    id="chatgen/SortDigits-v0",
    entry_point=SortDigitsText,
    max_episode_steps=2,
    disable_env_checker=True,
)
