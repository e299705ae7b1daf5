"""The B_crit calibration (its fit, `cbs.analysis.advice.calibration`, and its prediction and
shipped file, `cbs.results.calibration`): coverage on synthetic studies with a known ratio, the
trade-off arithmetic, and the shipped file."""

import math
import os

import numpy as np
import pytest

from cbs.analysis.advice import calibration
from cbs.analysis.fits import fit
from cbs.results import calibration as calibration_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(rng, *, studies, points=5, mu=(("adam", 0.7), ("sgd", -0.4)), tau=0.3, sigma=0.3,
          prefix="s"):
    """Synthetic studies: log(B_crit/B_simple) = μ_family + a_study + e_point."""
    rows = []
    for j in range(studies):
        opt, m = mu[j % len(mu)]
        a = tau * rng.normal()
        for k in range(points):
            b_simple = float(np.exp(rng.uniform(1, 7)))
            rows.append({"study": f"{prefix}{j}", "optimizer": opt, "target": 1.0 / (k + 1),
                         "b_simple": b_simple,
                         "b_crit": b_simple * math.exp(m + a + sigma * rng.normal())})
    return rows


def test_prediction_intervals_cover_new_studies_at_their_level():
    """Calibrate on 10 synthetic studies, predict the points of a new one; over 1,500
    repetitions the 80 % interval holds 80 % ± 3 % of the new points (s.e. 1 % here: the
    points of one study are correlated, so the spread is wider than 7,500 independent
    points')."""
    rng = np.random.default_rng(0)
    hits = []
    for _ in range(1500):
        rows = _rows(rng, studies=10)
        model = calibration.model(rows, "b_simple")
        new = _rows(rng, studies=1, prefix="new")
        for r in new:
            lo, hi = calibration_file.predict(model, r["b_simple"], r["optimizer"])["interval"]
            hits.append(lo <= r["b_crit"] <= hi)
    assert abs(np.mean(hits) - 0.8) < 0.03


def test_the_t_quantile_is_scipys():
    from scipy import stats

    for p in (0.6, 0.9, 0.975):
        for dof in (1, 2, 7, 30.5):
            assert calibration_file.t_quantile(p, dof) == stats.t.ppf(p, dof)


def test_the_fitted_ratio_recovers_the_true_one():
    rng = np.random.default_rng(1)
    model = calibration.model(_rows(rng, studies=60), "b_simple")
    assert model["families"]["adaptive"]["mu"] == pytest.approx(0.7, abs=0.15)
    assert model["families"]["sgd"]["mu"] == pytest.approx(-0.4, abs=0.15)
    assert model["tau2"] == pytest.approx(0.09, abs=0.06)
    assert model["sigma2"] == pytest.approx(0.09, abs=0.03)


def test_leave_one_task_out_holds_each_task_out():
    rng = np.random.default_rng(2)
    rows = [dict(r, task=f"t{int(r['study'][1:]) // 2}") for r in _rows(rng, studies=8)]
    loto = calibration.leave_one_task_out(rows, "b_simple")
    assert set(loto["per_task"]) == {f"t{j}" for j in range(4)} and loto["tasks"] == 4
    assert loto["points"] == 40
    # a task far off its family's ratio is outside the interval fitted without it
    bad = [dict(r, b_crit=r["b_crit"] * 50) if r["task"] == "t0" else r for r in rows]
    assert calibration.leave_one_task_out(bad, "b_simple")["per_task"]["t0"]["covered"] == 0


def test_points_are_one_run_values_and_extrapolated_targets_give_none():
    row = {"study": "s", "task": "t", "optimizer": "adam", "target": 1.0, "b_crit": 100.0,
           "b_simple": 50.0, "b_simple_by_batch_size": {"16": 40.0, "64": 60.0, "256": 80.0}}
    points = calibration._points([row], "b_simple")
    assert sorted(math.exp(p[2]) for p in points) == pytest.approx([1.25, 100 / 60, 2.5])
    assert {p[0] for p in points} == {"t | adaptive"} and {p[3] for p in points} == {"t"}
    assert calibration._points([dict(row, extrapolated=True)], "b_simple") == []
    assert len(calibration._points([{k: v for k, v in row.items()
                                     if k != "b_simple_by_batch_size"}], "b_simple")) == 1


