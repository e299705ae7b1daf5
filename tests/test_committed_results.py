"""Every committed study's report is what today's code writes from its records: the Markdown
byte for byte, the JSON to the last bits a different BLAS may change. Sweeps, branch
studies, ramp studies, the cross-study comparison and the model-size pooling.

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
import shutil

import _warm
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


def _in_copy(tmp_path, monkeypatch, name: str, linked: tuple[str, ...] = ()) -> pathlib.Path:
    """A copy of results/NAME under tmp_path/results (the other studies it reads linked), the
    working directory set to tmp_path: a report written there names the committed path."""
    shutil.copytree(ROOT / "results" / name, tmp_path / "results" / name)
    for other in linked:
        (tmp_path / "results" / other).symlink_to(ROOT / "results" / other)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "results" / name


@pytest.mark.parametrize("name, sweep", [("digits_branch", "digits"),
                                         ("shakespeare_branch", "shakespeare_char")])
def test_a_committed_branch_study_reports_the_same(name, sweep, tmp_path, monkeypatch):
    from cbs.analysis.reports import branch_report
    copy = _in_copy(tmp_path, monkeypatch, name, (sweep,))
    (copy / "report.md").unlink()
    branch_report.write_report(f"results/{name}", sweep_dir=f"results/{sweep}")
    assert (copy / "report.md").read_text() == (ROOT / "results" / name / "report.md").read_text()


@pytest.mark.parametrize("name, sweep", [("digits_payoff", "digits"),
                                         ("digits_ramp_start", "digits"),
                                         ("shakespeare_payoff", "shakespeare_char")])
def test_a_committed_payoff_study_reports_the_same(name, sweep, tmp_path, monkeypatch):
    from cbs.analysis.studies import payoff
    from cbs.results import files, shared
    committed = ROOT / "results" / name
    copy = _in_copy(tmp_path, monkeypatch, name)
    for out in ("payoff.md", "payoff.json"):
        (copy / out).unlink()
    ramps = shared.read_merged(str(copy / files.RAMPS_FILE), files.RAMP_KEYS)
    before = json.loads((committed / "payoff.json").read_text())
    payoff.write_report(f"results/{name}", ramps, [t["target"] for t in before["targets"]],
                        sweep_dir=f"results/{sweep}")
    assert (copy / "payoff.md").read_text() == (committed / "payoff.md").read_text()
    assert _close(json.loads((copy / "payoff.json").read_text()), before, "payoff") == []


COMPARED = ["digits", "digits_sgd", "mnist1d_adam", "mnist1d_sgd", "shakespeare_kaplan",
            "shakespeare_kaplan_d32", "shakespeare_kaplan_d128", "shakespeare_char",
            "linreg_sgd"]
HELD_OUT = ["heldout_teacher_student", "heldout_lm_depth4", "heldout_digits_cnn",
            "heldout_mnist1d_cnn", "heldout_regression"]


@pytest.mark.parametrize("name, args, outputs", [
    ("compare", [f"results/{n}" for n in COMPARED]
     + ["--held_out=" + ",".join(f"results/{n}" for n in HELD_OUT)],
     ("report.md", "calibration.json", "compare.json")),
    ("kaplan_sizes", ["--sizes"] + [f"results/{n}" for n in (
        "shakespeare_kaplan_d32", "shakespeare_kaplan", "shakespeare_kaplan_d128")],
     ("report.md", "sizes.json")),
])
def test_the_committed_cross_study_reports_are_what_the_command_writes(name, args, outputs,
                                                                       tmp_path):
    """The commands of the across-studies guide and README, into a temporary --out."""
    out = _warm.python(["-m", "cbs.commands.compare", *args, f"--out={tmp_path / name}"],
                       cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for file in outputs:
        fresh, committed = tmp_path / name / file, ROOT / "results" / name / file
        if file.endswith(".md"):
            assert fresh.read_text() == committed.read_text(), file
        else:
            assert _close(json.loads(fresh.read_text()), json.loads(committed.read_text()),
                          file) == []
