"""Data files of a run (chatgen.rlhf.data): every format through the real `datasets` library,
column mapping, and bad input refused by the config checks (`chatgen config`) with the key, the
file and the column named.

    pytest tests/unit/test_data_files.py
"""

import dataclasses
import json
from pathlib import Path

import datasets
import pytest

from chatgen.cli import main
from chatgen.rlhf.data import RunData, data_digest, data_problems, read_prompt_file
from chatgen.rlhf.schema import RuntimeConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml"
ROWS = [
    {
        "question": f"sort: {i} 3 1 =",
        "solution": i,
        "level": i % 3,
        "chat": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"what is {i}?"},
        ],
    }
    for i in range(6)
]


def rt(**keys) -> RuntimeConfig:
    return dataclasses.replace(
        RuntimeConfig(), **{"prompt_key": "question", "answer_key": "solution", **keys}
    )


def write(table: datasets.Dataset, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    {
        ".parquet": table.to_parquet,
        ".csv": lambda p: table.to_csv(p, index=False),
        ".json": table.to_json,
        ".jsonl": table.to_json,
    }[path.suffix](str(path))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".csv", ".json", ".jsonl"])
def test_each_format_gives_the_same_records_with_every_column(tmp_path, suffix):
    table = datasets.Dataset.from_list(ROWS)
    if suffix == ".arrow":  # what save_to_disk writes: the arrow shard itself, and its directory
        table.save_to_disk(str(tmp_path / "saved"))
        paths = [next((tmp_path / "saved").glob("*.arrow")), tmp_path / "saved"]
    else:
        paths = [
            write(
                table.remove_columns("chat") if suffix == ".csv" else table,
                tmp_path / f"data{suffix}",
            )
        ]
    for path in paths:
        records = read_prompt_file(path, rt())
        assert [r["prompt"] for r in records] == [r["question"] for r in ROWS]
        # integers become text
        assert [r["answer"] for r in records] == [str(r["solution"]) for r in ROWS]
        # extra columns reach the reward
        assert [r["level"] for r in records] == [r["level"] for r in ROWS]
        # the mapped column stays under its own name too
        assert records[0]["question"] == ROWS[0]["question"]


def test_a_directory_of_shards_reads_in_name_order_and_its_digest_follows_the_contents(tmp_path):
    table = datasets.Dataset.from_list(ROWS)
    write(table.select(range(3, 6)), tmp_path / "shards" / "part-1.parquet")
    write(table.select(range(3)), tmp_path / "shards" / "part-0.parquet")
    records = read_prompt_file(tmp_path / "shards", rt())
    assert [r["solution"] for r in records] == list(range(6))
    before = data_digest(tmp_path / "shards")
    write(table.select(range(2)), tmp_path / "shards" / "part-1.parquet")
    assert data_digest(tmp_path / "shards") != before


def test_messages_key_gives_chats_and_jsonl_defaults_read_as_before(tmp_path):
    path = write(datasets.Dataset.from_list(ROWS), tmp_path / "chats.parquet")
    records = read_prompt_file(path, rt(messages_key="chat", answer_key=None))
    assert records[2]["prompt"] == ROWS[2]["chat"] and "answer" not in records[2]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(
        '{"prompt": "a b", "answer": "b a", "id": 7}\n\n{"prompt": "c", "answer": 3}\n'
    )
    # default keys: the records of the file, as they are
    records = read_prompt_file(plain, RuntimeConfig())
    assert records == [{"prompt": "a b", "answer": "b a", "id": 7}, {"prompt": "c", "answer": 3}]


def test_run_data_order_and_resume_state_as_before(tmp_path):
    path = write(datasets.Dataset.from_list(ROWS * 4), tmp_path / "train.parquet")
    data = RunData(rt(data_path=str(path), seed=5), records_per_episode=4)
    assert data.order == {
        "seed": 5,
        "records_per_episode": 4,
        "records": 24,
        "data_sha256": data_digest(path),
    }
    first = [data.sampler.next_batch() for _ in range(3)]
    again = RunData(rt(data_path=str(path), seed=5), records_per_episode=4)
    again.sampler.load_state_dict({"epoch": 0, "index": 4})
    assert [again.sampler.next_batch() for _ in range(2)] == first[1:]


class Policy:  # RunData.prepare's one call of a policy: prepare_dataset, cutting as build_dataset
    def first(self, method, prompts, is_eval=False):
        return [
            {
                "input_ids": [1] * len(p),
                "prompt": p,
                **({"prompt_cut": True} if len(p) > 14 else {}),
            }
            for p in prompts
        ]


