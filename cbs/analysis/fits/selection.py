"""From trial records to the points a fit uses: steps to a target, the best learning rate per
batch size (per seed, then the seed mean), and the noise scale at a crossing. Re-exported by
`cbs.fit`. Letters: B batch size, S optimizer steps to reach a target loss, η learning rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["BestPerBatchSize", "best_per_batch_size", "noise_scale_at_crossing", "steps_to_target"]


def steps_to_target(steps: Sequence[float], losses: Sequence[float], target: float, *,
                    interpolate: bool = True) -> float | None:
    """First step (or example count) at which the loss reaches `target` (≤), else None;
    with `interpolate`, linearly in log loss (in the loss where a value is not positive)
    between the last evaluation above it and the first at or below: exact for an
    exponential decay. Non-finite losses count as not reached."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    hit = np.flatnonzero(np.isfinite(y) & (y <= target))
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0 or not interpolate or not np.isfinite(y[i - 1]):
        return float(x[i])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    if min(y0, y1, target) > 0:
        y0, y1, target = np.log(y0), np.log(y1), np.log(target)
    return float(x0 + (y0 - target) * (x1 - x0) / (y0 - y1))


@dataclasses.dataclass(frozen=True)
class BestPerBatchSize:
    """Per batch size (sorted, arrays aligned), the steps to the target at the best learning
    rate. steps: the mean over seeds of each seed's fewest steps; learning_rates: the seeds'
    common best rate, else their geometric mean; seed_*, best_rows: per B, one entry per
    seed. unreached: records that never reached the target; missing_batch_sizes: B where some
    seed has no rate that reached it (not fitted); edge_batch_sizes: B where some seed's best
    rate is the smallest or largest it tried (the grid may be too narrow)."""

    batch_sizes: np.ndarray
    steps: np.ndarray
    examples: np.ndarray
    learning_rates: np.ndarray
    num_seeds: np.ndarray
    unreached: list[dict[str, Any]]
    missing_batch_sizes: list[float]
    edge_batch_sizes: list[float]
    seed_steps: list[list[float]] = dataclasses.field(default_factory=list)
    seed_learning_rates: list[list[float]] = dataclasses.field(default_factory=list)
    best_rows: list[list[Mapping[str, Any]]] = dataclasses.field(default_factory=list)


def best_per_batch_size(records: Sequence[Mapping[str, Any]]) -> BestPerBatchSize:
    """Per batch size: each seed's best learning rate (fewest steps), then the mean over seeds
    (why per seed first: docs/design.md, "From records to B_crit"). records: one dict per
    trial ("steps" None or NaN: never reached; no "seed": seed 0). A batch size counts only if
    every seed reached the target at some rate; repeats of one (B, η, seed) are averaged and
    count only if all reached it."""
    reached = lambda r: r["steps"] is not None and math.isfinite(float(r["steps"]))
    unreached = [dict(r) for r in records if not reached(r)]
    cells: dict[tuple[float, int, float], list[Mapping[str, Any]]] = {}
    for rec in records:
        key = (float(rec["batch_size"]), int(rec.get("seed", 0) or 0), float(rec["learning_rate"]))
        cells.setdefault(key, []).append(rec)
    # per (B, seed): {lr: (mean steps or None, rows)}
    per_seed: dict[float, dict[int, dict[float, tuple[float | None, list]]]] = {}
    for (b, sd, lr), recs in sorted(cells.items()):
        mean_s = (float(np.mean([float(r["steps"]) for r in recs]))
                  if all(reached(r) for r in recs) else None)
        per_seed.setdefault(b, {}).setdefault(sd, {})[lr] = (mean_s, recs)
    bs, missing, edge, rows = [], [], [], []
    for b, seeds in sorted(per_seed.items()):
        best = {}
        for sd, by_lr in sorted(seeds.items()):
            finite = [(s, lr) for lr, (s, _) in by_lr.items() if s is not None]
            if finite:
                best[sd] = min(finite)
        if len(best) < len(seeds):
            missing.append(b)
            continue
        bs.append(b)
        rows.append([(best[sd][0], best[sd][1], seeds[sd][best[sd][1]][1][0])
                     for sd in sorted(best)])
        if any(len(seeds[sd]) > 1 and best[sd][1] in (min(seeds[sd]), max(seeds[sd]))
               for sd in best):
            edge.append(b)
    steps = np.asarray([np.mean([s for s, _, _ in r]) for r in rows], dtype=np.float64)
    seed_lrs = [[lr for _, lr, _ in r] for r in rows]
    lrs = [lr[0] if len(set(lr)) == 1 else float(np.exp(np.mean(np.log(lr))))
           for lr in seed_lrs]
    b_arr = np.asarray(bs, dtype=np.float64)
    return BestPerBatchSize(
        batch_sizes=b_arr, steps=steps, examples=b_arr * steps,
        learning_rates=np.asarray(lrs, dtype=np.float64),
        num_seeds=np.asarray([len(r) for r in rows], dtype=np.int64),
        unreached=unreached, missing_batch_sizes=missing, edge_batch_sizes=edge,
        seed_steps=[[s for s, _, _ in r] for r in rows], seed_learning_rates=seed_lrs,
        best_rows=[[row for _, _, row in r] for r in rows])


def noise_scale_at_crossing(steps: Sequence[float] | np.ndarray,
                            trace_sigma: Sequence[float] | np.ndarray,
                            grad_sq_norm: Sequence[float] | np.ndarray,
                            crossing_step: float | None, *,
                            window: float | None = None, rel_window: float = 0.2,
                            min_points: int = 3) -> float:
    """B_simple at a crossing as a ratio of window averages, mean tr(Σ) / mean |G|², over the
    measurements with |step − crossing| ≤ width/2 (width = `window`, else
    rel_window·crossing_step; the `min_points` nearest when fewer fall in it); trace_h_sigma
    and g_h_g give B_noise. NaN without data."""
    x = np.asarray(steps, dtype=np.float64)
    num = np.asarray(trace_sigma, dtype=np.float64)
    den = np.asarray(grad_sq_norm, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(num) & np.isfinite(den)
    x, num, den = x[ok], num[ok], den[ok]
    if crossing_step is None or x.size == 0:
        return math.nan
    width = rel_window * crossing_step if window is None else window
    dist = np.abs(x - crossing_step)
    sel = dist <= width / 2
    if np.count_nonzero(sel) < min_points:
        sel = np.zeros_like(sel)
        sel[np.argsort(dist, kind="stable")[:min_points]] = True
    mean_den = float(np.mean(den[sel]))
    return float(np.mean(num[sel])) / mean_den if mean_den > 0 else math.nan
