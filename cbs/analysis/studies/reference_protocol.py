"""The noise scale at each target under one protocol: the reference trajectory over seeds
(`reference_seeds/seed_<k>.jsonl`, `cbs.sweeps.reference_seeds`). Per seed and target, each
noise scale as `cbs.analysis.fits.noise_at_target.after_crossing` reads it; across seeds the
median, the min–max and the geometric standard deviation exp(sd(log value)).

Names: b_simple = tr(Σ)/|G|², b_noise = tr(HΣ)/GᵀHG of the plain gradient; b_simple_p =
tr(PΣ)/GᵀPG, b_noise_p = tr(PHPΣ)/GᵀPHPG of the update u = P·g applied by Adam/AdamW
(`cbs.stats.preconditioned`), absent for SGD.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import noise_at_target, selection
from cbs.analysis.fits.fit import g3
from cbs.results import paths, records

__all__ = [
    "NAMES", "PAIRS", "load", "markdown", "seed_values", "spread", "summarize", "window_se",
]

NAMES = ("b_simple", "b_noise", "b_simple_p", "b_noise_p")
PAIRS = {"b_simple": ("noise/trace_sigma", "noise/grad_sq_norm"),
         "b_noise": ("noise/trace_h_sigma", "noise/g_h_g"),
         "b_simple_p": ("noise_p/trace_sigma", "noise_p/grad_sq_norm"),
         "b_noise_p": ("noise_p/trace_h_sigma", "noise_p/g_h_g")}
SEEDS_GLOB = os.path.join("reference_seeds", "seed_*.jsonl")  # cbs.sweeps.reference_seeds


def _array(values: Sequence[Any]) -> np.ndarray:
    return np.asarray([math.nan if v is None else float(v) for v in values], np.float64)


def seed_values(run: dict[str, Any], targets: Sequence[float], window: int
                ) -> list[dict[str, Any]]:
    """Per target, one seed's crossing_step, "<name>" and "<name>_se" (NaN: not crossed)."""
    curve, metric = run["curve"], run["target_metric"]
    x = _array(curve["noise/step"])
    progress = _array(curve[metric]).tolist()
    out = []
    for target in targets:
        crossing = selection.steps_to_target(curve["step"], progress, target)
        row: dict[str, Any] = {"target": float(target), "crossing_step": crossing}
        for name, (num_key, den_key) in PAIRS.items():
            if num_key in curve and den_key in curve:
                num, den = _array(curve[num_key]), _array(curve[den_key])
                row[name] = noise_at_target.after_crossing(x, num, den, crossing, window)[0]
                row[f"{name}_se"] = window_se(x, num, den, crossing, window)
        out.append(row)
    return out


def window_se(x, num, den, crossing, window) -> float:
    """The relative standard error of the window's ratio of means from its k measurements by
    the delta method, var(r)/r² = (s_n²/n̄² + s_d²/d̄² − 2·s_nd/(n̄·d̄))/k (drift within the
    window counts as noise: an upper bound); NaN below k = 2."""
    if crossing is None:
        return math.nan
    ok = np.isfinite(x) & np.isfinite(num) & np.isfinite(den) & (x >= crossing)
    idx = np.nonzero(ok)[0][:window]
    if idx.size < 2:
        return math.nan
    n, d = num[idx], den[idx]
    mn, md = float(np.mean(n)), float(np.mean(d))
    if mn <= 0 or md <= 0:
        return math.nan
    cov = np.cov(n, d, ddof=1)
    rel_var = (cov[0, 0] / mn**2 + cov[1, 1] / md**2 - 2 * cov[0, 1] / (mn * md)) / idx.size
    return float(math.sqrt(max(rel_var, 0.0)))


