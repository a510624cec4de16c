"""One source for numbers: docs/measurements.md is benchmarks/results.json rendered, and every place in README.md
or docs/ that cites a result by its id (`` `id`, [measurements](...) ``) quotes that result's figure as written
there, so two pages cannot give different figures for one run.

    python -m pytest tests/unit/test_results_table.py
"""
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`(\w+)`, \[measurements\]\([^)]*measurements\.md\)")


def results() -> dict:
    return {e["id"]: e for e in json.loads((REPO / "benchmarks" / "results.json").read_text())["results"]}


def test_measurements_page_is_the_rendered_json():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results_table import main

    assert main(["--check"]) == 0, "run: python benchmarks/results_table.py --write"


def test_every_citation_quotes_its_figure():
    entries, cited = results(), set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.sh"))]:
        text = " ".join(page.read_text().split())  # line breaks as spaces: a figure may wrap
        for match in CITATION.finditer(text):
            name = match[1]
            assert name in entries, f"{page.name} cites {name!r}, which benchmarks/results.json does not have"
            before = text[max(0, match.start() - 400):match.start()]
            assert entries[name]["figure"] in before, (f"{page.name} cites {name!r} without its figure "
                                                       f"{entries[name]['figure']!r} before the citation")
            cited.add(name)
    assert {"main_job_curve", "smollm2_grpo", "install_time", "vs_trl_tiny"} <= cited
