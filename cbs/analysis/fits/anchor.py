"""The anchor in closed form: B_crit of SGD on Gaussian linear regression, exactly.

Problem (as `cbs.data.linreg`): x ~ N(0, C), C = diag(λ) in its eigenbasis, y = x·w* + σε, a
linear model with bias, loss ½(x̃·θ − y)² with x̃ = (x, 1), H = diag(λ, 1). With δ = θ − θ* and
M_t = E[δ_t δ_tᵀ], minibatch SGD on B examples with rate η obeys (the recursion of
`tests/test_branches.py::expected_sgd_losses`)

    M_{t+1} = M_t − η(HM_t + M_tH) + η²(HM_tH + Σ(M_t)·ρ_B/B),
    Σ(M) = (tr HM + σ²)H + HMH − 2M_bb e_b e_bᵀ     (Isserlis; b the bias coordinate),
    E L_t = ½(tr HM_t + σ²),

with ρ_B = 1 for fresh examples and (N − B)/(N − 1) drawing without replacement from N. H is
diagonal, so the diagonal m of M closes on itself: O(P) a step. Noise scales (McCandlish et al.
2018, App. A) at M: tr(Σ), tr(HΣ) from Σ(M), |G|² = tr(H²M), GᵀHG = tr(H³M).

Protocols (docs/guides/across_studies.md, "The anchor in closed form"): "optimal", at every
step η_t = tr(H²M)/(tr(H³M) + ρ_B·tr(HΣ)/B), where B_crit is the path average of B_noise
(`path_average`); "grid", per batch size the best constant rate of a grid, as a sweep does.
Steps to a target: the first crossing of E L_t, linear in log loss between updates; B_crit:
`fit.fit_tradeoff` of those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import fit

__all__ = [
    "LinregProblem", "grid_study", "noise_scales", "optimal_lr", "optimal_study", "steps_to",
    "trajectory",
]


@dataclasses.dataclass(frozen=True)
class LinregProblem:
    """Gaussian linear regression in the eigenbasis of C. eigenvalues: λ [D]; sigma: σ, the
    label noise; m0: the diagonal [D + 1] of E[δ_0δ_0ᵀ] (weights, then the bias); num_train: N
    for sampling without replacement (0: fresh examples)."""

    eigenvalues: np.ndarray
    sigma: float
    m0: np.ndarray
    num_train: int = 0

    @property
    def h(self) -> np.ndarray:
        """diag H, [P = D + 1] (the bias coordinate last, curvature 1)."""
        return np.append(np.asarray(self.eigenvalues, np.float64), 1.0)

    @property
    def min_loss(self) -> float:
        """The population minimum σ²/2."""
        return 0.5 * self.sigma**2

    def rho(self, batch_size: np.ndarray) -> np.ndarray:
        """ρ_B: the without-replacement variance factor of a batch's mean (1 for fresh)."""
        b = np.asarray(batch_size, np.float64)
        if not self.num_train:
            return np.ones_like(b)
        return np.clip((self.num_train - b) / (self.num_train - 1), 0.0, 1.0)

    @classmethod
    def from_dataset(cls, cov: np.ndarray, w_star: np.ndarray, sigma: float, *,
                     init_variance: float, num_train: int = 0) -> LinregProblem:
        """The problem of `cbs.data.linreg` metadata (cov, w_star, noise_std) for a model
        whose weights start N(0, init_variance) and bias at 0 (lecun_normal: 1/D)."""
        lam, q = np.linalg.eigh(np.asarray(cov, np.float64))
        w = q.T @ np.asarray(w_star, np.float64)
        m0 = np.append(w**2 + init_variance, 0.0)
        return cls(lam, float(sigma), m0, int(num_train))


def noise_scales(problem: LinregProblem, m: np.ndarray) -> dict[str, np.ndarray]:
    """tr Σ, |G|², tr HΣ, GᵀHG, B_simple and B_noise at second moments m [..., P]."""
    h = problem.h
    scale = m @ h + problem.sigma**2
    bias = m[..., -1]
    trace_sigma = scale * h.sum() + m @ h**2 - 2 * bias
    trace_h_sigma = scale * (h**2).sum() + m @ h**3 - 2 * bias
    g2, ghg = m @ h**2, m @ h**3
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"trace_sigma": trace_sigma, "grad_sq_norm": g2, "trace_h_sigma": trace_h_sigma,
                "g_h_g": ghg, "b_simple": trace_sigma / g2, "b_noise": trace_h_sigma / ghg}


def _step(problem: LinregProblem, m: np.ndarray, lr: np.ndarray, batch: np.ndarray
          ) -> np.ndarray:
    """One SGD update of the second moments m [K, P] at rates lr [K] and batch sizes [K]."""
    h = problem.h
    scale = m @ h + problem.sigma**2
    sigma_diag = scale[:, None] * h + h**2 * m
    sigma_diag[:, -1] -= 2 * m[:, -1]
    noise = (problem.rho(batch) / batch)[:, None] * sigma_diag
    eta = lr[:, None]
    return m - 2 * eta * h * m + eta**2 * (h**2 * m + noise)


