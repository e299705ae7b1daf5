"""The noise scale at a target loss L under the two protocols a report names:

- per trial: every best trial (the best learning rate at each batch size B) records B_simple
  = tr(Σ)/|G|² and B_noise = tr(HΣ)/GᵀHG at its crossing of L, a ratio of means over the
  `sweep.noise_window` measurements nearest it (`cbs.sweeps.trials`); min / median / max
  over B.
- reference trajectory (McCandlish et al. 2018): one run at B_ref, measured on the whole
  training set (`cbs.sweeps.reference`); the ratio of means over the first `window`
  measurements at or after the crossing, beside the per-trial protocol's centred window.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import selection
from cbs.analysis.fits.fit import g3
from cbs.results import files, shared
from cbs.results.store import upgrade_noise_fields

__all__ = [
    "NAMES", "PAIRS", "after_crossing", "examples_per_value", "protocol", "protocol_lines",
    "reference", "reference_cell", "reference_values", "spread", "spread_cell",
]

NAMES = ("b_simple", "b_noise")
PAIRS = {"b_simple": ("trace_sigma", "grad_sq_norm"), "b_noise": ("trace_h_sigma", "g_h_g")}


def spread(best_records: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """measured_<name> (median over the best trials at target `key`), measured_<name>_min,
    _max per name in NAMES, and measured_by_batch_size {B: {name: value or NaN}}."""
    out: dict[str, Any] = {}
    for name in NAMES:
        v = [float(x) for r in best_records
             if (x := r["noise_at_target"].get(key, {}).get(name)) is not None
             and math.isfinite(float(x))]
        out[f"measured_{name}"] = float(np.median(v)) if v else math.nan
        out[f"measured_{name}_min"] = min(v) if v else math.nan
        out[f"measured_{name}_max"] = max(v) if v else math.nan
    out["measured_by_batch_size"] = {
        str(r["batch_size"]): {n: r["noise_at_target"].get(key, {}).get(n, math.nan)
                               for n in NAMES} for r in best_records}
    return out


def _noise(definition: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the sweep's noise settings, whether each measurement used the full training set)."""
    noise = upgrade_noise_fields({"sweep": definition.get("sweep", {}), "noise": definition.get(
        "config", {}).get("noise", {})})["noise"]
    n_train, examples = definition.get("num_train"), noise.get("examples", "stream")
    full = examples == "all" or (examples == "auto" and n_train is not None
                                 and n_train <= 10_000)
    return noise, full


def examples_per_value(definition: dict[str, Any]) -> tuple[int, str]:
    """(examples behind one per-trial value, in words): the training set or the window's."""
    noise, full = _noise(definition)
    if full:
        return int(definition.get("num_train") or 0), "full training set"
    window = int(definition.get("sweep", {}).get("noise_window", 5))
    batch = int(noise.get("batch_size") or 0)
    return batch * window, f"sampled, {window} × {batch}"


def protocol(definition: dict[str, Any]) -> str:
    """The per-trial protocol of a sweep in words, from its sweep.json definition."""
    s = definition.get("sweep", {})
    n_train = definition.get("num_train")
    window = s.get("noise_window", 5)
    noise, full = _noise(definition)
    m = noise.get("deviations", 0) if noise.get("curvature", False) else 0
    h = noise.get("hessian_batch_size", 0)
    if full:
        where = f"full training set (N={n_train})"
        if m:
            hess = f"the Hessian of {h} independent examples" if h else "the full-data Hessian"
            where += f"; tr(HΣ) from {m} random deviations and {hess}"
    else:
        where = f"sampled: {noise.get('batch_size')} examples per measurement"
        if m:
            where += f"; tr(HΣ) from {m} of them and the Hessian of {h} independent examples"
    return (f"{where}; ratio of means over the {window} evaluations nearest each best "
            "trial's crossing; min / median / max over batch sizes")


def reference_values(run: dict[str, Any], targets: Sequence[float], window: int
                     ) -> list[dict[str, Any]]:
    """Per target, the noise scale of the reference run (a `reference_noise.jsonl` record):
    "<name>" by `after_crossing`, "<name>_centred" over the `window` nearest the crossing."""
    curve, metric = run["curve"], run["target_metric"]
    col = lambda key: np.asarray([math.nan if v is None else v for v in curve[key]], np.float64)
    x = col("noise/step")
    out = []
    for target in targets:
        crossing = selection.steps_to_target(curve["step"], col(metric).tolist(), target)
        row: dict[str, Any] = {"target": float(target), "crossing_step": crossing}
        for name, (num_key, den_key) in PAIRS.items():
            num, den = col(f"noise/{num_key}"), col(f"noise/{den_key}")
            row[name], row[f"{name}_steps"] = after_crossing(x, num, den, crossing, window)
            row[f"{name}_centred"] = (
                math.nan if crossing is None else selection.noise_scale_at_crossing(
                    x, num, den, crossing, window=0.0, min_points=window))
        out.append(row)
    return out


def after_crossing(x, num, den, crossing, window) -> tuple[float, list[float]]:
    """(ratio of means, steps) of the first `window` finite measurements at steps ≥ crossing."""
    if crossing is None:
        return math.nan, []
    ok = np.isfinite(x) & np.isfinite(num) & np.isfinite(den) & (x >= crossing)
    idx = np.nonzero(ok)[0][:window]
    if idx.size == 0:
        return math.nan, []
    mean_den = float(np.mean(den[idx]))
    value = float(np.mean(num[idx])) / mean_den if mean_den > 0 else math.nan
    return value, x[idx].tolist()


def reference(sweep_dir: str, targets: Sequence[float], window: int
              ) -> dict[str, Any] | None:
    """The sweep's reference-trajectory protocol (None without one), `reference_values` too."""
    runs = shared.read_merged(os.path.join(sweep_dir, files.REFERENCE_NOISE_FILE),
                              files.REFERENCE_RUN_KEYS)
    if not runs:
        return None
    run = runs[-1]
    return {"protocol": run.get("protocol", "reference trajectory"),
            "batch_size": run["batch_size"], "learning_rate": run["learning_rate"],
            "seed": run.get("seed", 0), "targets": reference_values(run, targets, window)}


def reference_cell(ref: dict[str, Any] | None, target: float) -> str:
    """Markdown cell "B_simple / B_noise" of the reference run at `target` ("–" if none)."""
    row = next((r for r in (ref or {}).get("targets", []) if r["target"] == float(target)), None)
    return "–" if row is None else f"{g3(row['b_simple'])} / {g3(row['b_noise'])}"


def spread_cell(t: dict[str, Any], name: str) -> str:
    """Markdown cell "median (min–max)" of `name` over batch sizes for target entry `t`."""
    med = t.get(f"measured_{name}")
    lo, hi = t.get(f"measured_{name}_min"), t.get(f"measured_{name}_max")
    return g3(med) if lo is None or not math.isfinite(float(lo)) else (
        f"{g3(med)} ({g3(lo)}–{g3(hi)})")


def protocol_lines(analysis: dict[str, Any]) -> list[str]:
    """The report's sentences naming the noise protocols of `analysis` (from `analyze`)."""
    lines = [f"Noise scale per trial: {analysis.get('noise_protocol', 'not recorded')}."]
    ref = analysis.get("reference_noise")
    if ref:
        lines += ["", f"Reference run: {ref['protocol']}. Beside it, the same run with the "
                  "per-trial protocol's centred window: " + "; ".join(
                      f"L={r['target']:g}: {g3(r['b_simple_centred'])} / "
                      f"{g3(r['b_noise_centred'])}" for r in ref["targets"]) + "."]
    return lines
