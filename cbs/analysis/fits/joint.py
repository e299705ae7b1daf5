"""Intervals for B_crit at every target and for the power law B_crit(L), from one bootstrap.

Letters as in `cbs.analysis.fits.fit`. Every target is read off the *same* trials, so their
B_crit share errors: a residual bootstrap of the power law through them measures how far they
lie off a line, not how well they are measured. Here the batch sizes are resampled *jointly
for all targets* (and within each its seeds), and each replicate refits every target and the
power law (the case bootstrap of Davison & Hinkley 1997, §6.2.4, batch sizes as cases).

- B_crit at each target: bootstrap-t, se from each replicate's weighted least squares.
- α_B, B* and the slope −1/α_B: percentile intervals of the replicates' power-law fits.
- Misfit: Q = min_β (y − Xβ)ᵀC⁻¹(y − Xβ), C the replicates' covariance of log B_crit across
  targets, against χ² on (targets − 2) degrees of freedom; and the local slopes between
  adjacent targets with percentile intervals (a trend in them is curvature α_B averages away).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats

from cbs.analysis.fits import fit, selection

__all__ = ["METHOD_B_CRIT", "METHOD_POWER_LAW", "JointIntervals", "data_seed", "gls_q",
           "joint_bootstrap"]

METHOD_B_CRIT = ("bootstrap-t over batch sizes (resampled jointly across targets, seeds "
                 "resampled within each batch size)")
METHOD_POWER_LAW = ("percentile bootstrap over batch sizes (resampled jointly across targets, "
                    "seeds within each batch size), power law refitted per replicate")


@dataclasses.dataclass(frozen=True)
class JointIntervals:
    """What `joint_bootstrap` returns (NaN where a quantity could not be formed).
    local_slopes: d log B_crit / d log L between adjacent targets. misfit_*: the GLS χ² test.
    n_replicates: those with a B_crit at every target; log_b_crit_cov: their covariance of
    log B_crit over the targets with a fit (indices `cov_targets`)."""

    b_crit_ci: list[tuple[float, float]]
    alpha_b_ci: tuple[float, float]
    b_star_ci: tuple[float, float]
    slope_ci: tuple[float, float]
    local_slopes: list[float]
    local_slope_cis: list[tuple[float, float]]
    misfit_q: float
    misfit_dof: int
    misfit_p: float
    n_replicates: int
    seed: int
    confidence: float
    log_b_crit_cov: list[list[float]] = dataclasses.field(default_factory=list)
    cov_targets: list[int] = dataclasses.field(default_factory=list)

    @property
    def power_law_supported(self) -> bool | None:
        """True/False from the misfit test at 1 − confidence; None without a test."""
        return None if not math.isfinite(self.misfit_p) else self.misfit_p >= 1.0 - self.confidence

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["power_law_supported"] = self.power_law_supported
        d["method_b_crit"], d["method_power_law"] = METHOD_B_CRIT, METHOD_POWER_LAW
        return fit.json_ready(d)


def data_seed(tables: Sequence[selection.BestPerBatchSize]) -> int:
    """A generator seed from the selected steps alone (not their order, nor the shards)."""
    h = hashlib.sha256()
    for t in tables:
        for b, s in zip(t.batch_sizes, t.seed_steps, strict=True):
            h.update(np.asarray([b, *s], dtype=np.float64).tobytes())
        h.update(b"|")
    return int.from_bytes(h.digest()[:4], "little")


def joint_bootstrap(tables: Sequence[selection.BestPerBatchSize], losses: Sequence[float],
                    points: Sequence[fit.TradeoffFit], *, n: int = 1000,
                    seed: int | None = None, confidence: float = 0.95) -> JointIntervals:
    """Joint batch-size bootstrap of every target's B_crit and of the power law. tables:
    `selection.best_per_batch_size` per target; points: their `fit.fit_tradeoff` (the
    intervals' centres and each refit's start)."""
    seed = data_seed(tables) if seed is None else seed
    rng = np.random.default_rng(seed)
    universe = sorted({float(b) for t in tables for b in t.batch_sizes})
    n_seeds = {b: max(len(s) for t in tables for bb, s in zip(t.batch_sizes, t.seed_steps,
                                                              strict=True) if bb == b)
               for b in universe}
    draw_b = rng.integers(0, len(universe), size=(n, len(universe)))
    max_seeds = max(n_seeds.values()) if n_seeds else 1
    draw_s = rng.random(size=(n, len(universe), max_seeds))
    log_bc = np.full((n, len(tables)), np.nan)
    cis = []
    for k, (table, point) in enumerate(zip(tables, points, strict=True)):
        if not point.ok:
            cis.append((math.nan, math.nan))
            continue
        logb, logs, w = _replicate_points(table, universe, n_seeds, draw_b, draw_s)
        theta = fit.solve(logb, logs, np.log([point.s_min, point.e_min]), w=w, iters=200,
                          tol=1e-10)[0]
        ok = _distinct(logb, w) >= 3
        est_r = theta[:, 1] - theta[:, 0]
        se_r = _weighted_se(logb, logs, w, theta)
        log_bc[ok, k] = est_r[ok]
        b0, s0 = np.log(table.batch_sizes)[None], np.log(table.steps)[None]
        se0 = _weighted_se(b0, s0, np.ones_like(b0), np.log([[point.s_min, point.e_min]]))[0]
        lo, hi = fit.studentized(math.log(point.b_crit), se0, est_r[ok], se_r[ok], confidence)
        with np.errstate(over="ignore"):  # an unbounded side is inf, not an OverflowError
            cis.append((float(np.exp(lo)), float(np.exp(hi))))
    return _power_law_part(cis, log_bc, losses, points, seed, confidence)


def _replicate_points(table, universe, n_seeds, draw_b, draw_s):
    """[R, N] log B, log S (seed means of the drawn seeds) and weights (0: B not in table)."""
    index = {float(b): i for i, b in enumerate(table.batch_sizes)}
    logb, logs, w = np.zeros((3, *draw_b.shape))  # [R, N] each
    for j, b in enumerate(universe):
        i = index.get(b)
        if i is None:
            continue
        s = np.asarray(table.seed_steps[i], dtype=np.float64)
        m = n_seeds[b]
        picks = np.minimum((draw_s[:, :, :m] * s.size).astype(int), s.size - 1)  # [R, N, m]
        mean_s = s[picks].mean(axis=2)  # [R, N]
        hit = draw_b == j
        logb[hit], logs[hit], w[hit] = math.log(b), np.log(mean_s[hit]), 1.0
    return logb, logs, w


def _distinct(logb_RxN: np.ndarray, w_RxN: np.ndarray) -> np.ndarray:
    masked = np.where(w_RxN > 0, logb_RxN, np.nan)
    srt = np.sort(masked, axis=1)
    new = np.isfinite(srt) & ~np.isclose(srt, np.roll(srt, 1, axis=1))
    new[:, 0] = np.isfinite(srt[:, 0])
    return new.sum(axis=1)


def _weighted_se(logb, logs, w, theta) -> np.ndarray:
    """Least-squares standard error of log B_crit = log E_min − log S_min, [R]."""
    m, J = fit.model_log_steps(theta, logb)
    n_eff = w.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma2 = np.sum(w * (m - logs) ** 2, axis=1) / np.maximum(n_eff - 2, 1)
        A = np.einsum("rni,rnj->rij", J * w[..., None], J)
        det = A[:, 0, 0] * A[:, 1, 1] - A[:, 0, 1] ** 2
        var = sigma2 * (A[:, 1, 1] + A[:, 0, 0] + 2 * A[:, 0, 1]) / det
        return np.sqrt(var)


def _power_law_part(cis, log_bc, losses, points, seed, confidence) -> JointIntervals:
    nan2 = (math.nan, math.nan)
    ok_t = [k for k, p in enumerate(points) if p.ok]
    x = np.log(np.asarray(losses, dtype=np.float64)[ok_t])
    Y = log_bc[:, ok_t]
    Y = Y[np.all(np.isfinite(Y), axis=1)]  # the replicates with a B_crit at every target
    res: dict[str, Any] = dict(alpha_b_ci=nan2, b_star_ci=nan2, slope_ci=nan2,
                               local_slopes=[], local_slope_cis=[], misfit_q=math.nan,
                               misfit_dof=0, misfit_p=math.nan, log_b_crit_cov=[],
                               cov_targets=[])
    if len(ok_t) >= 3 and Y.shape[0] >= 10:
        X = np.stack([np.ones_like(x), x], axis=1)
        coef_R = np.linalg.lstsq(X, Y.T, rcond=None)[0]  # [2, R]
        slope_ci = fit.quantile_interval(coef_R[1], confidence)
        y = np.log([points[k].b_crit for k in ok_t])
        local = np.diff(y) / np.diff(x)
        local_R = np.diff(Y, axis=1) / np.diff(x)[None]
        q, dof = float(gls_q(X, y[None], np.cov(Y, rowvar=False))[0]), y.size - 2
        res.update(
            slope_ci=slope_ci, alpha_b_ci=fit.alpha_interval(slope_ci),
            b_star_ci=tuple(float(np.exp(v)) for v in fit.quantile_interval(coef_R[0],
                                                                         confidence)),
            local_slopes=[float(v) for v in local],
            local_slope_cis=[fit.quantile_interval(local_R[:, i], confidence)
                             for i in range(local.size)],
            misfit_q=q, misfit_dof=dof,
            misfit_p=float(scipy.stats.chi2.sf(q, dof)) if dof > 0 else math.nan)
    if len(ok_t) >= 1 and Y.shape[0] >= 10:
        res.update(log_b_crit_cov=np.atleast_2d(np.cov(Y, rowvar=False)).tolist(),
                   cov_targets=list(ok_t))
    return JointIntervals(b_crit_ci=cis, n_replicates=int(Y.shape[0]), seed=int(seed),
                          confidence=confidence, **res)


def gls_q(X: np.ndarray, Y_RxT: np.ndarray, C: np.ndarray) -> np.ndarray:
    """min_β (y − Xβ)ᵀC⁻¹(y − Xβ) per row y of Y_RxT, [R]; C [T, T] or [R, T, T]."""
    Ci = np.linalg.pinv(C)
    if Ci.ndim == 2:
        Ci = np.broadcast_to(Ci, (Y_RxT.shape[0], *Ci.shape))
    A = np.einsum("ti,rts,sj->rij", X, Ci, X)
    rhs = np.einsum("ti,rts,rs->ri", X, Ci, Y_RxT)
    beta = np.linalg.solve(A, rhs[..., None])[..., 0]  # [R, 2]
    r = Y_RxT - beta @ X.T
    return np.einsum("ri,rij,rj->r", r, Ci, r)
