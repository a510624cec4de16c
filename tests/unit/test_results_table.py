"""One source for numbers: docs/measurements.md is benchmarks/results.json rendered, and every place
in README.md or docs/ that cites a result by its id (`` `id`, [measurements](...) ``) quotes that
result's figure as written there, so two pages cannot give different figures for one run.

    python -m pytest tests/unit/test_results_table.py
"""

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`(\w+)`, \[measurements\]\([^)]*measurements\.md\)")


def results() -> dict:
    data = json.loads((REPO / "benchmarks" / "results.json").read_text())
    return {entry["id"]: entry for entry in data["results"]}


def test_measurements_page_is_the_rendered_json():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results_table import main

    assert main(["--check"]) == 0, "run: python benchmarks/results_table.py --write"


def test_every_citation_quotes_its_figure():
    entries, cited = results(), set()
    pages = [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "examples").glob("*.sh")),
    ]
    for page in pages:
        text = " ".join(page.read_text().split())  # line breaks as spaces: a figure may wrap
        for match in CITATION.finditer(text):
            name = match[1]
            assert name in entries, f"{page.name} cites {name!r}, not in benchmarks/results.json"
            before = text[max(0, match.start() - 400) : match.start()]
            figure = entries[name]["figure"]
            assert figure in before, f"{page.name} cites {name!r} without its figure {figure!r}"
            cited.add(name)
    assert {"main_job_curve", "smollm2_grpo", "install_time", "vs_trl_tiny"} <= cited
