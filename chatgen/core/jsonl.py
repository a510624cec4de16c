"""JSON Lines input files (prompts, datasets): one object per line, errors that name the file and
line."""

import json
from pathlib import Path


def read_records(path, check=None, what: str = "records") -> list[dict]:
    """The objects of a JSONL file, blank lines skipped.

    `check(record)` returns None or a problem ("needs ..."), raised as `ValueError("<path>:<line>:
    <problem>")`. A line that is not a JSON object, and a file with no records, are errors too.
    """
    records = []
    with open(path, "rb") as f:  # bytes, decoded line by line: a bad byte is reported with its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not JSON ({e.msg}); write one JSON object per line"
                ) from None
            problem = (
                "not a JSON object; write one {...} per line"
                if not isinstance(record, dict)
                else check(record)
                if check
                else None
            )
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no {what}; write one JSON object per line")
    return records


def is_token_ids(value) -> bool:
    """A non-empty list of ints (bools excluded)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def read_prompt_records(path) -> list[dict]:
    """Records of a JSONL prompt file; each line must have "prompt" (and "answer" for rule
    rewards)."""
    return read_records(
        path, lambda r: None if "prompt" in r else 'each line must be an object with a "prompt" key'
    )


def write_records(path, records) -> None:
    """One JSON object per line, into `path` (its directory created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
