"""`chatgen init`: every recipe is a self-contained copy (its configs load from the copy, its scripts name only
files of the copy), nothing is overwritten (pytest tests/unit/test_cli_init.py). The recipes running from their
own directory: tests/integration/test_first_hour.py."""

import re

import pytest

from chatgen.cli import main
from chatgen.cli.init import RECIPES, recipe_files
from chatgen.rlhf.config import load_config

# a path of the project in a script line: configs/..., examples/... (not $VARIABLES, not outputs/)
PROJECT_PATH = re.compile(r"\b((?:configs|examples)/[\w./-]+\.(?:yaml|sh|py))")


def script_paths(path) -> set:
    """The configs/ and examples/ files a launch script (or a script it sources) names, outside comments."""
    code = "\n".join(
        line.split("#")[0] if not line.lstrip().startswith("#") else ""
        for line in path.read_text().splitlines()
    )
    return set(PROJECT_PATH.findall(code))


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_copy_is_self_contained(name, tmp_path, capsys, monkeypatch):
    project = tmp_path / "project"
    assert main(["init", str(project), "--from", name]) == 0
    out = capsys.readouterr().out
    script = RECIPES[name][1]
    assert f"bash {project / script}" in out  # the one command that runs it
    copied = {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}
    assert copied == set(recipe_files(name))
    for path in [project / f for f in copied if f.endswith(".sh")]:
        named = script_paths(path)
        assert named <= copied, (
            f"{path.name} names {named - copied}, which the recipe does not copy"
        )
    monkeypatch.setenv("POLICY_LOAD", "/models/x")
    monkeypatch.setenv("DATASET_PATH", "/data/x")
    for config in [
        f for f in copied if f.count("/") == 1 and f.endswith(".yaml") and f.startswith("configs/")
    ]:
        cfg = load_config(project / config)  # every per-model YAML it includes is in the copy
        assert all(str(project) in str(p) for p in cfg.files), cfg.files
    assert (project / script).stat().st_mode & 0o111  # still executable


def test_init_overwrites_nothing_and_names_what_is_in_the_way(tmp_path, capsys):
    project = tmp_path / "p"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "grpo_tiny.yaml").write_text("mine\n")
    assert main(["init", str(project)]) == 2
    err = capsys.readouterr().err
    assert "configs/grpo_tiny.yaml" in err and "nothing was copied" in err
    assert (project / "configs" / "grpo_tiny.yaml").read_text() == "mine\n"
    assert [p.name for p in project.rglob("*")] == ["configs", "grpo_tiny.yaml"]


def test_init_writes_through_no_planted_link(tmp_path, capsys):
    """Issue 50, finding 15: a dangling link planted at a recipe file's path (or a linked
    directory) had the copy written to its target."""
    import os

    victim = tmp_path / "victim.txt"
    project = tmp_path / "p"
    (project / "configs").mkdir(parents=True)
    os.symlink(victim, project / "configs" / "grpo_tiny.yaml")  # dangling: exists() is False
    assert main(["init", str(project)]) == 2
    assert "configs/grpo_tiny.yaml" in capsys.readouterr().err and not os.path.lexists(victim)
    elsewhere, other = tmp_path / "elsewhere", tmp_path / "q"
    elsewhere.mkdir()
    other.mkdir()
    os.symlink(elsewhere, other / "configs")
    assert main(["init", str(other)]) == 2
    assert "configs/ (a link)" in capsys.readouterr().err and not list(elsewhere.iterdir())
    # a link planted between the check and the copy is refused by the open itself
    from chatgen.cli.init import SOURCE, copy_new

    os.symlink(victim, tmp_path / "late")
    with pytest.raises(FileExistsError):
        copy_new(SOURCE / "configs" / "grpo_tiny.yaml", tmp_path / "late")
    assert not os.path.lexists(victim)


def test_list_names_every_recipe_and_its_command(capsys):
    assert main(["init", "--list"]) == 0
    out = capsys.readouterr().out
    for name, (_, script, _) in RECIPES.items():
        assert f"chatgen init DIR --from {name}; bash DIR/{script}" in out


def test_no_directory_and_an_unknown_recipe_are_usage_errors(tmp_path, capsys):
    assert main(["init"]) == 2 and "chatgen init --list" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["init", str(tmp_path / "p"), "--from", "grpo_huge"])
    assert e.value.code == 2 and "invalid choice: 'grpo_huge'" in capsys.readouterr().err
