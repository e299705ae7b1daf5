"""Every committed sweep's report is what today's code writes from its records: report.md
byte for byte and analysis.json to the last bits a different BLAS may change.

Each committed sweep under results/ (a directory with analysis.json) is re-reported into a
temporary directory with `cbs.analysis.reports.report.write_report`, from the repository's
root so that the report's heading names the same path. The printed report must match byte for
byte: it is what README, the guides and the cross-study fits quote. analysis.json's numbers
must match to a relative 1e-6: its floats are written with all their digits; float64 sums in
another order (another numpy/BLAS build) move the last one or two (4e-15 relative on
results/digits), and the iterative fits (least squares, the misfit's generalised least
squares) stop at a tolerance near 1e-8, so such a difference in their input moves their
output by up to that (measured: 1.2e-8 relative at most on this machine), which no printed
number shows.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from cbs.analysis.reports import report

ROOT = pathlib.Path(__file__).resolve().parent.parent
SWEEPS = sorted(p.parent.name for p in (ROOT / "results").glob("*/analysis.json"))


def _close(a, b, where: str) -> list[str]:
    """Where `a` and `b` differ beyond a relative 1e-6 (numbers) or at all (the rest)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _close(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _close(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-300):
            return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_the_committed_sweeps_are_found():
    assert len(SWEEPS) >= 16 and "digits" in SWEEPS


@pytest.mark.parametrize("name", SWEEPS)
def test_a_committed_sweep_reports_the_same(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    committed = ROOT / "results" / name
    analysis = json.loads((committed / "analysis.json").read_text())
    held_out = analysis.get("held_out") or [{}]
    select = held_out[0].get("select_on_seed")
    report.write_report(os.path.join("results", name), out_dir=str(tmp_path),
                        select_on_seed=select)
    assert (tmp_path / "report.md").read_text() == (committed / "report.md").read_text()
    fresh = json.loads((tmp_path / "analysis.json").read_text())
    assert _close(fresh, analysis, "analysis") == []