def test_the_shipped_interval_holds_on_tasks_left_out():
    """What the advice prints: on the committed studies, the 80 % interval fitted without a
    task holds that task's one-run noise scales (each best trial's B_simple at each target)
    at least 80 % of the time, pooled over tasks; the Kaplan sizes and the depth-4 LM are
    one task, and no extrapolated B_crit is a point."""
    shipped = calibration_file.shipped()
    rows = shipped["points"]
    assert shipped["unit"] == calibration.UNIT
    loto = calibration.leave_one_task_out(rows, "b_simple")
    assert loto == shipped["models"]["b_simple"]["loto"]
    assert loto["coverage"] >= 0.8 and loto["tasks"] >= 4
    tasks = {r["study"]: r["task"] for r in rows}
    assert len({tasks[s] for s in tasks if s.startswith("shakespeare")}) == 1
    assert loto["points"] > 5 * len(rows)  # several batch sizes per (study, target)
    assert not any(r.get("extrapolated") for r in rows
                   if calibration._points([r], "b_simple"))


def test_the_tradeoff_arithmetic_is_the_fitted_hyperbola():
    # S(B) = S_min + E_min/B with B_crit = E_min/S_min
    s_min, b_crit = 12.0, 300.0
    e_min = s_min * b_crit
    for b in (16.0, 300.0, 4096.0):
        t = calibration_file.tradeoff(b, b_crit)
        steps = s_min + e_min / b
        assert t["steps_ratio"] == pytest.approx(steps / s_min)
        assert t["examples_ratio"] == pytest.approx(b * steps / e_min)
    # the batch minimising λ·S + E, by brute force over a fine grid
    for lam in (10.0, 300.0, 5000.0):
        grid = np.geomspace(1, 1e6, 200_001)
        cost = lam * (s_min + e_min / grid) + grid * (s_min + e_min / grid)
        best = calibration_file.tradeoff(64.0, b_crit, exchange=lam)["best_batch_size"]
        assert best == pytest.approx(grid[np.argmin(cost)], rel=1e-3)
    assert calibration_file.tradeoff(64.0, b_crit, exchange=b_crit)["best_batch_size"] == (
        pytest.approx(b_crit))
    assert fit.OK  # the same trade-off the sweeps fit


def test_the_shipped_calibration_is_the_committed_studies():
    import json
    import pathlib

    shipped = calibration_file.shipped()
    root = pathlib.Path(__file__).resolve().parent.parent
    committed = json.loads((root / "results/compare/calibration.json").read_text())
    assert shipped == committed
    assert shipped["version"] == calibration.VERSION
    assert len(shipped["studies"]) >= 9
    with pytest.raises(ValueError, match="no calibrated family"):
        calibration_file.family("lion")


def test_the_held_out_tally_is_what_the_committed_predictions_and_sweeps_give():
    """Five tasks, each predicted from one run before its sweep (results/heldout_*_predict),
    against the sweep's B_crit: the tally the shipped calibration prints, task by task."""
    from cbs.analysis.studies import compare
    names = ("teacher_student", "lm_depth4", "digits_cnn", "mnist1d_cnn", "regression")
    dirs = [os.path.join(ROOT, "results", f"heldout_{n}") for n in names]
    tally = calibration.held_out(compare.held_out_pairs(dirs))
    shipped = calibration_file.shipped()["held_out"]
    assert (tally["inside"], tally["points"], tally["extrapolated"]) == (16, 25, 0)
    assert {k: (v["inside"], v["points"]) for k, v in tally["per_task"].items()} == {
        "heldout_teacher_student": (1, 5), "heldout_lm_depth4": (4, 5),
        "heldout_digits_cnn": (5, 5), "heldout_mnist1d_cnn": (5, 5),
        "heldout_regression": (1, 5)}
    assert tally == shipped
