"""One source for numbers: docs/measurements.md is benchmarks/results.json rendered, every figure that
README.md or docs/ quote between `<!-- figure:id -->` markers is the JSON's (the regenerating script
writes it there), every place that cites a result by its id (`` `id`, [measurements](...) ``) quotes
it, and README's measured figures all come from the JSON: no two pages can give different figures
for one run.

    python -m pytest tests/unit/test_results_table.py
"""

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`(\w+)`, \[measurements\]\([^)]*measurements\.md\)")
# what a measured figure looks like: a ratio, a time, a size or rate, a tiny float, a reward curve
FIGURE = re.compile(
    r"\b\d+(\.\d+)?(-\d+(\.\d+)?)?x\b|\b\d+(\.\d+)? ?(ms|s|min|GB/s|MB/s|GB|MB|GiB|MiB)\b"
    r"|\b\d\.\d+e-\d+\b|\b0\.\d+ -> \d\.\d+"
)

sys.path.insert(0, str(REPO / "benchmarks"))
import results_table  # noqa: E402


def results() -> dict:
    return json.loads((REPO / "benchmarks" / "results.json").read_text())


def test_every_page_is_the_rendered_json():
    """docs/measurements.md and every figure between markers in README.md and docs/ (--check)."""
    assert results_table.main(["--check"]) == 0, "run: python benchmarks/results_table.py --write"


def test_every_citation_quotes_its_figure():
    entries, cited = {e["id"]: e for e in results()["results"]}, set()
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
            quoted = re.search(rf"<!-- figure:{name}(\.\w+)? -->", before)
            assert figure in before or quoted, (
                f"{page.name} cites {name!r} without its figure {figure!r}"
            )
            cited.add(name)
    assert {"main_job_curve", "smollm2_grpo", "install_time", "vs_trl_tiny"} <= cited


def test_readme_measured_figures_all_come_from_the_json():
    """Outside the markers README's measured figures (the Measured table's figure column, the main
    job's and SmolLM2's paragraph) hold no number: each is quoted from results.json."""
    readme = (REPO / "README.md").read_text()
    outside = results_table.QUOTE.sub("", readme)
    measured = outside.split("## Measured", 1)[1].split("\n\n", 2)[1]
    cells = [row.split("|")[2] for row in measured.splitlines()[2:]]
    intro = outside[outside.index("On 2 CPU cores") : outside.index("Your own project")]
    free = [m[0] for text in (*cells, intro) for m in FIGURE.finditer(text)]
    assert free == ["1.3x"], f"README figures not quoted from benchmarks/results.json: {free}"
    # (1.3x: the broadcast's target, not a measurement)


def test_a_figure_changed_in_the_json_changes_on_every_page_that_quotes_it(tmp_path):
    quotable = results_table.figures(
        {"results": [{"id": "run", "figure": "1.5x in 3 min", "parts": {"time": "3 min"}}]}
    )
    page = (
        "a <!-- figure:run -->1.4x in 3 min<!-- /figure --> b\n"
        "c <!-- figure:run.time -->4 min<!-- /figure --> d <!-- figure:run -->old<!-- /figure -->"
    )
    assert results_table.requote(page, quotable, tmp_path / "p.md") == (
        "a <!-- figure:run -->1.5x in 3 min<!-- /figure --> b\n"
        "c <!-- figure:run.time -->3 min<!-- /figure --> d <!-- figure:run -->1.5x in 3 min<!-- /figure -->"
    )
    with pytest.raises(ValueError, match=r"p.md: <!-- figure:other --> names nothing"):
        results_table.requote("<!-- figure:other -->1<!-- /figure -->", quotable, tmp_path / "p.md")
    with pytest.raises(ValueError, match="part 'time' = '4 min' is not a piece of its figure"):
        results_table.figures(
            {"results": [{"id": "run", "figure": "1.5x", "parts": {"time": "4 min"}}]}
        )
