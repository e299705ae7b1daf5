"""Tests of cbs.analysis.reports.report on trial records written by hand (no training): the best
learning rate per batch size, the fit of S = S_min(1 + B_crit/B) on exact data, the mark of a
B_crit outside the batch sizes fitted, the measured noise scale at a target, and the report
file of a sweep directory."""

from __future__ import annotations

import os

import pytest

from cbs.analysis.reports import report, report_tables
from cbs.results import files, records, store

S_MIN, B_CRIT = 100.0, 64.0


def _record(index, b, lr, steps, *, status="done", b_simple=None):
    """A trial record whose steps to the target L = 0.5 are `steps` (None: never reached)."""
    noise = {} if steps is None or b_simple is None else {"b_simple": b_simple}
    end = steps or 1000
    curve = {"step": [0, end], "examples": [0, end * b], "full_train/loss": [2.0, 0.5],
             "noise/step": [0, end], "noise/b_simple": [b_simple, b_simple]}
    return store.TrialResult(
        trial_id=f"b{b}_lr{lr}", index=index, batch_size=b, learning_rate=lr, seed=0,
        status=status, target_metric="full_train/loss", steps_to_target={"0.5": steps},
        examples_to_target={"0.5": None if steps is None else steps * b},
        noise_at_target={"0.5": noise}, final_steps=int(steps or 1000), final_metric=0.4,
        curve=curve, seconds=0.0).to_json()


def _records(batch_sizes, b_crit=B_CRIT):
    """Two learning rates per B: the faster one exactly on the hyperbola, the other 1.5× slower;
    and a diverged third rate at the largest B."""
    out = []
    for b in batch_sizes:
        s = S_MIN * (1 + b_crit / b)
        out.append(_record(len(out), b, 0.01, 1.5 * s, b_simple=1000.0))
        out.append(_record(len(out), b, 0.02, s, b_simple=float(b)))
    out.append(_record(len(out), batch_sizes[-1], 0.04, None, status="diverged"))
    return out


def test_best_rate_per_batch_size_and_the_exact_fit():
    t = report.analyze_target(_records([8, 16, 32, 64, 128, 256, 512]), 0.5, bootstrap=0)
    assert t["learning_rates"] == [0.02] * 7
    assert t["fit"].b_crit == pytest.approx(B_CRIT, rel=1e-6)
    assert t["fit"].s_min == pytest.approx(S_MIN, rel=1e-6)
    assert not t["b_crit_extrapolated"]
    assert t["measured_b_simple"] == 64.0  # median over the best trials' own measurements
    assert t["unreached"] == [{"batch_size": 512, "learning_rate": 0.04, "status": "diverged"}]


def test_b_crit_outside_the_fitted_batch_sizes_is_marked_extrapolated():
    t = report.analyze_target(_records([256, 512, 1024], b_crit=16.0), 0.5, bootstrap=0)
    assert t["fit"].b_crit == pytest.approx(16.0, rel=1e-6)
    assert t["b_crit_extrapolated"]
    analysis = {"targets": [t | {"fit": t["fit"].to_dict()}],
                "power_law": {"status": "insufficient data"}}
    row = report_tables.summary_table(analysis).splitlines()[2]
    assert row.startswith("| 0.5 | 16 (extrapolated) |") and row.endswith("| 3 | ok |")


def test_too_few_batch_sizes_give_no_fit_and_dashes():
    t = report.analyze_target(_records([8, 16]), 0.5, bootstrap=0)
    assert not t["fit"].ok and not t["b_crit_extrapolated"]
    analysis = {"targets": [t | {"fit": t["fit"].to_dict()}],
                "power_law": {"status": "insufficient data"}}
    assert "| 0.5 | – | – | – |" in report_tables.summary_table(analysis)


def test_report_of_a_sweep_directory(tmp_path):
    d = str(tmp_path)
    st = store.SweepStore(d)
    os.makedirs(d, exist_ok=True)
    records.append_records(st.path, _records([8, 16, 32, 64, 128, 256, 512]))
    path = report.write_report(d, bootstrap=0)
    text = open(path).read()
    assert "15 trials (1 diverged, 14 done)" in text
    assert "| 0.5 | 64 |" in text  # B_crit, no interval without bootstrap, not extrapolated
    analysis = report.load_analysis(d)
    assert analysis["targets"][0]["fit"]["b_crit"] == pytest.approx(B_CRIT, rel=1e-6)
    assert os.path.exists(os.path.join(d, files.ANALYSIS_FILE))


