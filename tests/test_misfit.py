"""The calibrated misfit test of the power law (`cbs.analysis.fits.misfit`) on synthetic studies."""

import numpy as np
import pytest

from cbs.analysis.fits import fit, joint, misfit
from cbs.analysis.fits.selection import BestPerBatchSize

LOSSES = [0.5, 0.3, 0.2, 0.1, 0.05]
BATCH = np.array([2.0**k for k in range(2, 11)])  # 4 … 1024, nine batch sizes


def _study(rng, *, shared=0.1, own=0.05, kink=0.0):
    """One seed, five targets on B_crit(L) = 40·(0.5/L)^1.2, S = S_min(1 + B_crit/B) times
    log-normal noise shared by the targets at each batch size (the same trial gives them all)
    plus noise of each target's own; `kink` moves the middle target's B_crit off the law by
    that factor."""
    a = shared * rng.normal(size=BATCH.size)
    tables, points = [], []
    for i, loss in enumerate(LOSSES):
        b_crit = 40 * (0.5 / loss) ** 1.2 * (kink if kink and i == 2 else 1.0)
        s = 5 / loss * (1 + b_crit / BATCH) * np.exp(a + own * rng.normal(size=BATCH.size))
        tables.append(BestPerBatchSize(BATCH, s, BATCH * s, np.zeros_like(BATCH),
                                       np.ones_like(BATCH), [], [], [],
                                       seed_steps=[[v] for v in s]))
        points.append(fit.fit_tradeoff(BATCH, s, bootstrap=0))
    return tables, points


def test_gls_q_is_the_generalised_least_squares_minimum():
    rng = np.random.default_rng(0)
    X = np.stack([np.ones(5), np.log(LOSSES)], axis=1)
    A = rng.normal(size=(5, 5))
    C = A @ A.T + 5 * np.eye(5)
    Y = rng.normal(size=(3, 5))
    Ci = np.linalg.inv(C)
    for y, got in zip(Y, joint.gls_q(X, Y, C), strict=True):
        beta = np.linalg.solve(X.T @ Ci @ X, X.T @ Ci @ y)
        assert got == pytest.approx((y - X @ beta) @ Ci @ (y - X @ beta), rel=1e-10)
    per_row = joint.gls_q(X, Y, np.stack([C, 2 * C, 4 * C]))
    np.testing.assert_allclose(per_row, joint.gls_q(X, Y, C) / [1, 2, 4], rtol=1e-10)


def test_a_target_off_the_law_is_rejected_and_named():
    tables, points = _study(np.random.default_rng(1), shared=0.05, own=0.03, kink=2.5)
    c = misfit.calibrated_misfit(tables, LOSSES, points, n=400, seed=0)
    assert c.p < 0.01
    assert c.breaking_target == 2 and c.without_target[2] > 0.05


def test_p_values_under_a_true_law_are_roughly_uniform():
    # 40 one-seed studies on an exact power law: the mean p of a calibrated test is 1/2
    # (± 0.05 = 1 s.e. of 40 uniform draws, ± 0.15 here) and few reject at 5 % (P(≥ 7 of 40)
    # = 0.003 at the nominal rate); the χ² reading of the same studies rejects far more often.
    rng = np.random.default_rng(2)
    p_cal, p_chi2 = [], []
    for i in range(40):
        tables, points = _study(rng)
        p_cal.append(misfit.calibrated_misfit(tables, LOSSES, points, n=200, seed=i).p)
        p_chi2.append(joint.joint_bootstrap(tables, LOSSES, points, n=100, seed=i).misfit_p)
    assert 0.35 < np.mean(p_cal) < 0.65
    assert np.sum(np.asarray(p_cal) < 0.05) <= 6
    assert np.sum(np.asarray(p_chi2) < 0.05) > np.sum(np.asarray(p_cal) < 0.05)


@pytest.mark.slow
def test_the_calibrated_test_has_its_nominal_size():
    """400 one-seed studies under an exact law: rejections at 5 % within 5 % ± 2 %."""
    rng = np.random.default_rng(3)
    p = []
    for i in range(400):
        tables, points = _study(rng)
        p.append(misfit.calibrated_misfit(tables, LOSSES, points, n=500, seed=i).p)
    rate = float(np.mean(np.asarray(p) < 0.05))
    assert 0.03 <= rate <= 0.07, rate
