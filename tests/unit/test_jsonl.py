"""The shared JSONL reader: every input-file error names the file, the line and the fix."""

import pytest

from chatgen.core.jsonl import is_token_ids, read_records


def test_reads_objects_and_skips_blank_lines(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert read_records(path) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": 1}\n{oops\n', r"x.jsonl:2: not JSON .*write one JSON object per line"),
        ('[1, 2]\n', r"x.jsonl:1: not a JSON object"),
        ('{"b": 1}\n', r"x.jsonl:1: needs a"),
        ("\n\n", r"x.jsonl: no things"),
    ],
)
def test_errors_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_records(path, lambda r: None if "a" in r else "needs a", what="things")


def test_token_ids():
    assert (
        is_token_ids([1, 2])
        and not is_token_ids([])
        and not is_token_ids([1, True])
        and not is_token_ids("12")
    )


@pytest.mark.faults
def test_a_byte_that_is_not_utf8_names_the_file_and_line(tmp_path):
    """It was a bare UnicodeDecodeError, naming neither."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(
        ValueError, match=r"x.jsonl:2: not UTF-8 \(byte 0xe9 at column 11\); save the file as UTF-8"
    ):
        read_records(path)
