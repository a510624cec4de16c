"""A small verifiers environment in verifiers' own API (the verifiers_tiny recipe): sort the digits
of the prompt; after a wrong first answer the environment answers with the digits sorted (a hint)
and the question again, and the second answer is scored. Its rubric: the sort_digits rule (the
fraction of positions right) on the last answer.

    runtime.algorithm.environment: verifiers:chatgen.environments.verifiers_sort

Offline: its dataset is made by chatgen.tasks (no download). A chatgen run plays it through the
verifiers adapter (chatgen/environments/verifiers_env.py) on the run's own data records; verifiers'
tools (`vf-eval`) can load it as any environment module with `load_environment`.
"""

import verifiers as vf
from datasets import Dataset

from chatgen.tasks import REWARDS, sort_digits


def hint(question: str) -> str:
    return "hint: " + " ".join(sorted(c for c in question if c.isdigit())) + " " + question


class SortDigitsHint(vf.MultiTurnEnv):
    def __init__(self, **kwargs):
        super().__init__(max_turns=2, **kwargs)

    @vf.stop
    async def solved(self, state) -> bool:
        """The first answer is fully right: no hint needed."""
        turns = state["trajectory"]
        return len(turns) == 1 and score(turns[0]["completion"], state["answer"], self.parser) == 1

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=hint(state["prompt"][-1].content))]


def score(completion, answer, parser) -> float:
    return REWARDS["sort_digits"](parser.parse_answer(completion) or "", answer)


def sorted_right(completion, answer, parser) -> float:
    """The rubric's reward: the sort_digits rule on the last answer."""
    return score(completion, answer, parser)


def load_environment(n_train: int = 256, n_eval: int = 64, seed: int = 0) -> vf.Environment:
    def rows(n, s):
        return [{"question": r["prompt"], "answer": r["answer"]} for r in sort_digits.records(n, s)]

    return (
        SortDigitsHint(  # datasets built when verifiers asks (a chatgen run plays its own records)
            dataset=lambda: Dataset.from_list(rows(n_train, seed)),
            eval_dataset=lambda: Dataset.from_list(rows(n_eval, seed + 1)),
            rubric=vf.Rubric(funcs=[sorted_right]),
        )
    )
