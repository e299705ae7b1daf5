"""README's and the guides' results tables are the committed reports' tables, line for line.

A table quoted in README.md or a page under docs/ is preceded by `<!-- from PATH -->` naming
the committed file it comes from (a report.md under results/). Every line of the table (or,
when the marker stands before a fenced block such as the main job's transcript, every table
line in that block) must be a line of that file, so a re-analysis that changes a number fails
here until the page is updated. Every table of fitted B_crit in those pages must carry such a
marker.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!-- from (\S+) -->")
RESULT_HEADERS = ("| target L | B_crit", "| examples seen |", "| size | B_crit",
                  "| run | seeds reached |")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _quoted_tables(lines):
    """[(marker line index, source path, [table lines])] for every marker in README."""
    out = []
    for i, line in enumerate(lines):
        m = MARK.fullmatch(line.strip())
        if not m:
            continue
        j = i + 1
        table = []
        if lines[j].startswith("```"):  # a transcript: its table lines
            j += 1
            while not lines[j].startswith("```"):
                if lines[j].startswith("|"):
                    table.append(lines[j])
                j += 1
        else:
            while j < len(lines) and lines[j].startswith("|"):
                table.append(lines[j])
                j += 1
        out.append((i, m.group(1), table))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_tables_match_the_committed_reports(page):
    lines = page.read_text().splitlines()
    for i, path, table in _quoted_tables(lines):
        assert table, f"{page.name} line {i + 1}: marker for {path} is not followed by a table"
        source = set((ROOT / path).read_text().splitlines())
        stale = [row for row in table if row not in source]
        assert not stale, (f"{page.name} line {i + 1}: {len(stale)} rows differ from {path} "
                           f"(rerun its analysis and copy the table), first: {stale[0]}")


def test_the_pages_quote_the_studies():
    quoted = {path for page in PAGES for _, path, _ in _quoted_tables(page.read_text()
                                                                      .splitlines())}
    assert {"results/shakespeare_kaplan/report.md", "results/digits_sgd/report.md"} <= quoted


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_table_names_its_source(page):
    lines = page.read_text().splitlines()
    covered = {row for _, _, table in _quoted_tables(lines) for row in table}
    for i, line in enumerate(lines):
        if line.startswith(RESULT_HEADERS):
            assert line in covered and lines[i + 2] in covered, (
                f"{page.name} line {i + 1}: a results table without a <!-- from PATH --> marker")


def test_readme_says_what_deterministic_covers():
    """README's "deterministic" is bit for bit on one machine and software stack; across
    machines the points move within their intervals. The other machine's row it quotes is the
    committed study's target (same B_crit and interval as results/digits), and each point lies
    inside the other's interval."""
    import json

    text = " ".join((ROOT / "README.md").read_text().split())
    assert ("Deterministic means: on one machine and software stack the same command gives the "
            "same records and table, bit for bit; across machines") in text
    assert "the points move within their intervals" in text
    m = re.search(r"the L = ([\d.]+) row read ([\d.]+) \(([\d.]+)–([\d.]+)\) against "
                  r"([\d.]+) \(([\d.]+)–([\d.]+)\)", text)
    assert m, "README quotes the row another machine gave"
    target, *numbers = map(float, m.groups())
    other, (here, lo, hi) = numbers[:3], numbers[3:]
    analysis = json.loads((ROOT / "results/digits/analysis.json").read_text())
    fit = next(t["fit"] for t in analysis["targets"] if t["target"] == target)
    assert [float(f"{v:.3g}") for v in (fit["b_crit"], *fit["b_crit_ci"])] == [here, lo, hi]
    assert lo <= other[0] <= hi and other[1] <= here <= other[2]
