"""Predicting B_crit from one noise-scale measurement, calibrated on committed studies
(docs/guides/advice.md, "The calibration").

A point is one run's noise scale B_s at one batch size, measured at a target's crossing, with
the study's B_crit there (`cbs.analysis.studies.compare.collect`, `<scale>_by_batch_size`;
extrapolated B_crit give none); a prediction needs the ratio r = B_crit/B_s. The model is
one-way random effects on log r per optimizer family f ("sgd"; "adaptive": Adam and AdamW),
the groups j being a task's studies of one family,

    log r_jk = μ_f + a_j + e_jk,      a_j ~ N(0, τ²) (group j),  e_jk ~ N(0, σ²) (its points),

estimated from the group means m_j (n_j points each): μ̂_f = mean_j m_j, σ̂² the pooled
variance of the points about their group means, τ̂² = max(0, var_j(m_j) − σ̂²·mean_j(1/n_j))
(method of moments; σ̂², τ̂² pooled over the families). A new task's point is predicted as
log B_crit = log B_s + μ̂_f ± t_{q, ν}·√(τ̂² + σ̂² + var(μ̂_f)), var(μ̂_f) = (τ̂² + σ̂²·mean
1/n_j)/J_f, ν = J − F (groups less families, at least 1): `cbs.results.calibration.predict`.
`leave_one_task_out` checks the intervals on each task left out; `build` returns the file
`cbs-compare` writes (`cbs.results.calibration.CALIBRATION_FILE`) and the package ships.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbs.results.calibration import CALIBRATION_FILE, family, t_quantile

__all__ = [
    "UNIT", "VERSION", "build", "edges", "held_out", "leave_one_task_out", "markdown", "model",
]

VERSION = 2  # the format of the file; a change of model or fields is a new version
UNIT = "one run's noise scale at one batch size (its best learning rate), at the target"
RATE_FACTOR = 3.0  # a learning rate further than this factor from the task's best is untuned
SCALES = ("b_simple", "b_noise")


def _task(row: Mapping[str, Any]) -> str:
    return str(row.get("task") or row["study"])


def _points(rows: Sequence[Mapping[str, Any]], scale: str) -> list[tuple[str, str, float, str]]:
    """(group, family, log r, task) of every one-run value of `scale`: a row's
    `<scale>_by_batch_size` values, else its `scale`; none from an extrapolated B_crit."""
    out = []
    for r in rows:
        if r.get("extrapolated"):
            continue
        f = family(str(r["optimizer"]))
        b = float(r["b_crit"])
        values = list((r.get(f"{scale}_by_batch_size") or {}).values()) or [r.get(scale)]
        for v in values:
            s = float(v) if v is not None else math.nan
            if math.isfinite(b) and math.isfinite(s) and b > 0 and s > 0:
                out.append((f"{_task(r)} | {f}", f, math.log(b / s), _task(r)))
    return out


def model(rows: Sequence[Mapping[str, Any]], scale: str = "b_simple") -> dict[str, Any]:
    """The random-effects model of the rows' B_crit against `scale`."""
    return _fit([p[:3] for p in _points(rows, scale)])


