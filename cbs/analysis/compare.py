"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4).

McCandlish et al. claim that the noise scale measured in one run predicts the critical batch
of a task within an order of magnitude, across tasks whose B_crit spans several decades. Here
every (study, target) of one or more sweep directories is one point: the fitted B_crit with
its interval (`cbs.analysis.report.analyze`, recomputed from the records, so the points are
exactly what the studies' reports say) against the noise scale measured at that target
(B_simple and B_noise, with their spread over batch sizes where the analysis has one), with
y = x and the factor-10 band drawn. Needs no model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis import calibration, fit, report
from cbs.results import files, records
from cbs.results.store import SweepStore

DEFAULT_PROTOCOL = "per trial, ratio of window means at the crossing, median over batch sizes"


def collect(sweep_dirs: Sequence[str], *, bootstrap: int = 1000) -> list[dict[str, Any]]:
    """One row per (study, target) with a B_crit fit: study, task, optimizer, target,
    b_crit and its interval, the measured b_simple / b_noise (median over batch sizes) with
    their min/max where recorded, the noise protocol, and the ratios B_crit/B_simple and
    B_crit/B_noise."""
    rows = []
    for d in sweep_dirs:
        analysis = report.analyze(d, bootstrap=bootstrap, write=False)
        config = (SweepStore(d).definition() or {}).get("config", {})
        task = "/".join(config.get(k, {}).get("name", "?") for k in ("data", "model"))
        optimizer = config.get("optim", {}).get("name", "?")
        for t in analysis["targets"]:
            f = t["fit"]
            if f["status"] != fit.OK:
                continue
            row = {"study": os.path.basename(os.path.normpath(d)), "task": task,
                   "optimizer": optimizer, "target": t["target"], "b_crit": f["b_crit"],
                   "b_crit_ci": tuple(f["b_crit_ci"] or (math.nan, math.nan)),
                   "extrapolated": bool(t.get("b_crit_extrapolated")),
                   "protocol": t.get("noise_protocol") or analysis.get("noise_protocol")
                   or DEFAULT_PROTOCOL}
            for name in ("b_simple", "b_noise"):
                mid = _finite(t.get(f"measured_{name}"))
                row[name] = mid
                row[f"{name}_range"] = (_finite(t.get(f"measured_{name}_min", mid)),
                                        _finite(t.get(f"measured_{name}_max", mid)))
                row[f"ratio_{name}"] = f["b_crit"] / mid if mid > 0 else math.nan
            rows.append(row)
    return rows


def _finite(x: Any) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.nan


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per noise scale: points with a value, the share within a factor 2 and 10 of B_crit,
    and the geometric mean and range of B_crit/B_noise-scale; and the decades B_crit spans."""
    out: dict[str, Any] = {"points": len(rows)}
    b = np.asarray([r["b_crit"] for r in rows], dtype=np.float64)
    out["b_crit_decades"] = float(np.log10(b.max() / b.min())) if b.size else math.nan
    for name in ("b_simple", "b_noise"):
        ratio = np.asarray([r[f"ratio_{name}"] for r in rows], dtype=np.float64)
        ratio = ratio[np.isfinite(ratio) & (ratio > 0)]
        if not ratio.size:
            out[name] = {"points": 0}
            continue
        dist = np.abs(np.log10(ratio))
        out[name] = {"points": int(ratio.size),
                     "within_2x": float(np.mean(dist <= math.log10(2))),
                     "within_10x": float(np.mean(dist <= 1.0)),
                     "geometric_mean_ratio": float(np.exp(np.mean(np.log(ratio)))),
                     "ratio_range": (float(ratio.min()), float(ratio.max()))}
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (study, target)."""
    lines = ["| study | task | optimizer | target L | B_crit (95% CI) | B_simple (min–max over B) "
             "| B_noise (min–max over B) | B_crit/B_simple | B_crit/B_noise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(
            f"| {r['study']} | {r['task']} | {r['optimizer']} | {r['target']:g} | "
            f"{_g(r['b_crit'])} ({_g(r['b_crit_ci'][0])}–{_g(r['b_crit_ci'][1])}){mark} | "
            f"{_with_range(r, 'b_simple')} | {_with_range(r, 'b_noise')} | "
            f"{_g(r['ratio_b_simple'])} | {_g(r['ratio_b_noise'])} |")
    return "\n".join(lines)


def _with_range(row: dict[str, Any], name: str) -> str:
    lo, hi = row[f"{name}_range"]
    if not math.isfinite(row[name]):
        return "–"
    if math.isfinite(lo) and math.isfinite(hi) and (lo != row[name] or hi != row[name]):
        return f"{_g(row[name])} ({_g(lo)}–{_g(hi)})"
    return _g(row[name])


def _g(x: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.3g}"


def figure(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Log-log B_crit against B_simple (left) and B_noise (right): y = x, the factor-10 band,
    B_crit's interval and the noise scale's spread over batch sizes as error bars, colour per
    task and marker per optimizer."""
    from matplotlib.figure import Figure  # no pyplot: no backend or global state is touched
    from matplotlib.lines import Line2D

    tasks = sorted({r["task"] for r in rows})
    opts = sorted({r["optimizer"] for r in rows})
    markers = dict(zip(opts, "osD^v<>", strict=False))
    colours = {t: f"C{i % 10}" for i, t in enumerate(tasks)}
    fig = Figure(figsize=(11, 4.8))
    axes = fig.subplots(1, 2, sharey=True)
    values = [v for r in rows for v in (r["b_simple"], r["b_noise"], r["b_crit"])
              if math.isfinite(v) and v > 0]
    lo, hi = min(values) / 3, max(values) * 3
    x = np.geomspace(lo, hi, 50)
    for ax, name, label in zip(axes, ("b_simple", "b_noise"), ("B_simple", "B_noise"),
                               strict=True):
        pts = [r for r in rows if math.isfinite(r[name]) and r[name] > 0]
        ax.plot(x, x, "k-", lw=1, label="B_crit = noise scale")
        ax.fill_between(x, x / 10, x * 10, color="0.9", label="within a factor 10")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        for r in pts:
            y_err = [[r["b_crit"] - r["b_crit_ci"][0]], [r["b_crit_ci"][1] - r["b_crit"]]]
            lo_x, hi_x = r[f"{name}_range"]
            x_err = [[r[name] - lo_x], [hi_x - r[name]]] if math.isfinite(lo_x) else None
            # a collapsed interval can sit a rounding error inside its point: draw it as 0
            ax.errorbar(r[name], r["b_crit"], yerr=np.clip(np.nan_to_num(y_err), 0, None),
                        xerr=None if x_err is None else np.clip(np.nan_to_num(x_err), 0, None),
                        fmt=markers[r["optimizer"]], color=colours[r["task"]], ms=6,
                        capsize=2, lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {label} at the target (examples)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fitted B_crit (examples)")
    handles = [Line2D([], [], color=colours[t], marker="o", ls="", label=t) for t in tasks]
    handles += [Line2D([], [], color="k", marker=markers[o], ls="", label=o) for o in opts]
    axes[1].legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle("Critical batch against the measured noise scale, one point per study and "
                 "target")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_report(sweep_dirs: Sequence[str], out_dir: str, *, bootstrap: int = 1000) -> str:
    """report.md and the figure in out_dir; returns the report's path."""
    rows = collect(sweep_dirs, bootstrap=bootstrap)
    if not rows:
        raise ValueError(f"none of {list(sweep_dirs)} has a target with a B_crit fit")
    figure(rows, os.path.join(out_dir, files.FIGURE_FILE))
    s = summary(rows)
    lines = ["# B_crit against the measured noise scale across studies", "",
             f"{s['points']} points from {len({r['study'] for r in rows})} studies; B_crit "
             f"spans {s['b_crit_decades']:.2g} decades. B_crit: the fit of each study's "
             "report, with its 95% interval (bootstrap-t over batch sizes, resampled jointly "
             "across targets). Noise scale: median over the best trial at each batch size, "
             "with the min–max over batch sizes. Noise protocol per study: " + "; ".join(
                 sorted({f"{r['study']}: {r['protocol']}" for r in rows})) + ".", ""]
    for name, label in (("b_simple", "B_simple"), ("b_noise", "B_noise")):
        v = s[name]
        if v["points"]:
            lines.append(
                f"- B_crit/{label}: geometric mean {v['geometric_mean_ratio']:.3g}, range "
                f"{v['ratio_range'][0]:.3g}–{v['ratio_range'][1]:.3g}; within a factor 2 of "
                f"B_crit in {v['within_2x']:.0%} of {v['points']} points, within a factor 10 in "
                f"{v['within_10x']:.0%}.")
    calib = calibration.build([fit.json_ready(r) for r in rows])
    lines += ["", table(rows), "", f"![B_crit against the noise scale]({files.FIGURE_FILE})", "",
              "## Predicting B_crit from one measurement", "", calibration.markdown(calib), ""]
    path = os.path.join(out_dir, files.REPORT_FILE)
    records.write_atomic(path, "\n".join(lines))
    records.write_json_atomic(os.path.join(out_dir, "compare.json"),
                              {"rows": [fit.json_ready(r) for r in rows], "summary": s})
    records.write_json_atomic(os.path.join(out_dir, calibration.CALIBRATION_FILE), calib)
    return path
