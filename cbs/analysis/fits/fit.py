"""Fits of the steps–examples trade-off and of B_crit against loss (numpy/scipy, no model).

Letters: B batch size, S optimizer steps and E = B·S examples to reach a target loss L.

- McCandlish et al. 2018 (as Kaplan et al. 2020, eqs. 5.1–5.2): S/S_min = 1 + B_crit/B and
  E/E_min = 1 + B/B_crit with B_crit = E_min/S_min, i.e. S(B) = S_min + E_min/B.
  `fit_tradeoff` fits (log S_min, log E_min) by least squares of log S against
  log(S_min + E_min/B): both stay positive and every point weighs by its relative error.
- Kaplan et al. 2020, eq. 5.3: B_crit(L) = B*/L^(1/α_B); `fit_power_law` fits
  log B_crit = log B* − (1/α_B)·log L.

Intervals are studentized (bootstrap-t, `studentized`) from a residual bootstrap (Davison &
Hinkley 1997, §5.2.1 and Alg. 6.3): log-space residuals, divided by √(1 − h_ii) and centred,
are resampled onto the fitted curve (why bootstrap-t: docs/design.md, "From records to
B_crit"). Resampling (B, S) pairs (`resample="pairs"`) often draws fewer than three distinct
batch sizes from a small table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.optimize

__all__ = [
    "INSUFFICIENT", "OK", "PowerLawFit", "TradeoffFit", "alpha_interval", "fit_power_law",
    "fit_tradeoff", "g3", "json_ready", "model_log_steps", "quantile_interval", "solve",
    "studentized", "tradeoff_warnings",
]

OK = "ok"
INSUFFICIENT = "insufficient data"


def quantile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size < 2:
        return (math.nan, math.nan)
    lo, hi = np.quantile(values, [(1 - confidence) / 2, (1 + confidence) / 2])
    return (float(lo), float(hi))


def g3(x: Any, inf: str = "–") -> str:
    """x to 3 significant figures as the reports print it: "–" for None or NaN, `inf` for +∞."""
    if x is not None and float(x) == math.inf:
        return inf
    return "–" if x is None or not math.isfinite(float(x)) else f"{float(x):.3g}"


def _json_float(x: Any) -> Any:
    if isinstance(x, tuple | list):
        return [_json_float(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def json_ready(d: Mapping[str, Any]) -> dict[str, Any]:
    """A flat dict of floats, tuples and lists with NaN and inf as None (JSON has neither)."""
    return {k: _json_float(v) for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class TradeoffFit:
    """S(B) = s_min + e_min/B with `confidence` intervals; NaNs unless status == "ok".
    n_dropped: points dropped as missing, non-finite or non-positive; residual_std: RMS of
    the log S residuals."""

    s_min: float
    e_min: float
    b_crit: float
    s_min_ci: tuple[float, float]
    e_min_ci: tuple[float, float]
    b_crit_ci: tuple[float, float]
    n_points: int
    n_batch_sizes: int
    n_dropped: int
    status: str
    method: str
    confidence: float
    residual_std: float = math.nan
    warnings: tuple[str, ...] = ()
    interval: str = "residual bootstrap-t"  # how the intervals were formed, in words

    @property
    def ok(self) -> bool:
        return self.status == OK

    def steps(self, batch_size: Any) -> Any:
        return self.s_min + self.e_min / np.asarray(batch_size, dtype=np.float64)

    def examples(self, batch_size: Any) -> Any:
        return self.s_min * np.asarray(batch_size, dtype=np.float64) + self.e_min

    def to_dict(self) -> dict[str, Any]:
        return json_ready(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class PowerLawFit:
    """B_crit(L) = b_star / L^(1/alpha_b); slope = −1/alpha_b of log B_crit on log L."""

    b_star: float
    alpha_b: float
    slope: float
    b_star_ci: tuple[float, float]
    alpha_b_ci: tuple[float, float]
    slope_ci: tuple[float, float]
    n_points: int
    status: str
    confidence: float
    residual_std: float = math.nan
    interval: str = "residual bootstrap-t"  # how the intervals were formed, in words

    @property
    def ok(self) -> bool:
        return self.status == OK

    def b_crit(self, loss: Any) -> Any:
        return self.b_star * np.asarray(loss, dtype=np.float64) ** self.slope

    def to_dict(self) -> dict[str, Any]:
        return json_ready(dataclasses.asdict(self))


# ---------------------------------------------------------------- the hyperbola fit

def model_log_steps(theta_Rx2: np.ndarray, logb_RxN: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """log(S_min + E_min/B) and its Jacobian in (log S_min, log E_min): [R,N], [R,N,2]."""
    a, c = theta_Rx2[:, :1], theta_Rx2[:, 1:]
    m = np.logaddexp(a, c - logb_RxN)
    w = np.exp(a - m)  # S_min/S: the share of the floor in the fitted S
    return m, np.stack([w, 1.0 - w], axis=-1)


def _cost(r_RxN: np.ndarray, f_scale: np.ndarray | float | None, w: np.ndarray) -> np.ndarray:
    """½Σw·r² (least squares) or ½f²Σw·log(1 + (r/f)²) (Cauchy, for method="robust")."""
    if f_scale is None:
        return 0.5 * np.sum(w * r_RxN ** 2, axis=1)
    return 0.5 * np.sum(w * f_scale ** 2 * np.log1p((r_RxN / f_scale) ** 2), axis=1)


def _robust_scale(r_RxN: np.ndarray) -> np.ndarray:
    """1.4826·MAD per row (≥ 1e-3), [R, 1]."""
    med = np.median(r_RxN, axis=1, keepdims=True)
    return np.maximum(1.4826 * np.median(np.abs(r_RxN - med), axis=1, keepdims=True), 1e-3)


def solve(logb_RxN: np.ndarray, logs_RxN: np.ndarray, theta: np.ndarray,
          f_scale: np.ndarray | float | None = None, w: np.ndarray | None = None,
          iters: int = 300, tol: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg–Marquardt of Σ w·ρ(log(S_min + E_min/B) − log S) on R problems at once
    (arrays [R, N]; weight 0 drops a point; IRLS weights for Cauchy) from theta ([2] or [R, 2])
    until every step is below tol (default 1e-12·(1 + |θ|)); returns [R, 2] θ and the costs."""
    w = np.ones_like(logs_RxN) if w is None else w
    theta = np.broadcast_to(np.asarray(theta, np.float64), (logb_RxN.shape[0], 2)).copy()
    cost = _cost(model_log_steps(theta, logb_RxN)[0] - logs_RxN, f_scale, w)
    lam = np.full(theta.shape[0], 1e-3)
    eye = np.eye(2)
    for _ in range(iters):
        m, J = model_log_steps(theta, logb_RxN)
        r = m - logs_RxN
        irls = 1.0 if f_scale is None else 1.0 / (1.0 + (r / f_scale) ** 2)  # ρ'((r/f)²)
        JtW = J * (w * irls)[..., None]
        A = np.einsum("rni,rnj->rij", JtW, J)
        g = np.einsum("rni,rn->ri", JtW, r)
        delta = -np.linalg.solve(A + lam[:, None, None] * (A * eye) + 1e-12 * eye,
                                 g[..., None])[..., 0]
        trial = theta + delta
        new_cost = _cost(model_log_steps(trial, logb_RxN)[0] - logs_RxN, f_scale, w)
        accept = np.isfinite(new_cost) & (new_cost <= cost)
        theta[accept], cost[accept] = trial[accept], new_cost[accept]
        lam = np.clip(np.where(accept, lam / 3.0, lam * 4.0), 1e-12, 1e12)
        small = np.max(np.abs(delta), axis=1) < (
            1e-12 * (1.0 + np.max(np.abs(theta), axis=1)) if tol is None else tol)
        if np.all(small | (lam >= 1e12)):
            break
    return theta, cost


