"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4;
docs/guides/across_studies.md): every (study, target) is one point, the fitted B_crit
(`cbs.analysis.reports.report.analyze`) against the noise scale measured at that target under
the protocol (`cbs.analysis.studies.reference_protocol`, where a study has it) and per trial
(median over the best trial at each batch size).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.advice import calibration
from cbs.analysis.fits import fit
from cbs.analysis.fits.fit import g3
from cbs.analysis.reports import plots, report, report_tables
from cbs.analysis.studies import reference_protocol
from cbs.results import files, paths, records
from cbs.results.calibration import CALIBRATION_FILE
from cbs.results.store import SweepStore

__all__ = [
    "collect", "figure", "held_out_pairs", "prediction_path", "study_labels", "study_path",
    "summary", "table", "write_report",
]

DEFAULT_PROTOCOL = "per trial, ratio of window means at the crossing, median over batch sizes"
PER_TRIAL = (("b_simple", "B_simple"), ("b_noise", "B_noise"))  # (row key, label)
# The protocol's noise scales: the gradient's, and the update's (P·g with Adam/AdamW).
PROTOCOL = (("ref_b_simple", "B_simple"), ("ref_b_noise", "B_noise"),
            ("ref_update_b_simple", "B_simple of the update (P·g; SGD: g)"),
            ("ref_update_b_noise", "B_noise of the update (P·g; SGD: g)"))


def study_path(sweep_dir: str) -> str:
    """A study's sweep directory as an absolute path (or the URI), no trailing separator."""
    text = sweep_dir.rstrip("/") or "/"
    return text if "://" in text else os.path.abspath(text)


def study_labels(sweep_dirs: Sequence[str]) -> list[str]:
    """Distinct labels: each folder's name, or as many trailing folders as tell apart folders
    that share one (`a/digits`, `b/digits`)."""
    parts = [study_path(d).split("/") for d in sweep_dirs]
    depth = [1] * len(parts)
    while True:
        labels = ["/".join(p[-k:]) for p, k in zip(parts, depth, strict=True)]
        clashes = {x for x in labels if labels.count(x) > 1}
        longer = [i for i, x in enumerate(labels) if x in clashes and depth[i] < len(parts[i])]
        if not longer:  # distinct, or the same path twice (`cbs-compare` refuses that)
            return labels
        for i in longer:
            depth[i] += 1


def collect(sweep_dirs: Sequence[str], *, bootstrap: int = 1000) -> list[dict[str, Any]]:
    """One row per (study, target) with a B_crit fit: b_crit and its interval, per trial
    b_simple / b_noise (median over batch sizes) with _range, _by_batch_size and ratio_;
    per key of PROTOCOL its median over seeds with _range, _gsd, _seeds and ratio_."""
    rows = []
    for d, label in zip(sweep_dirs, study_labels(sweep_dirs), strict=True):
        analysis = report.analyze(d, bootstrap=bootstrap, write=False)
        definition = SweepStore(d).definition() or {}
        config = definition.get("config", {})
        ref = reference_protocol.load(d, [t["target"] for t in analysis["targets"]],
                                      int(definition.get("sweep", {}).get("noise_window", 5)))
        task = "/".join(config.get(k, {}).get("name", "?") for k in ("data", "model"))
        optimizer = config.get("optim", {}).get("name", "?")
        for t in analysis["targets"]:
            f = t["fit"]
            if f["status"] != fit.OK:
                continue
            row = {"study": label, "task": task, "optimizer": optimizer,
                   "target": t["target"], "b_crit": f["b_crit"],
                   "b_crit_ci": tuple(f["b_crit_ci"] or (math.nan, math.nan)),
                   "n_batch_sizes": int(f["n_batch_sizes"]),
                   "b_crit_unresolved": report_tables.unresolved(f),
                   "extrapolated": bool(t.get("b_crit_extrapolated")),
                   "protocol": t.get("noise_protocol") or analysis.get("noise_protocol")
                   or DEFAULT_PROTOCOL,
                   "best_learning_rate_by_batch_size": {
                       f"{float(b):g}": float(lr) for b, lr in zip(
                           t.get("batch_sizes", []), t.get("learning_rates", []), strict=False)}}
            by_batch = t.get("measured_by_batch_size") or {}
            for name in ("b_simple", "b_noise"):
                mid = _finite(t.get(f"measured_{name}"))
                row |= {name: mid, f"{name}_by_batch_size": {
                            b: _finite(v.get(name)) for b, v in by_batch.items()
                            if math.isfinite(_finite(v.get(name)))},
                        f"{name}_range": (_finite(t.get(f"measured_{name}_min", mid)),
                                          _finite(t.get(f"measured_{name}_max", mid))),
                        f"ratio_{name}": f["b_crit"] / mid if mid > 0 else math.nan}
            row.update(_protocol_fields(ref, t["target"], f["b_crit"], optimizer))
            rows.append(row)
    return rows