def test_overlong_prompts_drop_counts_them_and_error_refuses(tmp_path):
    # odd records: 20 chars
    rows = [{"question": "x" * (10 + i % 2 * 10), "solution": i} for i in range(12)]
    path = write(datasets.Dataset.from_list(rows), tmp_path / "train.parquet")
    lines = []
    data = RunData(rt(data_path=str(path), overlong_prompts="drop"), records_per_episode=2)
    data.prepare(Policy(), 0.5, lines.append)
    assert [r["solution"] for r in data.records] == [0, 2, 4, 6, 8, 10] and len(data.items) == 6
    assert "dropped 6 of 12 prompts" in lines[0] and data.order["overlong_prompts"] == "drop"
    assert all(i < 6 for _ in range(5) for i in data.sampler.next_batch())
    data = RunData(rt(data_path=str(path), overlong_prompts="error"), records_per_episode=2)
    with pytest.raises(
        ValueError, match=r"runtime.overlong_prompts: error, and 6 of 12 prompts .* records 2, 4, 6"
    ):
        data.prepare(Policy(), 0.5, lines.append)


@pytest.mark.parametrize(
    "keys, expect",
    [
        (
            {"prompt_key": "query"},
            "runtime.prompt_key: {path}, record 1 has no column 'query' (its columns: question, "
            "solution, level, chat); set runtime.prompt_key",
        ),
        (
            {"prompt_key": "level"},
            "runtime.prompt_key: column 'level' of {path}, record 1 is an int, not a non-empty "
            "string",
        ),
        (
            {"answer_key": "chat"},
            "runtime.answer_key: column 'chat' of {path}, record 1 is a list, not a string or an "
            "integer",
        ),
        ({"answer_key": "answer"}, "runtime.answer_key: {path}, record 1 has no column 'answer'"),
        (
            {"messages_key": "question"},
            "runtime.messages_key: column 'question' of {path}, record 1 is a string, not a "
            "list of {{role, content}} messages",
        ),
    ],
)
def test_bad_mapping_is_one_error_naming_key_file_and_column(tmp_path, keys, expect):
    path = write(datasets.Dataset.from_list(ROWS), tmp_path / "train.parquet")
    problems = data_problems(rt(data_path=str(path), **keys))
    assert len(problems) == 1 and expect.format(path=path) in problems[0], problems


def test_local_paths_only_and_known_formats(tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    write(datasets.Dataset.from_list(ROWS[:2]), tmp_path / "mixed" / "a.parquet")
    write(datasets.Dataset.from_list(ROWS[:2]), tmp_path / "mixed" / "b.json")
    for path, expect in [
        ("hf://datasets/openai/gsm8k", "is a URL; chatgen reads local files only"),
        (
            tmp_path / "data.txt",
            "unknown format .txt; give a .jsonl, .json, .parquet, .arrow, .csv",
        ),
        (tmp_path / "mixed", "mixes .json and .parquet files"),
        (tmp_path / "none.parquet", "does not exist"),
    ]:
        (problem,) = data_problems(rt(data_path=str(path)))
        assert problem.startswith(f"runtime.data_path: {path}") and expect in problem


def test_chatgen_config_refuses_a_missing_column_and_an_unknown_logger(tmp_path, capsys):
    path = write(datasets.Dataset.from_list(ROWS), tmp_path / "train.csv")
    base = [
        "config",
        str(TINY),
        f"runtime.data_path={path}",
        "runtime.eval_data_path=null",
        "runtime.eval_episode_interval=null",
    ]
    assert main([*base, "runtime.prompt_key=problem"]) == 2
    assert (
        f"runtime.prompt_key: {path}, record 1 has no column 'problem'" in capsys.readouterr().err
    )
    assert main([*base, "runtime.prompt_key=question", "runtime.loggers=[jsonl,wandbb]"]) == 2
    assert (
        "runtime.loggers: unknown logger 'wandbb'; did you mean 'wandb'?" in capsys.readouterr().err
    )
    assert main([*base, "runtime.prompt_key=question", "runtime.answer_key=solution"]) == 0, (
        capsys.readouterr().err
    )


def test_the_csv_file_is_read_by_datasets_not_by_hand(tmp_path):
    """A quoted CSV cell with a comma and a newline: what the csv builder parses and a split(',')
    would not."""
    path = tmp_path / "q.csv"
    path.write_text('question,solution\n"sort: 3, 1\n2 =",123\n')
    assert read_prompt_file(path, rt()) == [
        {
            "question": "sort: 3, 1\n2 =",
            "solution": 123,
            "prompt": "sort: 3, 1\n2 =",
            "answer": "123",
        }
    ]
    # plain values: they travel to Ray actors and into logs
    assert json.dumps(read_prompt_file(path, rt()))


def test_a_file_replaced_with_the_same_size_and_time_is_read_anew(tmp_path):
    """Issue 50, finding 7: `datasets` knows a file by path, size and modification time, so a file
    replaced by one of the same size and time was read from its cache: the old rows."""
    import os

    from chatgen.rlhf.data import read_rows

    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\naaaa,1\n")
    stat = path.stat()
    assert read_rows(path) == [{"prompt": "aaaa", "answer": 1}]
    path.write_text("prompt,answer\nbbbb,2\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert read_rows(path) == [{"prompt": "bbbb", "answer": 2}]