def spread(values: Sequence[float]) -> dict[str, Any]:
    """{"values" (per seed), "seeds" (finite, positive ones), "median", "min", "max", "gsd"
    (NaN below two seeds)}."""
    v = np.asarray([x for x in values if math.isfinite(x) and x > 0], np.float64)
    if not v.size:
        return {"values": list(values), "seeds": 0, "median": math.nan, "min": math.nan,
                "max": math.nan, "gsd": math.nan}
    gsd = float(np.exp(np.std(np.log(v), ddof=1))) if v.size > 1 else math.nan
    return {"values": [float(x) for x in values], "seeds": int(v.size),
            "median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "gsd": gsd}


def summarize(runs: Sequence[dict[str, Any]], targets: Sequence[float], window: int
              ) -> dict[str, Any]:
    """The protocol over the seeds' runs, with per target each name's `spread` over seeds."""
    per_seed = [seed_values(r, targets, window) for r in runs]
    rows = []
    for j, target in enumerate(targets):
        row: dict[str, Any] = {"target": float(target),
                               "crossings": [s[j]["crossing_step"] for s in per_seed]}
        for name in NAMES:
            if all(name in s[j] for s in per_seed):
                ses = [s[j][f"{name}_se"] for s in per_seed]  # per seed, relative
                finite = [v for v in ses if math.isfinite(v)]
                row[name] = spread([s[j][name] for s in per_seed]) | {
                    "se": ses, "se_median": float(np.median(finite)) if finite else math.nan}
        rows.append(row)
    first = runs[0]
    b = first["batch_size"]
    return {"batch_size": b, "learning_rate": first["learning_rate"],
            "seeds": [int(r["seed"]) for r in runs],
            "lowest_target": first.get("lowest_target"),
            "b_crit_lowest_target": first.get("b_crit_lowest_target"),
            "deviations": first.get("deviations"), "window": window,
            "optimizer": first.get("optimizer"),
            "protocol": (f"reference trajectory at B={b} (B_crit/"
                         f"{g3(first.get('b_crit_lowest_target', math.nan) / b)} at the "
                         f"lowest target), its best rate {first['learning_rate']:.3g}, "
                         f"{len(runs)} seeds (initialisation and data order); "
                         f"{first.get('protocol', '')}; median over seeds"),
            "targets": rows}


def load(sweep_dir: str, targets: Sequence[float] | None = None, window: int | None = None
         ) -> dict[str, Any] | None:
    """`summarize` of the seeds in `sweep_dir` (None: none); targets, window: the sweep's."""
    folder, pattern = os.path.split(SEEDS_GLOB)
    names = fnmatch.filter(paths.listdir(paths.join(sweep_dir, folder)), pattern)
    seed_files = [paths.join(sweep_dir, folder, n) for n in names]
    runs = [rs[-1] for rs in (records.read_records(p) for p in seed_files) if rs]
    if not runs:
        return None
    runs.sort(key=lambda r: int(r["seed"]))
    if targets is None or window is None:
        from cbs.results.store import SweepStore

        sweep = (SweepStore(sweep_dir).definition() or {}).get("sweep", {})
        targets = sweep.get("targets", []) if targets is None else targets
        window = int(sweep.get("noise_window", 5)) if window is None else window
    return summarize(runs, targets, int(window))


def _cell(entry: dict[str, Any] | None) -> str:
    """"median (min–max) ×gsd ±se" of a spread, "–" without one."""
    if not entry or not entry["seeds"]:
        return "–"
    se = entry.get("se_median", math.nan)
    return (f"{g3(entry['median'])} ({g3(entry['min'])}–{g3(entry['max'])}) "
            f"×{g3(entry['gsd'])}" + (f" ±{100 * se:.0f}%" if math.isfinite(se) else ""))


def markdown(summary: dict[str, Any]) -> str:
    """A table: per target, each noise scale's spread over seeds."""
    names = [n for n in NAMES if any(n in r for r in summary["targets"])]
    labels = {"b_simple": "B_simple", "b_noise": "B_noise", "b_simple_p": "B_simple^P",
              "b_noise_p": "B_noise^P"}
    lines = [f"Protocol: {summary['protocol']}.", "",
             "The spread is over seeds (GSD: geometric standard deviation); ±: the median "
             "over seeds of one window's relative standard error (delta method over its "
             "measurements, each on its own draws; drift within the window counts as noise).",
             "",
             "| target L | " + " | ".join(f"{labels[n]} median (min–max) ×GSD ±SE"
                                          for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in summary["targets"]:
        lines.append(f"| {r['target']:g} | " + " | ".join(_cell(r.get(n)) for n in names)
                     + " |")
    return "\n".join(lines)
