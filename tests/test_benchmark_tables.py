"""BENCHMARKS.md's tables are benchmarks/tables.py's output from the committed results JSON: regenerated in memory,
each must equal the committed one, and a changed results file shows up as a difference naming its table."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_table_in_benchmarks_md_is_generated_from_its_results(tables):
    text = (ROOT / "BENCHMARKS.md").read_text()
    names = tables.marked_names(text)
    assert sorted(names) == sorted(tables.TABLES), "each table of TABLES appears once in BENCHMARKS.md"
    _, changed = tables.update(text)
    assert not changed, f"tables differing from their results files (run `make tables`): {changed}"


def test_no_table_outside_the_markers(tables):
    """Every markdown table of BENCHMARKS.md lies between a table's markers."""
    outside = tables.MARKED.sub("", (ROOT / "BENCHMARKS.md").read_text())
    assert not [line for line in outside.splitlines() if line.startswith("| ")]


def test_each_table_names_its_sources(tables):
    for name, spec in tables.TABLES.items():
        body = tables.render(name)
        assert all(f"benchmarks/results/{f}" in body for f in spec["files"]), name


def test_a_changed_result_is_caught_and_named(tables, tmp_path):
    results = tmp_path / "results"
    name = tables.TABLES["lifecycle"]["files"][0]
    (results / name).parent.mkdir(parents=True)
    shutil.copy(tables.RESULTS / name, results / name)
    text = (ROOT / "BENCHMARKS.md").read_text()
    record = json.loads((results / name).read_text())
    record["loop"]["routed"][0] += 1.0  # the routed call's first call one second longer
    record["loop"]["hf-ar"] = record["loop"]["hf-static-ar"]  # and a method a newer run may add
    (results / name).write_text(json.dumps(record))
    rendered = tables.render("lifecycle", results)
    assert f"| the routed `assistant_model=` call | {record['loop']['routed'][0]:.1f} |" in rendered
    assert "stock AR" in rendered
    marked = tables.MARKED.search(text.split("<!-- table: lifecycle-later-calls -->")[0]).group(0)
    _, changed = tables.update(marked, results)
    assert changed == ["lifecycle"]


def test_check_mode_exits_nonzero_and_names_the_table(tables, tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    text = (ROOT / "BENCHMARKS.md").read_text()
    start = text.index("<!-- table: lifecycle -->")
    cell = re.compile(r"\| (\d+\.\d+) \|").search(text, start)  # the lifecycle table's first figure, changed
    doc.write_text(text[: cell.start(1)] + "999.9" + text[cell.end(1):])
    assert tables.main(["--check", "--file", str(doc)]) == 1
    assert "'lifecycle'" in capsys.readouterr().out
    assert tables.main(["--file", str(doc)]) == 0 and tables.main(["--check", "--file", str(doc)]) == 0


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_benchmarks_md_names_one_of_its_sections():
    headings = re.findall(r"^#+ (.+)$", (ROOT / "BENCHMARKS.md").read_text(), re.M)
    anchors = {_anchor(h) for h in headings}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for anchor in re.findall(r"BENCHMARKS\.md#([^)\s]+)", page.read_text()):
            assert anchor in anchors, f"{page.name}: BENCHMARKS.md#{anchor} is no section"


def test_no_test_counts_or_suite_times_in_prose():
    """The suites print their counts and times; README, docs/ and the Makefile's comments quote none."""
    pages = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        found = re.findall(r"\b\d+ (?:passed|skipped|failed)\b", page.read_text())
        assert not found, f"{page.name}: {found}"