def _initial_guesses(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """S_min from the largest-B points, E_min from the smallest-B points, and NNLS."""
    s_big = float(np.median(s[b == b.max()]))
    e_small = float(np.median((b * s)[b == b.min()]))
    guesses = [(0.9 * s_big, 0.9 * e_small), (0.5 * s_big, e_small), (s_big, 0.5 * e_small)]
    # S·(1/S) ≈ 1: non-negative least squares of a/S + c/(B·S) = 1 (relative errors).
    coef, _ = scipy.optimize.nnls(np.stack([1.0 / s, 1.0 / (b * s)], axis=1), np.ones_like(s))
    if np.all(coef > 0):
        guesses.append(tuple(coef))
    return np.log(np.asarray(guesses, dtype=np.float64))


def _centred(resid: np.ndarray, J_NxP: np.ndarray) -> np.ndarray:
    """Residuals divided by √(1 − h_ii) (leverage h capped at 0.95) and centred."""
    h = np.einsum("ni,ij,nj->n", J_NxP, np.linalg.pinv(J_NxP.T @ J_NxP), J_NxP)
    mod = resid / np.sqrt(1.0 - np.minimum(h, 0.95))
    return mod - mod.mean()


def _clean(xs: Sequence[Any] | np.ndarray, ys: Sequence[Any] | np.ndarray,
           ) -> tuple[np.ndarray, np.ndarray, int]:
    to_float = lambda v: math.nan if v is None else float(v)
    x = np.asarray([to_float(v) for v in xs], dtype=np.float64)
    y = np.asarray([to_float(v) for v in ys], dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"need one value per point, got {x.shape} and {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    return x[keep], y[keep], int(np.count_nonzero(~keep))


def fit_tradeoff(batch_sizes: Sequence[float] | np.ndarray,
                 steps: Sequence[float | None] | np.ndarray, *,
                 bootstrap: int = 1000, seed: int = 0, method: str = "lsq",
                 confidence: float = 0.95, resample: str = "residual") -> TradeoffFit:
    """Fits S(B) = S_min + E_min/B to a table of (B, S); never raises on bad data. steps:
    None, NaN or ≤ 0 (never reached) are dropped, counted in n_dropped. bootstrap: refits for
    the intervals (0: none). method: "lsq", least squares in log S; or "robust", a Cauchy loss
    (`_cost`) from the least-squares fit: with 2 of 10 batch sizes on a floor of S at 2·S_min
    (a too narrow LR grid), B_crit is off by a median 5 % instead of 36 % (lsq); it cannot
    help when most points with B ≫ B_crit share the floor. Status "insufficient data" (NaNs)
    with fewer than 3 distinct B, "failed: ..." if the numerics break down."""
    if method not in ("lsq", "robust") or resample not in ("residual", "pairs"):
        raise ValueError(f"method must be lsq|robust and resample residual|pairs, got "
                         f"{method!r}, {resample!r}")
    b, s, n_dropped = _clean(batch_sizes, steps)
    if np.unique(b).size < 3:
        return _no_fit(b, n_dropped, INSUFFICIENT, method, confidence)
    try:
        with np.errstate(all="ignore"):  # trial steps may overflow; they are rejected
            return _fit_tradeoff_ok(b, s, n_dropped, bootstrap, seed, method, confidence,
                                    resample)
    except (ArithmeticError, ValueError, RuntimeError, np.linalg.LinAlgError) as err:
        return _no_fit(b, n_dropped, f"failed: {type(err).__name__}: {err}", method,
                       confidence)


def _no_fit(b, n_dropped, status, method, confidence) -> TradeoffFit:
    nan2 = (math.nan, math.nan)
    return TradeoffFit(math.nan, math.nan, math.nan, nan2, nan2, nan2, int(b.size),
                       int(np.unique(b).size), n_dropped, status, method, confidence)


def _fit_tradeoff_ok(b, s, n_dropped, bootstrap, seed, method, confidence, resample):
    logb, logs = np.log(b), np.log(s)
    theta0 = _initial_guesses(np.exp(logb), np.exp(logs))
    R = theta0.shape[0]
    theta, cost = solve(np.broadcast_to(logb, (R, b.size)), np.broadcast_to(logs, (R, s.size)),
                        theta0)
    theta = theta[int(np.nanargmin(cost))]  # the best of the starting points
    f_scale = None
    if method == "robust":  # Cauchy M-estimate, re-estimating the scale until it settles
        r = model_log_steps(theta[None], logb[None])[0] - logs[None]
        for _ in range(10):
            scale = _robust_scale(r)
            theta = solve(logb[None], logs[None], theta[None], scale)[0][0]
            r = model_log_steps(theta[None], logb[None])[0] - logs[None]
            if np.all(np.abs(_robust_scale(r) / scale - 1.0) < 0.01):
                break
        f_scale = float(scale[0, 0])
    fitted, J = model_log_steps(theta[None], logb[None])
    resid = logs - fitted[0]
    s_min, e_min = (float(v) for v in np.exp(theta))
    b_crit = float(np.exp(theta[1] - theta[0]))
    if not (s_min > 0 and math.isfinite(b_crit) and b_crit < 1e6 * b.max()):
        # S ∝ 1/B at every batch size tried: the floor S_min is not reached, B_crit is only
        # known to exceed the largest B (and a least-squares S_min → 0 would call it ∞).
        return _no_fit(b, n_dropped, f"unbounded: S falls as 1/B up to the largest batch "
                       f"size, so B_crit > {b.max():g}", method, confidence)
    cis = [(math.nan, math.nan)] * 3
    if bootstrap > 0:
        cis = _bootstrap_tradeoff(logb, logs, theta, fitted[0], resid, J[0], f_scale,
                                  bootstrap, seed, resample, confidence)
    return TradeoffFit(s_min, e_min, b_crit, cis[0], cis[1], cis[2], int(b.size),
                       int(np.unique(b).size), n_dropped, OK, method, confidence,
                       float(np.sqrt(np.mean(resid ** 2))), tradeoff_warnings(b, b_crit, cis[2]))


def _log_param_se(logb_RxN, logs_RxN, theta_Rx2, f_scale) -> np.ndarray:
    """Standard errors of (log S_min, log E_min, log B_crit), [R, 3]: Σψ(r)²/(n − 2) /
    mean(ψ'(r))² · (JᵀJ)⁻¹, with ψ(r) = r (least squares) or r/(1 + (r/f)²) (Cauchy)."""
    m, J = model_log_steps(theta_Rx2, logb_RxN)
    r = m - logs_RxN
    n = r.shape[1]
    if f_scale is None:
        psi, dpsi = r, np.ones_like(r)
    else:
        u = (r / f_scale) ** 2
        psi, dpsi = r / (1.0 + u), (1.0 - u) / (1.0 + u) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma2 = np.sum(psi ** 2, axis=1) / max(n - 2, 1) / np.mean(dpsi, axis=1) ** 2
        A = np.einsum("rni,rnj->rij", J, J)
        det = A[:, 0, 0] * A[:, 1, 1] - A[:, 0, 1] ** 2
        var_a = sigma2 * A[:, 1, 1] / det
        var_c = sigma2 * A[:, 0, 0] / det
        cov_ac = -sigma2 * A[:, 0, 1] / det
        return np.sqrt(np.stack([var_a, var_c, var_a + var_c - 2 * cov_ac], axis=1))


def _bootstrap_tradeoff(logb, logs, theta, fitted, resid, J, f_scale, n, seed, resample,
                        confidence):
    """Studentized (bootstrap-t) intervals for S_min, E_min, B_crit; see fit_tradeoff."""
    rng = np.random.default_rng(seed)
    N = logb.size
    idx = rng.integers(0, N, size=(n, N))
    if resample == "residual":
        logb_RxN = np.broadcast_to(logb, (n, N))
        logs_RxN = fitted[None, :] + _centred(resid, J)[idx]
    else:
        logb_RxN, logs_RxN = logb[idx], logs[idx]
        distinct = np.array([np.unique(row).size for row in logb_RxN])
        logb_RxN, logs_RxN = logb_RxN[distinct >= 3], logs_RxN[distinct >= 3]
    theta_R = solve(logb_RxN, logs_RxN, theta, f_scale)[0]
    est = np.array([theta[0], theta[1], theta[1] - theta[0]])
    se = _log_param_se(logb[None], logs[None], theta[None], f_scale)[0]
    est_R = np.stack([theta_R[:, 0], theta_R[:, 1], theta_R[:, 1] - theta_R[:, 0]], axis=1)
    se_R = _log_param_se(logb_RxN, logs_RxN, theta_R, f_scale)
    return [tuple(float(np.exp(v)) for v in studentized(est[k], se[k], est_R[:, k],
                                                          se_R[:, k], confidence))
            for k in range(3)]


def tradeoff_warnings(b: np.ndarray, b_crit: float, b_crit_ci: tuple[float, float]):
    out = []
    if not b.min() <= b_crit <= b.max():
        out.append(f"b_crit={b_crit:.3g} lies outside the sampled batch sizes "
                   f"[{b.min():.3g}, {b.max():.3g}]: extrapolated")
    lo, hi = b_crit_ci
    if math.isfinite(lo) and hi > 100 * lo:
        out.append("b_crit interval spans more than a factor of 100")
    return tuple(out)


# ---------------------------------------------------------------- power law in the loss

def fit_power_law(losses: Sequence[float], b_crits: Sequence[float | None], *,
                  bootstrap: int = 1000, seed: int = 0,
                  confidence: float = 0.95) -> PowerLawFit:
    """Fits Kaplan's B_crit(L) = B*/L^(1/α_B) by least squares of log B_crit on log L.
    Non-finite or non-positive points are dropped; fewer than 3 distinct L: "insufficient
    data". The interval of alpha_b = −1/slope is (lo, inf) when the slope's contains zero."""
    loss, bc, _ = _clean(losses, b_crits)
    nan2 = (math.nan, math.nan)
    if np.unique(loss).size < 3:
        return PowerLawFit(math.nan, math.nan, math.nan, nan2, nan2, nan2, int(loss.size),
                           INSUFFICIENT, confidence)
    with np.errstate(all="ignore"):
        x, y = np.log(loss), np.log(bc)
        X = np.stack([np.ones_like(x), x], axis=1)
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        resid = y - X @ coef
        cis = [nan2] * 3
        if bootstrap > 0:
            idx = np.random.default_rng(seed).integers(0, x.size, size=(x.size, bootstrap))
            y_NxR = (X @ coef)[:, None] + _centred(resid, X)[idx]
            coef_R = np.linalg.lstsq(X, y_NxR, rcond=None)[0].T
            se_R = _ols_se(X, y_NxR - X @ coef_R.T)
            se = _ols_se(X, resid[:, None])[0]
            intercept_ci, slope_ci = (studentized(coef[k], se[k], coef_R[:, k], se_R[:, k],
                                                   confidence) for k in (0, 1))
            b_star_ci = (float(np.exp(intercept_ci[0])), float(np.exp(intercept_ci[1])))
            cis = [b_star_ci, alpha_interval(slope_ci), slope_ci]
        slope = float(coef[1])
        alpha = -1.0 / slope if slope != 0 else math.inf
        return PowerLawFit(float(np.exp(coef[0])), alpha, slope, cis[0], cis[1], cis[2],
                           int(loss.size), OK, confidence, float(np.sqrt(np.mean(resid ** 2))))


def _ols_se(X_NxP: np.ndarray, resid_NxR: np.ndarray) -> np.ndarray:
    """OLS standard errors σ̂·√diag((XᵀX)⁻¹) for R residual columns, [R, P]."""
    n, p = X_NxP.shape
    sigma2_R = np.sum(resid_NxR ** 2, axis=0) / max(n - p, 1)
    return np.sqrt(sigma2_R[:, None] * np.diag(np.linalg.inv(X_NxP.T @ X_NxP))[None, :])


def studentized(est: float, se: float, est_R: np.ndarray, se_R: np.ndarray,
                 confidence: float) -> tuple[float, float]:
    """Bootstrap-t interval: est − t*_hi·se, est − t*_lo·se with t* = (est* − est)/se*."""
    if not se > 0:
        return (float(est), float(est))
    with np.errstate(divide="ignore", invalid="ignore"):
        t_lo, t_hi = quantile_interval((est_R - est) / se_R, confidence)
    return (float(est - t_hi * se), float(est - t_lo * se))


def alpha_interval(slope_ci: tuple[float, float]) -> tuple[float, float]:
    """Maps a slope interval through α = −1/slope (increasing on each side of zero)."""
    lo, hi = slope_ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return (math.nan, math.nan)
    if hi < 0 or lo > 0:
        return (-1.0 / lo, -1.0 / hi)
    # The slope may be zero: α is unbounded; keep the physical (positive) branch.
    return (-1.0 / lo if lo < 0 else math.inf, math.inf)
