"""The run's prompts: train and held-out records, the items the policy made of them, and the order
they are drawn in.

    data = RunData(cfg.runtime, records_per_episode=8)    # reads runtime.data_path / eval_data_path
    data.prepare(policy_handle, log)                       # the policy's build_dataset on every record, once
    index = data.sampler.next_batch()                      # this episode's records (deterministic, resumable)

A data path is a local file (.jsonl, .json, .parquet, .arrow, .csv) or a directory of shards of one
of those formats (or one `datasets.Dataset.save_to_disk` wrote). JSONL is read by chatgen.core.jsonl
(errors name the line); the other formats by the `datasets` library, offline. Each row becomes one
record: every column of the row as it is, plus "prompt" (the runtime.prompt_key column, or the
runtime.messages_key chat) and "answer" (the runtime.answer_key column) under chatgen's names. The
records ride on each sample as `RolloutBatch.metadata`, so every column reaches the reward
(chatgen.rlhf.run.Run.score).

`order` is what the sequence of prompts depends on (seed, batch size, the data's contents): a
checkpoint records it, and a resume with another order is refused unless
runtime.allow_data_order_change says otherwise. docs/data_and_rewards.md.
"""

import hashlib
import os
import re
import tempfile
from pathlib import Path

import torch

from chatgen.core.imports import require
from chatgen.core.jsonl import read_records
from chatgen.rlhf.checkpoint import CheckpointError
from chatgen.rlhf.health import check_cut_prompts

# file suffix -> the `datasets` builder that reads it (JSONL: chatgen.core.jsonl)
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class PromptSampler:
    """Deterministic batches of prompt indices: a fresh permutation per pass, resumable from (epoch,
    index).

    The state is two integers, so resuming at episode k+1 draws exactly the prompts an uninterrupted
    run would have drawn.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_prompts < batch_size:
            raise ValueError(
                f"the dataset has {num_prompts} prompts, fewer than one batch of {batch_size}"
            )
        self.num_prompts, self.batch_size, self.seed, self.shuffle = (
            num_prompts,
            batch_size,
            seed,
            shuffle,
        )
        self.epoch, self.index = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next_batch(self) -> list[int]:
        # drop the ragged tail, start the next pass
        if self.index + self.batch_size > self.num_prompts:
            self.epoch, self.index = self.epoch + 1, 0
        batch = self._order()[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def file_digest(path) -> str:
    """sha256 of a file (the data order of a run depends on its contents)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_digest(path) -> str:
    """sha256 of a data file (as file_digest); of a directory: of its data files' names and
    digests."""
    if Path(path).is_file():
        return file_digest(path)
    digest = hashlib.sha256()
    for shard in data_files(path)[1]:
        digest.update(f"{shard.name}\0{file_digest(shard)}\n".encode())
    return digest.hexdigest()


def data_files(path, key: str = "runtime.data_path") -> tuple[str, list]:
    """(suffix, files) of a local data path: a file of a known suffix, or a directory's shards of
    one suffix in name order ("save_to_disk" for a directory `Dataset.save_to_disk` wrote). A
    ValueError naming the key and the fix for a URL, a missing path, an unknown suffix or a
    directory without data."""
    text = os.fspath(path)
    if URL.match(text):
        raise ValueError(
            f"{key}: {text} is a URL; chatgen reads local files only (no hub or "
            "remote calls): download it first (e.g. `huggingface-cli download NAME "
            f"--repo-type dataset --local-dir DIR`) and set {key} to the file or "
            "directory"
        )
    p = Path(text)
    if not p.exists():
        raise ValueError(
            f"{key}: {text} does not exist; create it (for the tiny task: python -m "
            "chatgen.tasks --output DIR) or fix the path"
        )
    known = ", ".join(FORMATS)
    if p.is_file():
        if p.suffix.lower() not in FORMATS:
            raise ValueError(
                f"{key}: {text}: unknown format {p.suffix or '(no suffix)'}; give a {known} file"
            )
        return p.suffix.lower(), [p]
    if (p / "state.json").is_file():
        return "save_to_disk", sorted(p.glob("*.arrow"))
    shards = [f for f in sorted(p.iterdir()) if f.is_file() and f.suffix.lower() in FORMATS]
    suffixes = sorted({f.suffix.lower() for f in shards})
    if not shards:
        raise ValueError(
            f"{key}: {text} is a directory without data files ({known}); point {key} at one"
        )
    if len(suffixes) > 1:
        raise ValueError(
            f"{key}: {text} mixes {' and '.join(suffixes)} files; keep the shards of "
            "one format there"
        )
    return suffixes[0], shards