def _fit(points: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
    """The random-effects model on (group, family, log r)."""
    studies: dict[str, list[float]] = {}
    fam: dict[str, str] = {}
    for study, f, v in points:
        studies.setdefault(study, []).append(v)
        fam[study] = f
    means = {s: float(np.mean(v)) for s, v in studies.items()}
    resid = [v - means[s] for s, vals in studies.items() for v in vals]
    n_points, n_studies = len(resid), len(studies)
    families = sorted(set(fam.values()))
    sigma2 = float(np.sum(np.square(resid)) / max(n_points - n_studies, 1))
    between: list[float] = []
    inv_n: list[float] = []
    per_family: dict[str, dict[str, float]] = {}
    for f in families:
        ms = [means[s] for s in studies if fam[s] == f]
        mu = float(np.mean(ms))
        between += [(m - mu) ** 2 for m in ms]
        inv_n += [1.0 / len(studies[s]) for s in studies if fam[s] == f]
        per_family[f] = {"mu": mu, "studies": len(ms)}
    dof = max(n_studies - len(families), 1)
    var_means = float(np.sum(between) / dof) if between else 0.0
    tau2 = max(0.0, var_means - sigma2 * float(np.mean(inv_n)))
    for fam_fit in per_family.values():
        fam_fit["var_mu"] = (tau2 + sigma2 * float(np.mean(inv_n))) / fam_fit["studies"]
    return {"families": per_family, "tau2": tau2, "sigma2": sigma2, "dof": dof,
            "studies": n_studies, "points": n_points}


def leave_one_task_out(rows: Sequence[Mapping[str, Any]], scale: str, *,
                       level: float = 0.8) -> dict[str, Any]:
    """Per task and over all, the share of its points inside the interval fitted without it."""
    pts = _points(rows, scale)
    per_task, inside, total = {}, 0, 0
    for task in sorted({p[3] for p in pts}):
        rest = [p[:3] for p in pts if p[3] != task]
        if not rest:  # no other task to fit (a comparison of one task)
            continue
        model = _fit(rest)
        hits = []
        for _, f, log_r, _ in (p for p in pts if p[3] == task):
            fam = model["families"].get(f)
            if fam is None:
                continue
            sd = math.sqrt(model["tau2"] + model["sigma2"] + fam["var_mu"])
            hits.append(abs(log_r - fam["mu"]) <= t_quantile(0.5 + level / 2, model["dof"]) * sd)
        if hits:
            per_task[task] = {"covered": int(sum(hits)), "points": len(hits)}
            inside += sum(hits)
            total += len(hits)
    return {"level": level, "coverage": inside / total if total else math.nan,
            "points": total, "tasks": len(per_task), "per_task": per_task}


def held_out(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> dict[str, Any]:
    """The tally of predictions committed before their sweeps: per pair (`cbs-advise
    --sweep_dir`'s `{"advice": [...]}`, the later sweep's analysis.json), whether the measured
    B_crit fell inside the predicted interval (extrapolated ones counted apart)."""
    inside = points = extrapolated = 0
    tasks, per_task = [], {}
    for k, (prediction, analysis) in enumerate(pairs):
        measured = {float(t["target"]): t for t in analysis["targets"]
                    if t["fit"]["status"] == "ok"}
        version = prediction["advice"][0].get("calibration", {}).get("version")
        row: dict[str, Any] = {"inside": 0, "points": 0, "calibration_version": str(version),
                               "ratios": []}
        for a in prediction["advice"]:
            t = measured.get(float(a["loss"]))
            if t is None:
                continue
            if t.get("b_crit_extrapolated"):
                extrapolated += 1
                continue
            lo, hi = a["interval"]
            row["inside"] += int(lo <= t["fit"]["b_crit"] <= hi)
            row["points"] += 1
            row["ratios"].append(t["fit"]["b_crit"] / a["b_crit"])  # measured / predicted
        inside, points = inside + row["inside"], points + row["points"]
        tasks.append(version)
        per_task[os.path.basename(str(analysis.get("sweep_dir", f"task_{k}")).rstrip("/"))] = row
    return {"inside": inside, "points": points, "extrapolated": extrapolated,
            "tasks": len(pairs), "calibration_versions": sorted(set(map(str, tasks))),
            "per_task": per_task}


def build(rows: Sequence[Mapping[str, Any]], *, level: float = 0.8,
          held_out_tally: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The calibration file: per noise scale the model and its coverage, the tally, the points."""
    models = {s: model(rows, s) | {"loto": leave_one_task_out(rows, s, level=level)}
              for s in SCALES if _points(rows, s)}
    keep = ("study", "task", "optimizer", "target", "b_crit", "b_crit_ci", "extrapolated",
            "b_simple", "b_noise", "b_simple_by_batch_size", "b_noise_by_batch_size",
            "best_learning_rate_by_batch_size", "protocol")
    return {"version": VERSION, "unit": UNIT,
            "studies": sorted({str(r["study"]) for r in rows}),
            "tasks": sorted({_task(r) for r in rows}), "level": level, "models": models,
            "held_out": dict(held_out_tally) if held_out_tally else None,
            "points": [{k: r[k] for k in keep if k in r} for r in rows]}


def edges(calib: Mapping[str, Any], *, optimizer: str, batch_size: float,
          task: str | None = None, learning_rate: float | None = None,
          loss: float | None = None, b_crit: float | None = None) -> list[str]:
    """Where a prediction lies outside what the calibration measured, in words (empty: inside):
    the task ("data/model"; None: unchecked), the learning rate against its sweeps' best
    (same family, nearest batch size; beyond RATE_FACTOR is untuned), the loss against the
    targets of the same data set, B_crit below one example."""
    out = []
    if b_crit is not None and math.isfinite(b_crit) and b_crit < 1:
        out.append(f"predicted B_crit {b_crit:.3g} is below one example: the noise scale is far "
                   "from any calibrated one")
    if task is None:
        return out
    points = calib.get("points", [])
    fam = family(optimizer)
    same = [p for p in points if p.get("task") == task and family(str(p["optimizer"])) == fam]
    data = task.split("/")[0]
    targets = [float(p["target"]) for p in points
               if str(p.get("task", "")).split("/")[0] == data]
    if not same:
        h = calib.get("held_out")
        known = sorted({str(p.get("task")) for p in points})
        record = (f": on tasks predicted before their sweeps such intervals held "
                  f"{h['inside']} of {h['points']} times" if h else "")
        out.append(f"task {task} with {fam} optimizers is not in the calibration "
                   f"({', '.join(known)}){record}")
    rates: dict[float, list[float]] = {}  # the best rates of the task's sweeps per B
    for p in same:
        for b, lr in (p.get("best_learning_rate_by_batch_size") or {}).items():
            rates.setdefault(float(b), []).append(float(lr))
    if rates and learning_rate is not None and learning_rate > 0 and batch_size > 0:
        at = min(rates, key=lambda b: abs(math.log(b / batch_size)))
        rate = float(np.median(rates[at]))
        factor = max(learning_rate / rate, rate / learning_rate)
        if factor > RATE_FACTOR:
            out.append(f"learning rate {learning_rate:.3g} is {factor:.3g}× "
                       f"{'below' if learning_rate < rate else 'above'} the best "
                       f"{rate:.3g} that this task's sweep found at B = {at:g}: the "
                       "calibration holds near a tuned rate, so B_crit at this one can "
                       "differ by several times (tune it: cbs-sweep)")
    if targets and loss is not None and math.isfinite(loss):
        lo, hi = min(targets), max(targets)
        if not lo / 1.25 <= loss <= hi * 1.25:
            out.append(f"loss {loss:.3g} is {'above' if loss > hi else 'below'} every target "
                       f"calibrated on {data} ({lo:g}–{hi:g}): B_crit there was not measured")
    return out


def markdown(calib: Mapping[str, Any]) -> str:
    """The calibration in words and a table per noise scale and optimizer family."""
    lines = [f"Calibration v{calib['version']} ({len(calib['studies'])} studies of "
             f"{len(calib['tasks'])} tasks; points: {calib['unit']}; {calib['level']:.0%} "
             f"prediction intervals for a new task; `{CALIBRATION_FILE}`):",
             "", "| noise scale | family | task groups | B_crit / noise scale | interval factor "
             "(×/÷) | leave-one-task-out coverage |", "|---|---|---|---|---|---|"]
    for scale, m in calib["models"].items():
        t = t_quantile(0.5 + calib["level"] / 2, m["dof"])
        for f, v in m["families"].items():
            sd = math.sqrt(m["tau2"] + m["sigma2"] + v["var_mu"])
            lines.append(f"| {scale} | {f} | {v['studies']} | {math.exp(v['mu']):.3g} | "
                         f"{math.exp(t * sd):.3g} | {m['loto']['coverage']:.0%} of "
                         f"{m['loto']['points']} points, {m['loto']['tasks']} tasks |")
    per = ["", "Leave-one-task-out, one-run points inside the interval fitted without their "
           "task: " + "; ".join(f"{scale}: " + ", ".join(
               f"{s} {v['covered']}/{v['points']}" for s, v in m["loto"]["per_task"].items())
               for scale, m in calib["models"].items()) + "."]
    h = calib.get("held_out")
    if h:
        per += ["", f"Held-out tasks, each predicted from one run before its sweep ran: "
                f"{h['inside']} of {h['points']} measured B_crit inside the 80 % interval "
                f"({h['tasks']} tasks; {h['extrapolated']} extrapolated B_crit not counted; "
                f"predicted with calibration v{', v'.join(h['calibration_versions'])})."]
        per += ["", "| held-out task | calibration | inside the 80 % interval | measured / "
                "predicted B_crit (min–max) |", "|---|---|---|---|"]
        per += [f"| {name} | v{r['calibration_version']} | {r['inside']} of {r['points']} | "
                f"{min(r['ratios']):.2g}–{max(r['ratios']):.2g} |"
                for name, r in h.get("per_task", {}).items() if r["ratios"]]
    return "\n".join(lines + per)