def optimal_lr(problem: LinregProblem, m: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """The rate minimising the next expected loss: tr(H²M)/(tr(H³M) + ρ_B tr(HΣ)/B)."""
    s = noise_scales(problem, m)
    return s["grad_sq_norm"] / (s["g_h_g"] + problem.rho(batch) / batch * s["trace_h_sigma"])


def trajectory(problem: LinregProblem, batch_sizes: Sequence[float] | np.ndarray,
               lrs: Sequence[float] | np.ndarray | None,
               steps: int, *, stop_below: float = -math.inf) -> tuple[np.ndarray, np.ndarray]:
    """Expected losses [K, steps + 1] (from before the first update) and second moments
    [K, steps + 1, P] of K runs at (batch_sizes[k], lrs[k]), or the per-step optimal rate
    where `lrs` is None; NaN after every run is below `stop_below`."""
    b = np.asarray(batch_sizes, np.float64)
    k = b.size
    m = np.broadcast_to(problem.m0, (k, problem.h.size)).copy()
    losses = np.full((k, steps + 1), np.nan)
    moments = np.full((k, steps + 1, problem.h.size), np.nan)
    for t in range(steps + 1):
        losses[:, t] = 0.5 * (m @ problem.h + problem.sigma**2)
        moments[:, t] = m
        if t == steps or np.all(losses[:, t] < stop_below):
            break
        lr = optimal_lr(problem, m, b) if lrs is None else np.asarray(lrs, np.float64)
        m = _step(problem, m, lr, b)
    return losses, moments


def steps_to(losses: np.ndarray, target: float) -> np.ndarray:
    """First crossing of `target` per row [K], linear in log loss between updates (NaN: never)."""
    out = np.full(losses.shape[0], np.nan)
    for k, row in enumerate(losses):
        below = np.flatnonzero(row <= target)
        if not below.size:
            continue
        i = int(below[0])
        if i == 0:
            out[k] = 0.0
            continue
        lo, hi = math.log(row[i - 1]), math.log(row[i])
        out[k] = i - 1 + (lo - math.log(target)) / (lo - hi)
    return out


def _crossing_moments(moments: np.ndarray, losses: np.ndarray, target: float) -> np.ndarray:
    """Second moments [K, P] at the first update at or below `target` (NaN if never)."""
    out = np.full((moments.shape[0], moments.shape[2]), np.nan)
    hit = np.any(losses <= target, axis=1)
    out[hit] = moments[hit, np.argmax(losses <= target, axis=1)[hit]]
    return out


def path_average(problem: LinregProblem, target: float, *, steps: int) -> float:
    """B_noise averaged over the updates of the B → ∞ optimal-rate path to `target` (the last
    weighted by the fraction the crossing uses): McCandlish's B_crit where B_noise varies."""
    losses, moments = trajectory(problem, [1e30], None, steps, stop_below=target)
    s = float(steps_to(losses, target)[0])
    n = int(math.floor(s))
    w = np.ones(n + 1)
    w[n] = s - n
    b_noise = noise_scales(problem, moments[0, :n + 1])["b_noise"]
    return float(np.sum(w * b_noise) / np.sum(w))


def optimal_study(problem: LinregProblem, batch_sizes: Sequence[float],
                  targets: Sequence[float], *, steps: int) -> list[dict[str, Any]]:
    """The "optimal" protocol: per target, the steps per batch size, B_crit (give batch sizes
    that bracket it), the noise scales where the runs cross the target (median and range over
    batch sizes) and `path_b_noise`, McCandlish's prediction of B_crit."""
    b = np.asarray(sorted(batch_sizes), np.float64)
    losses, moments = trajectory(problem, b, None, steps, stop_below=min(targets))
    return [_row(problem, b, steps_to(losses, t), t, _crossing_moments(moments, losses, t))
            | {"path_b_noise": path_average(problem, t, steps=steps)} for t in targets]


def grid_study(problem: LinregProblem, rates: Mapping[float, Sequence[float]],
               targets: Sequence[float], *, steps: int) -> list[dict[str, Any]]:
    """The "grid" protocol: as `optimal_study`, with the best rate of `rates[B]` per B."""
    b = np.asarray(sorted(rates), np.float64)
    flat_b = np.concatenate([np.full(len(rates[x]), x) for x in b])
    flat_lr = np.concatenate([np.asarray(rates[x], np.float64) for x in b])
    losses, moments = trajectory(problem, flat_b, flat_lr, steps, stop_below=min(targets))
    rows = []
    for target in targets:
        s_all = np.nan_to_num(steps_to(losses, target), nan=np.inf)
        best = [int(np.flatnonzero(flat_b == x)[np.argmin(s_all[flat_b == x])]) for x in b]
        s_best = np.where(np.isfinite(s_all[best]), s_all[best], np.nan)
        row = _row(problem, b, s_best, target, _crossing_moments(moments, losses, target)[best])
        row["best_lr"] = flat_lr[best].tolist()
        row["best_lr_at_edge"] = [bool(flat_lr[i] in (min(rates[x]), max(rates[x])))
                                  for i, x in zip(best, b, strict=True)]
        rows.append(row)
    return rows


def _row(problem, b, steps, target, moments) -> dict[str, Any]:
    tf = fit.fit_tradeoff(b, steps, bootstrap=0)
    scales = noise_scales(problem, moments)
    row: dict[str, Any] = {"target": float(target), "batch_sizes": b.tolist(),
                           "steps": [float(s) for s in steps],
                           "b_crit": tf.b_crit, "status": tf.status}
    for name in ("b_simple", "b_noise"):
        v = scales[name][np.isfinite(scales[name])]
        row[name] = float(np.median(v)) if v.size else math.nan
        row[f"{name}_range"] = (float(v.min()), float(v.max())) if v.size else (math.nan,) * 2
    return row
