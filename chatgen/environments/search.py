"""The built-in `search` environment: Search-R1-style questions answered with a local BM25 `search`
tool.

    python -m chatgen.environments.search --write-task outputs/search_tiny   # corpus + train/eval questions
    runtime.algorithm: {environment: search, environment_args: {corpus: outputs/search_tiny/corpus.jsonl}}

The corpus (JSONL, one {"id", "text"} per passage) is indexed once per process with bm25s. The model
searches either with a `search(query)` tool call (parsed by the server's tool-call parser; the tool
message holds the top `k` passages) or, as in Search-R1, by writing `<search>query</search>` (any
model, no parser: the passages come back as a user turn `<information>...</information>`). The first
reply that does neither is the answer: reward 1.0 when it contains the record's answer
(case-insensitive), else 0.0. The task
this file writes is made-up facts ("The capital of Velmora is Quistar."), so no model knows them: it
has to search. Needs `pip install 'chatgen[search]'` (bm25s).
"""

import argparse
import functools
import json
import random
import re
from pathlib import Path

from chatgen.core.imports import require
from chatgen.core.jsonl import write_records
from chatgen.environments.base import Environment, Step
from chatgen.environments.tools import Tool, run_tool_calls

SYSTEM = (
    "Answer the question. To look a fact up, write <search>your query</search> and stop; the "
    "results come back as <information>...</information>. Then give the answer."
)
TAG = re.compile(r"<search>(.*?)</search>", re.DOTALL)


def _bm25s():
    require("bm25s", "the search environment")
    import bm25s

    return bm25s


@functools.lru_cache(maxsize=4)
def index(corpus: str):
    """(bm25s retriever, passages) of a corpus file, built once per process."""
    bm25s = _bm25s()

    passages = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines() if line]
    if not passages:
        raise ValueError(f"environment_args.corpus: {corpus} holds no passages")
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False
    )
    return retriever, passages


def search(corpus: str, query: str, k: int) -> str:
    retriever, passages = index(corpus)
    tokens = _bm25s().tokenize([query], stopwords="en", show_progress=False)
    if not tokens.vocab:  # a query of stopwords only
        return "no results"
    found, _ = retriever.retrieve(tokens, k=min(k, len(passages)), show_progress=False)
    return "\n".join(f"[{rank + 1}] {passages[i]}" for rank, i in enumerate(found[0]))


class SearchEnv(Environment):
    def __init__(self, corpus: str, k: int = 2, system: str = SYSTEM):
        index(corpus)  # a missing or empty corpus: at the first episode, named
        self.tool = Tool(
            "search",
            "Search the knowledge base; returns the most relevant passages.",
            {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
            lambda query: search(corpus, str(query), k),
        )
        self.tools, self.system = [self.tool.schema], system

    def reset(self, record: dict) -> list:
        self.answer, self.calls = record["answer"], 0
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": record["prompt"]},
        ]

    def step(self, message: dict) -> Step:
        if message.get("tool_calls"):
            self.calls += len(message["tool_calls"])
            return Step(messages=run_tool_calls({"search": self.tool}, message))
        query = TAG.search(message.get("content") or "")
        if query:
            self.calls += 1
            found = self.tool.fn(query.group(1).strip())
            return Step(
                messages=[{"role": "user", "content": f"<information>{found}</information>"}]
            )
        found = self.answer.lower() in (message.get("content") or "").lower()
        return Step(reward=float(found), done=True, metrics={"searches": float(self.calls)})


SYLLABLES = ["vel", "mor", "qui", "star", "zan", "dor", "lio", "pra", "ten", "bel", "kor", "ith"]
RELATIONS = [
    ("capital", "The capital of {e} is {v}.", "What is the capital of {e}?"),
    ("river", "The longest river of {e} is the {v}.", "What is the longest river of {e}?"),
    ("founder", "{e} was founded by {v}.", "Who founded {e}?"),
]


def write_task(out: Path, n_entities: int = 200, n_eval: int = 64, seed: int = 0) -> str:
    """corpus.jsonl (3 made-up facts per entity), train.jsonl and eval.jsonl (questions on them,
    held-out entities apart)."""
    rng = random.Random(seed)

    def word():
        return "".join(rng.sample(SYLLABLES, 2)).capitalize()

    entities = list(
        dict.fromkeys(word() + rng.choice(["ia", "a", "land"]) for _ in range(4 * n_entities))
    )
    entities = entities[:n_entities]
    corpus, questions = [], []
    for e in entities:
        for relation, fact, question in RELATIONS:
            value = word()
            corpus.append({"id": f"{e}-{relation}", "text": fact.format(e=e, v=value)})
            questions.append({"prompt": question.format(e=e), "answer": value, "entity": e})
    held_out = set(entities[: n_eval // len(RELATIONS) + 1])
    eval_rows = [q for q in questions if q["entity"] in held_out][:n_eval]
    train = [q for q in questions if q["entity"] not in held_out]
    write_records(out / "corpus.jsonl", corpus)
    write_records(out / "train.jsonl", train)
    write_records(out / "eval.jsonl", eval_rows)
    return f"wrote {len(corpus)} passages, {len(train)} train and {len(eval_rows)} eval questions to {out}"


def demonstrations(model_dir: Path, task_dir: Path, fraction: float = 0.5, seed: int = 0) -> str:
    """sft.jsonl in task_dir: the first turn of train questions rendered with the model's chat
    template, answered with a search (`fraction` of them) or a made-up guess (the rest): a warm
    start that sometimes searches (examples/sft_warm_start.py), for RL to do the rest."""
    from transformers import AutoTokenizer

    tokenizer, rng = AutoTokenizer.from_pretrained(model_dir), random.Random(seed)
    rows = []
    for line in (task_dir / "train.jsonl").read_text().splitlines():
        record = json.loads(line)
        chat = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": record["prompt"]},
        ]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        guess = "".join(rng.sample(SYLLABLES, 2)).capitalize()
        answer = f"<search>{record['prompt']}</search>" if rng.random() < fraction else guess
        rows.append({"prompt": prompt, "answer": answer})
    write_records(task_dir / "sft.jsonl", rows)
    return (
        f"wrote {len(rows)} demonstrations ({fraction:.0%} searching) to {task_dir / 'sft.jsonl'}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-task", type=Path, required=True, metavar="DIR")
    parser.add_argument(
        "--demonstrations-for",
        type=Path,
        metavar="MODEL_DIR",
        help="also write DIR/sft.jsonl: warm-start demonstrations in this model's chat template",
    )
    args = parser.parse_args()
    if not (args.write_task / "train.jsonl").exists():
        print(write_task(args.write_task))
    if args.demonstrations_for:
        print(demonstrations(args.demonstrations_for, args.write_task))