def test_seed_spread_fits_each_seed_and_measures_the_spread_of_steps():
    """Seed 1's steps are seed 0's × 1.1 at every (B, η): each seed alone fits the same
    B_crit (a constant factor changes S_min only), and the spread (max − min)/mean is
    0.1/1.05 at every batch size. One seed gives no seed section."""
    base = _records([8, 16, 32, 64, 128, 256, 512])
    other = []
    for r in base:
        r1 = dict(r, seed=1, trial_id=r["trial_id"] + "_s1", index=r["index"] + 100)
        steps = r["steps_to_target"]["0.5"]
        r1["steps_to_target"] = {"0.5": None if steps is None else steps * 1.1}
        other.append(r1)
    rows = report.seed_spread(base + other, [0.5], bootstrap=0)
    assert len(rows) == 1
    per_seed = rows[0]["b_crit_per_seed"]
    assert per_seed["0"] == pytest.approx(B_CRIT, rel=1e-6)
    assert per_seed["1"] == pytest.approx(B_CRIT, rel=1e-6)
    assert rows[0]["steps_spread_median"] == pytest.approx(0.1 / 1.05, rel=1e-9)
    assert rows[0]["steps_spread_max"] == pytest.approx(0.1 / 1.05, rel=1e-9)
    assert report.seed_spread(base, [0.5]) == []


def test_a_collapsed_interval_is_flagged_unresolved(tmp_path):
    """Three batch sizes give a bootstrap interval with no width ("67 (67–67)" read as a 95 %
    interval): the table says "unresolved (3 batch sizes)" and the notes say what to do."""
    recs = []
    for b, wiggle in ((8, 1.1), (32, 0.93), (128, 1.05)):
        s = wiggle * S_MIN * (1 + 64 / b)
        recs += [_record(len(recs), b, 0.01, 1.5 * s), _record(len(recs) + 1, b, 0.02, s)]
    d = str(tmp_path)
    records.append_records(store.SweepStore(d).path, recs)
    text = open(report.write_report(d, bootstrap=200)).read()
    f = report.load_analysis(d)["targets"][0]["fit"]
    assert f["b_crit_ci"][0] == pytest.approx(f["b_crit_ci"][1], rel=1e-6)
    row = report_tables.summary_table(report.load_analysis(d)).splitlines()[2]
    assert row.startswith("| 0.5 | 67, unresolved (3 batch sizes) |")
    assert "(67–67)" not in row
    assert ("L=0.5: B_crit unresolved: its bootstrap interval from 3 batch sizes has no width "
            "(67–67); sweep more batch sizes to resolve it.") in text
    # points exactly on the curve: a zero-width interval that is no failure to resolve
    assert not report_tables.unresolved(f | {"residual_std": 4e-16})
    assert not report_tables.unresolved(f | {"b_crit_ci": [66.4, 67.9]})


def test_cbs_analyze_out_re_reports_a_study_elsewhere(tmp_path):
    """`cbs-analyze --out=DIR` writes report.md, analysis.json and the figures into DIR and
    nothing into the sweep directory (a committed or read-only study); without --out a
    read-only one is refused in one line naming --out (where chmod holds: not for root)."""
    import _warm

    study = tmp_path / "study"
    study.mkdir()
    records.append_records(store.SweepStore(str(study)).path,
                           _records([8, 16, 32, 64, 128, 256, 512]))
    before = {p: p.stat().st_mtime_ns for p in study.rglob("*")}
    out = tmp_path / "elsewhere" / "report"
    done = _warm.python(["-m", "experiments.analyze", f"--sweep_dir={study}", f"--out={out}",
                         "--bootstrap=20"])
    assert done.returncode == 0, done.stderr
    assert {p: p.stat().st_mtime_ns for p in study.rglob("*")} == before
    assert done.stdout.strip().endswith(f"report: {out / files.REPORT_FILE}")
    text = (out / files.REPORT_FILE).read_text()
    assert f"# Critical batch size report: `{study}`" in text
    for name in ("pareto", "collapse"):
        assert f"![{name}]({files.FIGURES_DIR}/{name}.png)" in text
        assert (out / files.FIGURES_DIR / f"{name}.png").stat().st_size > 1000
    assert report.load_analysis(str(out))["targets"][0]["fit"]["status"] == "ok"
    if os.geteuid() == 0:
        return
    study.chmod(0o555)
    try:
        refused = _warm.python(["-m", "experiments.analyze", f"--sweep_dir={study}",
                                "--bootstrap=20"])
    finally:
        study.chmod(0o755)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "write the report elsewhere with --out=DIR" in refused.stderr
