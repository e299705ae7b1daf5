"""Tests of cbs.analysis.fits.joint: the joint batch-size bootstrap of B_crit(L) and α_B."""

import math

import numpy as np
import pytest

from cbs.analysis.fits import fit, joint, selection

BATCH_SIZES = np.array([4, 8, 16, 32, 64, 128, 256, 512.0])
LOSSES = np.array([2.5, 2.4, 2.3, 2.2, 2.1])
ALPHA = 0.15


def _b_crit(losses, alpha=ALPHA):
    return 50.0 * (2.1 / np.asarray(losses)) ** (1 / alpha)


def _sweep(rng, b_crit, shared=0.08, own=0.04, seeds=2):
    """Tables and point fits of a synthetic two-seed sweep: S = S_min + E_min/B per target,
    with a multiplicative error shared by every target of one (B, seed) trial (the same run
    crosses every target) and a smaller one of its own."""
    common = shared * rng.standard_normal((BATCH_SIZES.size, seeds))
    tables, points = [], []
    for bc in b_crit:
        s_min = 2000.0 / bc
        s = (s_min + s_min * bc / BATCH_SIZES)[:, None] * np.exp(
            common + own * rng.standard_normal((BATCH_SIZES.size, seeds)))
        rows = [{"batch_size": b, "learning_rate": 1e-3, "seed": sd, "steps": float(s[i, sd])}
                for i, b in enumerate(BATCH_SIZES) for sd in range(seeds)]
        table = selection.best_per_batch_size(rows)
        tables.append(table)
        points.append(fit.fit_tradeoff(table.batch_sizes, table.steps, bootstrap=0))
    return tables, points


def test_exact_sweep_gives_the_true_values_with_zero_width():
    rng = np.random.default_rng(0)
    tables, points = _sweep(rng, _b_crit(LOSSES), shared=0.0, own=0.0)
    j = joint.joint_bootstrap(tables, LOSSES, points, n=200)
    for (lo, hi), bc in zip(j.b_crit_ci, _b_crit(LOSSES), strict=True):
        assert lo == pytest.approx(bc, rel=1e-6) and hi == pytest.approx(bc, rel=1e-6)
    np.testing.assert_allclose(j.alpha_b_ci, (ALPHA, ALPHA), rtol=1e-6)
    np.testing.assert_allclose(j.local_slopes, -1 / ALPHA, rtol=1e-6)


def test_coverage_on_synthetic_sweeps():
    """60 synthetic sweeps (8 batch sizes, 2 seeds, errors shared across targets): the 95%
    B_crit intervals cover the truth in ≥ 85 % of sweeps at every target (nominal 95 %; with
    60 sweeps a true 95 % falls below 85 % with probability < 0.1 %), α_B's interval in
    ≥ 85 %, and the misfit test rejects a true power law in ≤ 15 % (nominal 5 %). A run with
    200 sweeps gave 94.5–95.5 % for B_crit, 99.5 % for α_B and 5 % false rejections."""
    rng = np.random.default_rng(1)
    n, hit_b, hit_a, rejected = 60, np.zeros(LOSSES.size), 0, 0
    truth = _b_crit(LOSSES)
    for _ in range(n):
        tables, points = _sweep(rng, truth)
        j = joint.joint_bootstrap(tables, LOSSES, points, n=300)
        hit_b += [lo <= bc <= hi for (lo, hi), bc in zip(j.b_crit_ci, truth, strict=True)]
        hit_a += j.alpha_b_ci[0] <= ALPHA <= j.alpha_b_ci[1]
        rejected += not j.power_law_supported
    assert np.all(hit_b / n >= 0.85), hit_b / n
    assert hit_a / n >= 0.85 and rejected / n <= 0.15


def test_misfit_check_rejects_a_bent_trend():
    """B_crit flat then steep (local α 0.07 then 0.25): one power law does not fit, and the
    local slopes say where it bends."""
    log_l = np.log(LOSSES)
    log_bc = np.where(LOSSES >= 2.3, -(1 / 0.07) * (log_l - np.log(2.3)),
                      -(1 / 0.25) * (log_l - np.log(2.3))) + np.log(40.0)
    tables, points = _sweep(np.random.default_rng(2), np.exp(log_bc), shared=0.03, own=0.02)
    j = joint.joint_bootstrap(tables, LOSSES, points, n=500)
    assert j.power_law_supported is False and j.misfit_p < 0.01
    first, last = -1 / j.local_slopes[0], -1 / j.local_slopes[-1]
    assert first == pytest.approx(0.07, rel=0.3) and last == pytest.approx(0.25, rel=0.3)


def test_intervals_depend_on_the_records_alone():
    rng = np.random.default_rng(3)
    truth = _b_crit(LOSSES)
    tables, points = _sweep(rng, truth)
    a = joint.joint_bootstrap(tables, LOSSES, points, n=200)
    # The same records in another order select the same steps, hence the same seed.
    shuffled = []
    for t in tables:
        rows = [{"batch_size": b, "learning_rate": 1e-3, "seed": sd, "steps": s}
                for b, ss in zip(t.batch_sizes, t.seed_steps, strict=True)
                for sd, s in enumerate(ss)]
        shuffled.append(selection.best_per_batch_size(rows[::-1]))
    b = joint.joint_bootstrap(shuffled, LOSSES, points, n=200)
    assert a.seed == b.seed == joint.data_seed(tables)
    assert a.b_crit_ci == b.b_crit_ci and a.alpha_b_ci == b.alpha_b_ci
    assert all(math.isfinite(v) for ci in a.b_crit_ci for v in ci)


def test_an_unbounded_interval_side_is_inf_not_an_error(monkeypatch):
    # A bootstrap-t bound past float range (few batch sizes, a near-degenerate replicate)
    # used to raise OverflowError from math.exp and lose the whole report.
    rng = np.random.default_rng(1)
    tables, points = _sweep(rng, _b_crit(LOSSES[:2]))
    monkeypatch.setattr(fit, "studentized", lambda est, *a: (est - 1.0, 1e4))
    j = joint.joint_bootstrap(tables, LOSSES[:2], points, n=50)
    for (lo, hi), p in zip(j.b_crit_ci, points, strict=True):
        assert lo == pytest.approx(p.b_crit / math.e) and hi == math.inf


def test_report_prints_an_unbounded_side_as_infinity():
    from cbs.analysis.reports import report_tables

    assert report_tables._ci((71.5, math.inf)) == "71.5–∞"
    assert report_tables._ci((1.0, math.nan)) == "1–\u2013"