def _protocol_fields(ref: dict[str, Any] | None, target: float, b_crit: float,
                     optimizer: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(
        (r for r in (ref or {}).get("targets", []) if r["target"] == float(target)), {})
    out: dict[str, Any] = {"ref_batch_size": (ref or {}).get("batch_size"),
                           "ref_protocol": (ref or {}).get("protocol")}
    update = optimizer in ("adam", "adamw")  # P·g; SGD's update is the gradient itself
    sources = {"ref_b_simple": "b_simple", "ref_b_noise": "b_noise",
               "ref_update_b_simple": "b_simple_p" if update else "b_simple",
               "ref_update_b_noise": "b_noise_p" if update else "b_noise"}
    for key, name in sources.items():
        v = entry.get(name) or {}
        mid = _finite(v.get("median"))
        out |= {key: mid, f"{key}_range": (_finite(v.get("min")), _finite(v.get("max"))),
                f"{key}_gsd": _finite(v.get("gsd")), f"{key}_seeds": int(v.get("seeds", 0)),
                f"ratio_{key}": b_crit / mid if mid > 0 else math.nan}
    return out


def _finite(x: Any) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.nan


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per noise scale: points, the share within a factor 2 and 10 of B_crit, the geometric
    mean and range of B_crit over it; and the decades B_crit spans."""
    out: dict[str, Any] = {"points": len(rows)}
    b = np.asarray([r["b_crit"] for r in rows], dtype=np.float64)
    out["b_crit_decades"] = float(np.log10(b.max() / b.min())) if b.size else math.nan
    for name in [n for n, _ in PER_TRIAL + PROTOCOL]:
        ratio = np.asarray([r.get(f"ratio_{name}", math.nan) for r in rows], dtype=np.float64)
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
            f"{_b_crit_cell(r)}{mark} | "
            f"{_with_range(r, 'b_simple')} | {_with_range(r, 'b_noise')} | "
            f"{g3(r['ratio_b_simple'])} | {g3(r['ratio_b_noise'])} |")
    return "\n".join(lines)


def _b_crit_cell(row: dict[str, Any]) -> str:
    """"B_crit (lo–hi)", or flagged unresolved when its interval collapsed."""
    if row.get("b_crit_unresolved"):
        return f"{g3(row['b_crit'])}, {report_tables.unresolved_text(row)}"
    lo, hi = row["b_crit_ci"]
    return f"{g3(row['b_crit'])} ({g3(lo)}–{g3(hi)})"


def _with_range(row: dict[str, Any], name: str) -> str:
    lo, hi = row[f"{name}_range"]
    if not math.isfinite(row[name]):
        return "–"
    if math.isfinite(lo) and math.isfinite(hi) and (lo != row[name] or hi != row[name]):
        return f"{g3(row[name])} ({g3(lo)}–{g3(hi)})"
    return g3(row[name])


def figure(rows: Sequence[dict[str, Any]], path: str,
           names: Sequence[tuple[str, str]] = PER_TRIAL, *, spread: str = "over batch sizes",
           title: str = "Critical batch against the measured noise scale, one point per "
                        "study and target") -> str:
    """Log-log B_crit against each noise scale of `names` ((row key, label)) with y = x, the
    factor-10 band and error bars (`spread`: what the row's <key>_range is), colour per task
    and marker per optimizer."""
    from matplotlib.figure import Figure  # no pyplot: no backend or global state is touched
    from matplotlib.lines import Line2D

    tasks = sorted({r["task"] for r in rows})
    opts = sorted({r["optimizer"] for r in rows})
    markers = dict(zip(opts, "osD^v<>", strict=False))
    colours = {t: f"C{i % 10}" for i, t in enumerate(tasks)}
    cols = min(len(names), 2)
    grid_rows = -(-len(names) // cols)
    fig = Figure(figsize=(5.5 * cols, 4.8 * grid_rows))
    axes = np.atleast_1d(fig.subplots(grid_rows, cols, sharey=True, squeeze=False)).ravel()
    values = [v for r in rows for v in [r.get(n, math.nan) for n, _ in names] + [r["b_crit"]]
              if math.isfinite(v) and v > 0]
    lo, hi = min(values) / 3, max(values) * 3
    x = np.geomspace(lo, hi, 50)
    for ax, (name, label) in zip(axes, names, strict=True):
        pts = [r for r in rows if math.isfinite(r.get(name, math.nan)) and r[name] > 0]
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
        ax.set(xscale="log", yscale="log", xlabel=f"measured {label} at the target (examples)",
               ylabel="fitted B_crit (examples)")
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=colours[t], marker="o", ls="", label=t) for t in tasks]
    handles += [Line2D([], [], color="k", marker=markers[o], ls="", label=o) for o in opts]
    axes[min(1, len(axes) - 1)].legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle(f"{title}\nbars: B_crit's 95% interval; the noise scale's min–max {spread}")
    fig.tight_layout()
    return plots.save_figure(fig, path, dpi=110)


def protocol_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (study, target) under the protocol."""
    lines = ["| study | optimizer | target L | B_crit (95% CI) | B | B/B_crit | seeds | "
             "B_simple | B_noise | B_simple^P | B_noise^P | B_crit/B_simple | B_crit/B_noise | "
             "B_crit/B_noise^P |", "|" + "---|" * 14]
    for r in rows:
        if not math.isfinite(r.get("ref_b_simple", math.nan)):
            continue
        adaptive = r["optimizer"] in ("adam", "adamw")
        cell = functools.partial(_seeds_cell, r)
        lines.append(
            f"| {r['study']} | {r['optimizer']} | {r['target']:g} | {_b_crit_cell(r)} | "
            f"{r['ref_batch_size']} | "
            f"{g3(r['ref_batch_size'] / r['b_crit'])} | {r['ref_b_simple_seeds']} | "
            f"{cell('ref_b_simple')} | {cell('ref_b_noise')} | "
            f"{cell('ref_update_b_simple') if adaptive else '(= B_simple)'} | "
            f"{cell('ref_update_b_noise') if adaptive else '(= B_noise)'} | "
            f"{g3(r['ratio_ref_b_simple'])} | {g3(r['ratio_ref_b_noise'])} | "
            f"{g3(r['ratio_ref_update_b_noise'])} |")
    return "\n".join(lines)


def _seeds_cell(row: dict[str, Any], key: str) -> str:
    """"median (min–max) ×gsd" over seeds."""
    if not math.isfinite(row[key]):
        return "–"
    lo, hi = row[f"{key}_range"]
    return f"{g3(row[key])} ({g3(lo)}–{g3(hi)}) ×{g3(row[f'{key}_gsd'])}"


def _summary_lines(s: dict[str, Any], names: Sequence[tuple[str, str]]) -> list[str]:
    lines = []
    for name, label in names:
        v = s[name]
        if v["points"]:
            lines.append(
                f"- B_crit/{label}: geometric mean {v['geometric_mean_ratio']:.3g}, range "
                f"{v['ratio_range'][0]:.3g}–{v['ratio_range'][1]:.3g}; within a factor 2 of "
                f"B_crit in {v['within_2x']:.0%} of {v['points']} points, within a factor 10 in "
                f"{v['within_10x']:.0%}.")
    return lines


PREDICTION_SUFFIX = "_predict"  # <held-out sweep>_predict/prediction.json: its prediction


def prediction_path(held_out_dir: str) -> str:
    """D + PREDICTION_SUFFIX / prediction.json (not normpath: gs://b/D would be gs:/b/D)."""
    return paths.join(str(held_out_dir).rstrip("/") + PREDICTION_SUFFIX, "prediction.json")


def held_out_pairs(held_out_dirs: Sequence[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(prediction made before D's sweep ran, D's analysis.json) per held-out directory D."""
    pairs = []
    for d in held_out_dirs:
        pred_path = prediction_path(d)
        prediction, analysis = (records.read_json(pred_path),
                                records.read_json(paths.join(d, files.ANALYSIS_FILE)))
        if prediction is None or analysis is None:
            raise ValueError(f"held-out study {d}: needs {pred_path} (the prediction made "
                             f"before its sweep) and {files.ANALYSIS_FILE} (cbs-analyze)")
        pairs.append((prediction, analysis))
    return pairs


def write_report(sweep_dirs: Sequence[str], out_dir: str, *, bootstrap: int = 1000,
                 held_out: Sequence[str] = ()) -> str:
    """report.md, figures and calibration in out_dir (held_out: see `held_out_pairs`); its path."""
    tally = calibration.held_out(held_out_pairs(held_out)) if held_out else None
    rows = collect(sweep_dirs, bootstrap=bootstrap)
    if not rows:
        raise ValueError(f"none of {list(sweep_dirs)} has a target with a B_crit fit")
    with_protocol = [r for r in rows if math.isfinite(r["ref_b_simple"])]
    figure(rows, os.path.join(out_dir, files.PER_TRIAL_FIGURE_FILE), spread="over batch sizes",
           title="Per trial: B_crit against the noise scale of the best trial at each batch "
                 "size (median)")
    s = summary(rows)
    lines = ["# B_crit against the measured noise scale across studies", "",
             f"{s['points']} points from {len({r['study'] for r in rows})} studies; B_crit "
             f"spans {s['b_crit_decades']:.2g} decades. B_crit: the fit of each study's "
             "report, with its 95% interval (bootstrap-t over batch sizes, resampled jointly "
             "across targets).", ""]
    lines += ["## Under one noise protocol: the reference trajectory over seeds", ""]
    if with_protocol:
        figure(with_protocol, os.path.join(out_dir, files.FIGURE_FILE), PROTOCOL,
               spread="over seeds",
               title="B_crit against the noise scale of the reference trajectory (B ≤ "
                     "B_crit/4 at the lowest target; median over seeds)")
        ps = summary(with_protocol)
        studies = sorted({r["study"] for r in with_protocol})
        lacking = sorted({r["study"] for r in rows} - set(studies))
        lines += [f"{ps['points']} points from {len(studies)} studies ({', '.join(studies)}); "
                  "not yet measured under it: " + (", ".join(lacking) or "none") + ". "
                  "Protocol per study: " + "; ".join(sorted(
                      {f"{r['study']}: {r['ref_protocol']}" for r in with_protocol})) + ". "
                  "Cells: median over seeds (min–max) ×geometric SD over seeds; B_simple^P and "
                  "B_noise^P are those of the update Adam applies (P·g).", ""]
        lines += _summary_lines(ps, PROTOCOL)
        lines += ["", protocol_table(with_protocol), "",
                  f"![Under the protocol]({files.FIGURE_FILE})", ""]
    else:
        lines += ["No study has the protocol (`python -m experiments.reference`).", ""]
    lines += ["## Per trial (second view)", "",
              "Noise scale: median over the best trial at each batch size, with the min–max "
              "over batch sizes. Noise protocol per study: " + "; ".join(
                  sorted({f"{r['study']}: {r['protocol']}" for r in rows})) + ".", ""]
    lines += _summary_lines(s, PER_TRIAL)
    calib = calibration.build([fit.json_ready(r) for r in rows], held_out_tally=tally)
    lines += ["", table(rows), "", f"![B_crit against the noise scale, per trial]"
              f"({files.PER_TRIAL_FIGURE_FILE})", "",
              "## Predicting B_crit from one measurement", "",
              "From one run's noise scale at one batch size (each best trial's).", "",
              calibration.markdown(calib), ""]
    path = os.path.join(out_dir, files.REPORT_FILE)
    records.write_atomic(path, "\n".join(lines))
    records.write_json_atomic(os.path.join(out_dir, "compare.json"),
                              {"rows": [fit.json_ready(r) for r in rows], "summary": s,
                               "protocol_summary": summary(with_protocol)
                               if with_protocol else None})
    records.write_json_atomic(os.path.join(out_dir, CALIBRATION_FILE), calib)
    return path