def read_rows(path, key: str = "runtime.data_path") -> list[dict]:
    """Every row of a local data path (data_files) as a dict: JSONL through chatgen.core.jsonl,
    every other format through the `datasets` library, offline."""
    suffix, files = data_files(path, key)
    if suffix == ".jsonl":
        return [record for f in files for record in read_records(f)]
    require("datasets", f"{key}: a {suffix} data file")
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # read at its import
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True  # imported before
    datasets.disable_progress_bars()
    try:
        if suffix == "save_to_disk":
            table = datasets.load_from_disk(os.fspath(path))
        else:
            # a cache of this read only, gone after it: `datasets`' shared cache knows a file by
            # its path, size and modification time, and served a replaced file's old rows
            with tempfile.TemporaryDirectory(prefix="chatgen-data-") as cache:
                table = datasets.load_dataset(
                    FORMATS[suffix],
                    split="train",
                    data_files=[str(f.resolve()) for f in files],
                    cache_dir=cache,
                    keep_in_memory=True,
                )
    except Exception as e:  # noqa: BLE001 (pyarrow, json and csv readers each raise their own)
        raise ValueError(
            f"{key}: {path}: the datasets library could not read it "
            f"({type(e).__name__}: {e}); check that it is a valid "
            f"{suffix.lstrip('.')} file"
        ) from None
    if not isinstance(table, datasets.Dataset):
        raise ValueError(
            f"{key}: {path} holds several splits ({', '.join(table)}); point {key} "
            "at one split's directory"
        )
    rows = table.to_list()
    if not rows:
        raise ValueError(f"{key}: {path} has no rows")
    return rows


def _kind(value) -> str:
    """ "an int", "a list", "empty": what a value is, for an error message."""
    name = type(value).__name__
    return "empty" if value == "" else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _chat_problem(value) -> str | None:
    """None for a chat (a non-empty list of {"role": str, "content": str}), else what is wrong."""
    if isinstance(value, str):
        return (
            "a string, not a list of {role, content} messages (a CSV cell cannot hold a list: "
            "use JSONL, JSON, parquet or arrow)"
        )
    if not isinstance(value, list) or not value:
        return f"{_kind(value)}, not a non-empty list of {{role, content}} messages"
    for m in value:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            return f"a list holding {m!r:.60}, not a {{role, content}} message of strings"
    return None


def prompt_records(rows: list, rt, path, key: str = "runtime.data_path") -> list[dict]:
    """Records of a data file's rows: each row's columns as they are, plus "prompt" (the
    runtime.prompt_key column, a non-empty string, or the runtime.messages_key column, a chat)
    and "answer" (the runtime.answer_key column as a string; unset: the row's "answer" column
    where it has one, as it is). A ValueError names the key, the file, the record and the fix."""
    column, column_key = (
        (rt.messages_key, "runtime.messages_key")
        if rt.messages_key
        else (rt.prompt_key, "runtime.prompt_key")
    )
    records = []
    for i, row in enumerate(rows, 1):
        where = f"{path}, record {i}"
        if column not in row:
            raise ValueError(
                f"{column_key}: {where} has no column {column!r} (its columns: "
                f"{', '.join(row)}); set {column_key} to the column holding the "
                f"prompts ({key})"
            )
        value = row[column]
        problem = (
            _chat_problem(value)
            if rt.messages_key
            else None
            if isinstance(value, str) and value
            else f"{_kind(value)}, not a non-empty string"
        )
        if problem:
            fix = (
                "give every record a chat"
                if rt.messages_key
                else "map runtime.prompt_key to a text column (runtime.messages_key: a column of chats)"
            )
            raise ValueError(f"{column_key}: column {column!r} of {where} is {problem}; {fix}")
        record = {**row, "prompt": value}
        if rt.answer_key:
            record["answer"] = _answer(row, rt.answer_key, where)
        records.append(record)
    return records


def _answer(row: dict, column: str, where: str) -> str:
    """The reference answer of a row: its `column` as a string (a CSV column of numbers is read
    as integers); a ValueError naming runtime.answer_key for a missing column or another type."""
    if column not in row:
        raise ValueError(
            f"runtime.answer_key: {where} has no column {column!r} (its columns: "
            f"{', '.join(row)}); set runtime.answer_key to the reference answer's "
            "column, or null when the reward needs none"
        )
    answer = row[column]
    if type(answer) is int:
        return str(answer)
    if not isinstance(answer, str):
        raise ValueError(
            f"runtime.answer_key: column {column!r} of {where} is {_kind(answer)}, "
            "not a string or an integer; map runtime.answer_key to the reference "
            "answer's text column"
        )
    return answer


def read_prompt_file(path, rt, key: str = "runtime.data_path") -> list[dict]:
    """The records (prompt_records) of runtime.data_path or eval_data_path (`key`)."""
    return prompt_records(read_rows(path, key), rt, path, key)


