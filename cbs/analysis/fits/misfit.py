"""A calibrated misfit test of the power law B_crit(L) = B*/L^(1/α_B), and the target that
breaks it (the why: docs/design.md, "From records to B_crit").

The GLS test of `cbs.analysis.fits.joint` (Q against χ² on targets − 2 degrees of freedom)
takes the bootstrap covariance C of y = log B_crit as known. Here Q's null distribution is
simulated by a studentized parametric bootstrap under the fitted law (Davison & Hinkley 1997,
§4.2 and §5.2). Noise: the residuals r_kB = log S_k(B) − log Ŝ_k(B) (over √(1 − h), h the
leverage) split into a_B shared by the targets at a batch size (σ_a², the mean product of two
targets' residuals at one B) and u_kB of each target's own (σ_u², the rest). A simulated
study puts fresh Gaussian a_B, u_kB on the law's curves S₀(B) = S_min(1 + B_crit₀/B) and
refits every target; C = σ_a²C_a + σ_u²C_u (C_a, C_u per unit variance, simulated at small
noise). Calibrated p = (1 + #{Q* ≥ Q})/(1 + R).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import fit, joint
from cbs.analysis.fits.selection import BestPerBatchSize

__all__ = [
    "CalibratedMisfit", "StudyNoise", "calibrated_misfit", "calibrated_p", "pooled_draws",
    "study_noise",
]

METHOD = ("studentized parametric bootstrap under the fitted law: each target's S_min kept, "
          "B_crit on the line, Gaussian log-step noise with the study's shared (per batch "
          "size) and own (per target) variances, every target refitted, Q with the noise "
          "each study estimates for itself")


SMALL = 1e-3  # log-step noise at which the covariance per unit variance is read


@dataclasses.dataclass(frozen=True)
class CalibratedMisfit:
    """q: the observed GLS statistic; p: its calibrated p-value (NaN without a test); n: the
    simulated studies used; without_target: per target index, p with it left out;
    breaking_target: the one whose removal raises p the most (None below 4 targets)."""

    q: float
    p: float
    n: int
    without_target: dict[int, float]
    breaking_target: int | None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["without_target"] = {str(k): v for k, v in self.without_target.items()}
        d["method"] = METHOD
        return fit.json_ready(d)


def calibrated_misfit(tables: Sequence[BestPerBatchSize], losses: Sequence[float],
                      points: Sequence[fit.TradeoffFit], *, n: int = 2000,
                      seed: int = 0) -> CalibratedMisfit:
    """The calibrated misfit test of the targets with an ok fit (as `joint.joint_bootstrap`)."""
    ok = [k for k, p in enumerate(points) if p.ok]
    if len(ok) < 3:
        return CalibratedMisfit(math.nan, math.nan, 0, {}, None)
    x = np.log(np.asarray(losses, np.float64)[ok])
    y = np.log([points[k].b_crit for k in ok])
    X = np.stack([np.ones_like(x), x], axis=1)
    y0 = X @ np.linalg.lstsq(X, y, rcond=None)[0]
    rng = np.random.default_rng(seed)
    design = _Design(tables, points, ok)
    C_a, C_u = design.unit_covariances(y0, rng, n)
    var_a, var_u = design.components(design.observed_residuals())
    sims, resid, good = design.refit(y0, design.draw(rng, n, math.sqrt(var_a),
                                                     math.sqrt(var_u)))
    sims, resid = sims[good], resid[good]
    sim_a, sim_u = design.components(resid)
    C_obs = var_a * C_a + var_u * C_u
    C_sim = sim_a[:, None, None] * C_a + sim_u[:, None, None] * C_u
    q, p = _test(X, y, C_obs, sims, C_sim)
    without: dict[int, float] = {}
    if len(ok) >= 4:
        for drop in range(len(ok)):
            keep = np.asarray([i for i in range(len(ok)) if i != drop])
            without[ok[drop]] = _test(X[keep], y[keep], C_obs[np.ix_(keep, keep)],
                                      sims[:, keep], C_sim[:, keep][:, :, keep])[1]
    breaking = max(without, key=lambda k: without[k]) if without else None
    return CalibratedMisfit(q, p, int(sims.shape[0]), without, breaking)


@dataclasses.dataclass(frozen=True)
class StudyNoise:
    """One study's noise, for tests that pool studies (`cbs.analysis.studies.sizes`): its fitted
    targets' losses and log B_crit, C_a (c_a), C_u (c_u), its σ_a², σ_u² and so its C (`cov`)."""

    losses: tuple[float, ...]
    log_b_crit: np.ndarray
    c_a: np.ndarray
    c_u: np.ndarray
    var_a: float
    var_u: float
    design: _Design

    @property
    def cov(self) -> np.ndarray:
        return self.var_a * self.c_a + self.var_u * self.c_u


