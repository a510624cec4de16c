"""A small OpenEnv environment in OpenEnv's own API, served as OpenEnv serves its environments (a
FastAPI app from `create_app`): sort the digits of the record's prompt; after a wrong first answer
the observation is a hint (the digits sorted) and the question again, and the second answer is
scored by the sort_digits rule.

    runtime.algorithm.environment: openenv:chatgen.environments.openenv_sort:app   # chatgen serves it
    uvicorn chatgen.environments.openenv_sort:app --port 8000                      # or serve it yourself:
    runtime.algorithm.environment: openenv:http://127.0.0.1:8000

The record reaches `reset` as its keyword arguments (`prompt`, `answer`); the action is
`{"answer": TEXT}`.
"""

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from chatgen.tasks import REWARDS


class SortAction(Action):
    answer: str


class SortObservation(Observation):
    prompt: str = ""


class SortDigitsEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session, nothing shared

    def __init__(self):
        super().__init__()
        self._state = State()
        self.question, self.answer = "", ""

    def reset(self, seed=None, episode_id=None, prompt: str = "", answer: str = "", **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        self.question, self.answer = prompt, answer
        return SortObservation(prompt=prompt)

    def step(self, action: SortAction, timeout_s=None, **kwargs) -> SortObservation:
        self._state.step_count += 1
        score = REWARDS["sort_digits"](action.answer, self.answer)
        if self._state.step_count == 1 and score < 1.0:
            digits = " ".join(sorted(c for c in self.question if c.isdigit()))
            return SortObservation(prompt=f"hint: {digits} {self.question}", reward=0.0)
        return SortObservation(done=True, reward=score)

    @property
    def state(self) -> State:
        return self._state


# every concurrent episode of a run is a WebSocket session of its own (OpenEnv's default allows one)
app = create_app(SortDigitsEnv, SortAction, SortObservation, max_concurrent_envs=256)