def data_problems(rt, needed: dict | None = None) -> list[str]:
    """What is wrong with runtime.data_path / eval_data_path under the runtime's column keys,
    each problem naming the key, the file and the fix: read in full, before any model starts
    (chatgen.rlhf.checks.check_run). `needed`: {field: what takes it} every record must hold (the
    columns the rewards are called with)."""
    problems = []
    for key in ("data_path", "eval_data_path"):
        path = getattr(rt, key)
        if path:
            try:
                records = read_prompt_file(path, rt, f"runtime.{key}")
            except ValueError as e:
                problems.append(str(e))
                continue
            for field, taker in (needed or {}).items():
                i = next((i for i, r in enumerate(records, 1) if field not in r), None)
                if i is not None:
                    problems.append(
                        f"runtime.{key}: {path}, record {i} has no field {field!r}, which {taker} "
                        f"takes; give every record one (its columns: {', '.join(records[i - 1])})"
                        + ("; or map a column to it with runtime.answer_key" * (field == "answer"))
                    )
    return problems


class RunData:
    """Records of runtime.data_path (and eval_data_path), their sampler, and the policy's items for
    both."""

    def __init__(self, rt, records_per_episode: int):
        self.records = read_prompt_file(rt.data_path, rt)
        self.eval_records = (
            read_prompt_file(rt.eval_data_path, rt, "runtime.eval_data_path")
            if rt.eval_data_path
            else []
        )
        self.paths, self.overlong = (rt.data_path, rt.eval_data_path), rt.overlong_prompts
        self.sampler = PromptSampler(len(self.records), records_per_episode, rt.seed)
        self.order = {
            "seed": rt.seed,
            "records_per_episode": records_per_episode,
            "records": len(self.records),
            "data_sha256": data_digest(rt.data_path),
        }
        if rt.overlong_prompts != "cut":  # which prompts are drawn depends on it (cut: no key)
            self.order["overlong_prompts"] = rt.overlong_prompts
        self.items = self.eval_items = None

    def prepare(self, policy, max_cut_fraction: float, log) -> None:
        """The policy's dataset items of every train and held-out record (`prepare_dataset`, once
        per run). Prompts over the budget: cut (too many stop the run: chatgen.rlhf.health),
        dropped, or refused (runtime.overlong_prompts)."""
        self.items = policy.first("prepare_dataset", [r["prompt"] for r in self.records])
        self.eval_items = policy.first(
            "prepare_dataset", [r["prompt"] for r in self.eval_records], True
        )
        if self.overlong == "cut":
            check_cut_prompts(self.items, max_cut_fraction, log)
            return
        kept = [
            self._within_budget(self.records, self.items, self.paths[0], log),
            self._within_budget(self.eval_records, self.eval_items, self.paths[1], log),
        ]
        (self.records, self.items), (self.eval_records, self.eval_items) = kept
        self.sampler = PromptSampler(len(self.records), self.sampler.batch_size, self.sampler.seed)

    def _within_budget(self, records: list, items: list, path, log) -> tuple[list, list]:
        """(records, items) without the prompts build_dataset had to cut;
        runtime.overlong_prompts: error refuses any (ValueError)."""
        cut = [i for i, item in enumerate(items) if item.get("prompt_cut")]
        if not cut:
            return records, items
        which = ", ".join(str(i + 1) for i in cut[:10]) + (", ..." if len(cut) > 10 else "")
        if self.overlong == "error":
            raise ValueError(
                f"runtime.overlong_prompts: error, and {len(cut)} of {len(items)} "
                f"prompts of {path} are longer than the policy's prompt budget "
                f"(seq_length - max_new_tokens; records {which}); raise seq_length or "
                "lower max_new_tokens, or set runtime.overlong_prompts: drop"
            )
        log(
            f"[chatgen] dropped {len(cut)} of {len(items)} prompts of {path} longer than the "
            f"policy's prompt budget (records {which}; runtime.overlong_prompts: drop)"
        )
        keep = sorted(set(range(len(items))) - set(cut))
        return [records[i] for i in keep], [items[i] for i in keep]

    def check_order(self, saved: dict, path, allow_change: bool) -> None:
        """Refuse (CheckpointError) to resume checkpoint `path`, saved with data order `saved`,
        under another one."""
        changed = {k: (saved.get(k), v) for k, v in self.order.items() if saved.get(k) != v}
        if changed and not allow_change:
            raise CheckpointError(
                f"{path} was saved with another data order ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}"
                "); its data position would apply to a different order of the prompts. Resume with the checkpoint's "
                "settings, or set runtime.allow_data_order_change=true to accept that"
            )