def study_noise(tables: Sequence[BestPerBatchSize], losses: Sequence[float],
                points: Sequence[fit.TradeoffFit], *, n: int = 1000,
                seed: int = 0) -> StudyNoise | None:
    """The `StudyNoise` of one study's targets whose point fit is ok (None without any)."""
    ok = [k for k, p in enumerate(points) if p.ok]
    if not ok:
        return None
    design = _Design(tables, points, ok)
    y = np.log([points[k].b_crit for k in ok])
    c_a, c_u = design.unit_covariances(y, np.random.default_rng(seed), n)
    var_a, var_u = design.components(design.observed_residuals())
    return StudyNoise(tuple(float(losses[k]) for k in ok), y, c_a, c_u, float(var_a),
                      float(var_u), design)


def pooled_draws(studies: Sequence[StudyNoise], null: Sequence[np.ndarray], *, n: int,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Simulated pooled log B_crit [R, N] (the studies' targets side by side) under `null`
    (one array per study) and each row's own block-diagonal covariance [R, N, N]; R ≤ n:
    the draws whose every refit is finite."""
    rng = np.random.default_rng(seed)
    sims, covs, goods = [], [], []
    for s, y0 in zip(studies, null, strict=True):
        noise = s.design.draw(rng, n, math.sqrt(s.var_a), math.sqrt(s.var_u))
        out, resid, good = s.design.refit(np.asarray(y0, np.float64), noise)
        a, u = (np.atleast_1d(v) for v in s.design.components(resid))
        sims.append(out)
        covs.append(a[:, None, None] * s.c_a + u[:, None, None] * s.c_u)
        goods.append(good)
    keep = np.all(goods, axis=0)
    Y = np.concatenate([x[keep] for x in sims], axis=1)
    C = np.zeros((Y.shape[0], Y.shape[1], Y.shape[1]))
    for at, c in zip(np.cumsum([0] + [c.shape[1] for c in covs]), covs, strict=False):
        C[:, at:at + c.shape[1], at:at + c.shape[1]] = c[keep]
    return Y, C


def calibrated_p(observed: float, simulated: np.ndarray) -> float:
    """(1 + #{simulated ≥ observed})/(1 + R): the p-value of a simulated null distribution."""
    simulated = np.asarray(simulated)
    return float((1 + np.sum(simulated >= observed)) / (1 + simulated.size))


def _test(X, y, C_obs, sims_RxT, C_sim_RxTxT) -> tuple[float, float]:
    """(Q, calibrated p) of the study against the simulated ones, each with its own C."""
    q = float(joint.gls_q(X, y[None], C_obs)[0])
    return q, calibrated_p(q, joint.gls_q(X, sims_RxT, C_sim_RxTxT))


class _Design:
    """The study's batch sizes, fits and leverages, to draw and refit simulated studies."""

    def __init__(self, tables, points, ok):
        self.points = [points[k] for k in ok]
        self.universe = sorted({float(b) for k in ok for b in tables[k].batch_sizes})
        self.logb, self.cols, self.lev, self.steps = [], [], [], []
        col = {b: j for j, b in enumerate(self.universe)}
        for k in ok:
            b = np.asarray(tables[k].batch_sizes, np.float64)
            self.logb.append(np.log(b))
            self.cols.append(np.asarray([col[float(v)] for v in b]))
            J = fit.model_log_steps(np.log([[points[k].s_min, points[k].e_min]]),
                                    np.log(b)[None])[1][0]  # h_ii of log S, capped at 0.9:
            self.lev.append(np.clip(np.einsum("ni,ij,nj->n", J, np.linalg.pinv(J.T @ J), J),
                                    0.0, 0.9))
            self.steps.append(np.asarray(tables[k].steps, np.float64))

    def draw(self, rng, n, sigma_a, sigma_u) -> list[np.ndarray]:
        """Per target [n, N_k] log-step noise: a ~ N(0, σ_a²) shared per B, own u ~ N(0, σ_u²)."""
        shared = sigma_a * rng.normal(size=(n, len(self.universe)))
        return [shared[:, c] + sigma_u * rng.normal(size=(n, c.size)) for c in self.cols]

    def unit_covariances(self, y0, rng, n) -> tuple[np.ndarray, np.ndarray]:
        """(C_a, C_u): the covariance of log B_crit per unit variance of the shared and own
        noise, read at small noise (SMALL) where log B_crit is linear in it."""
        c = []
        for a, u in ((SMALL, 0.0), (0.0, SMALL)):
            out, _, good = self.refit(y0, self.draw(rng, n, a, u))
            c.append(np.atleast_2d(np.cov(out[good], rowvar=False)) / SMALL**2)
        return c[0], c[1]

    def refit(self, y0, noise) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Refits every target to S_min(1 + e^{y0}/B)·e^noise: log B_crit [n, T], the scaled
        residuals [n, T, len(universe)] (NaN: B not in a target), a mask [n] of all-finite."""
        n = noise[0].shape[0]
        out = np.empty((n, len(self.points)))
        resid = np.full((n, len(self.points), len(self.universe)), np.nan)
        for i, (pt, logb, e) in enumerate(zip(self.points, self.logb, noise, strict=True)):
            logs = np.log(pt.s_min * (1.0 + math.exp(y0[i]) / np.exp(logb)))[None] + e
            grid = np.broadcast_to(logb, logs.shape)
            th = fit.solve(grid, logs, np.log([pt.s_min, pt.s_min * math.exp(y0[i])]),
                           iters=200, tol=1e-10)[0]
            out[:, i] = th[:, 1] - th[:, 0]
            fitted = fit.model_log_steps(th, grid)[0]
            resid[:, i, self.cols[i]] = (logs - fitted) / np.sqrt(1.0 - self.lev[i])
        return out, resid, np.all(np.isfinite(out), axis=1)

    def observed_residuals(self) -> np.ndarray:
        """The study's own leverage-scaled residuals, [1, T, len(universe)]."""
        resid = np.full((1, len(self.points), len(self.universe)), np.nan)
        for i, (pt, logb, s) in enumerate(zip(self.points, self.logb, self.steps, strict=True)):
            fitted = fit.model_log_steps(np.log([[pt.s_min, pt.e_min]]), logb[None])[0][0]
            resid[0, i, self.cols[i]] = (np.log(s) - fitted) / np.sqrt(1.0 - self.lev[i])
        return resid

    @staticmethod
    def components(resid_RxTxN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(σ_a², σ_u²) per study from residuals (σ_a² clipped to [0, mean square])."""
        r = np.nan_to_num(resid_RxTxN)
        present = np.isfinite(resid_RxTxN)
        total = np.sum(r**2, axis=(1, 2)) / np.sum(present, axis=(1, 2))
        col_sum, col_sq = r.sum(axis=1), (r**2).sum(axis=1)
        n_col = present.sum(axis=1)
        pairs = np.sum(n_col * (n_col - 1) / 2, axis=1)
        cross = np.sum((col_sum**2 - col_sq) / 2, axis=1) / np.maximum(pairs, 1)
        shared = np.clip(cross, 0.0, total)
        return np.squeeze(shared), np.squeeze(total - shared)
