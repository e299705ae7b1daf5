"""Predicting B_crit from one noise-scale measurement, calibrated on committed studies.

A study's points are (target L, fitted B_crit, measured noise scale B_s at L), with B_s either
B_simple or B_noise (`cbs.analysis.compare.collect`). The ratio r = B_crit/B_s is what a
prediction needs: B_crit ≈ r·B_s. Points of one study share its task, model and protocol,
so they are not independent draws: the model is one-way random effects on log r per
optimizer family f ("sgd"; "adaptive": Adam and AdamW),

    log r_jk = μ_f + a_j + e_jk,      a_j ~ N(0, τ²) (study j),  e_jk ~ N(0, σ²) (its targets),

estimated from the study means m_j (n_j points each): μ̂_f = mean_j m_j, σ̂² the pooled
variance of the points about their study means, τ̂² = max(0, var_j(m_j) − σ̂²·mean_j(1/n_j))
(method of moments; σ̂² and τ̂² pooled over the families, each family keeping its μ̂_f). A
new study's point is predicted as log B_crit = log B_s + μ̂_f, with the prediction interval
μ̂_f ± t_{q, ν}·√(τ̂² + σ̂² + var(μ̂_f)), var(μ̂_f) = (τ̂² + σ̂²·mean 1/n_j)/J_f, ν = J − F
(studies less families, at least 1) degrees of freedom.

`leave_one_study_out` refits without each study in turn and asks whether its points fall in
their intervals: the coverage a user can expect on a task the calibration never saw.

The calibration is data: `build` returns a JSON-ready dict (`CALIBRATION_FILE`, version,
studies, points and the fitted model per noise scale), which `cbs-compare` writes beside its
report and the package ships (`cbs/analysis/files/calibration.json`, `shipped`).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["CALIBRATION_FILE", "FAMILIES", "VERSION", "build", "family", "leave_one_study_out",
           "markdown", "model", "predict", "shipped", "tradeoff"]

CALIBRATION_FILE = "calibration.json"
VERSION = 1  # the format of the file; a change of model or fields is a new version
FAMILIES = {"sgd": "sgd", "momentum": "sgd", "adam": "adaptive", "adamw": "adaptive"}
SCALES = ("b_simple", "b_noise")


def family(optimizer: str) -> str:
    """The optimizer family of a config's `optim.name` ("sgd" or "adaptive")."""
    try:
        return FAMILIES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"no calibrated family for optimizer {optimizer!r}; known: "
                         f"{sorted(FAMILIES)}") from None


def _points(rows: Sequence[Mapping[str, Any]], scale: str) -> list[tuple[str, str, float]]:
    """(study, family, log r) of every row with a finite positive noise scale."""
    out = []
    for r in rows:
        b, s = float(r["b_crit"]), float(r.get(scale) or math.nan)
        if math.isfinite(b) and math.isfinite(s) and b > 0 and s > 0:
            out.append((str(r["study"]), family(str(r["optimizer"])), math.log(b / s)))
    return out


def model(rows: Sequence[Mapping[str, Any]], scale: str = "b_simple") -> dict[str, Any]:
    """The random-effects model (module docstring) of the rows' B_crit against `scale`."""
    return _fit(_points(rows, scale))


def _fit(points: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
    """The random-effects model of the module docstring on (study, family, log r)."""
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


def _t_quantile(p: float, dof: float) -> float:
    """Student's t quantile (`scipy.special.stdtrit`, what `scipy.stats.t.ppf` computes).
    Imported here, not with the module: every training run imports this module (its live
    advice), and scipy.stats, which imports scipy.optimize, would add about 2 s to the start of
    each; scipy.special alone costs about half of that."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, p))


def predict(model: Mapping[str, Any], noise_scale: float, optimizer: str, *,
            level: float = 0.8) -> dict[str, Any]:
    """Predicted B_crit for a measured noise scale (the model's scale) and optimizer: the
    point estimate and the `level` prediction interval, with the ratio it used."""
    f = model["families"].get(family(optimizer))
    if f is None:
        raise ValueError(f"the calibration has no {family(optimizer)!r} study; it covers "
                         f"{sorted(model['families'])}")
    sd = math.sqrt(model["tau2"] + model["sigma2"] + f["var_mu"])
    t = _t_quantile(0.5 + level / 2, model["dof"])
    centre = math.log(noise_scale) + f["mu"]
    return {"b_crit": math.exp(centre), "interval": (math.exp(centre - t * sd),
                                                     math.exp(centre + t * sd)),
            "level": level, "ratio": math.exp(f["mu"]), "log_sd": sd}


def leave_one_study_out(rows: Sequence[Mapping[str, Any]], scale: str, *,
                        level: float = 0.8) -> dict[str, Any]:
    """Per study, the share of its points inside the `level` interval of the model fitted
    without it; and over all points. A study whose family has no other study is skipped."""
    pts = _points(rows, scale)
    per_study, inside, total = {}, 0, 0
    by_study: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_study.setdefault(str(r["study"]), []).append(r)
    for study, held in by_study.items():
        rest = [p for p in pts if p[0] != study]
        if not rest:  # no other study to fit (a comparison of one study)
            continue
        model = _fit(rest)
        hits = []
        for r in held:
            s = float(r.get(scale) or math.nan)
            fam_ok = family(str(r["optimizer"])) in model["families"]
            if not (fam_ok and math.isfinite(s) and s > 0):
                continue
            lo, hi = predict(model, s, str(r["optimizer"]), level=level)["interval"]
            hits.append(lo <= float(r["b_crit"]) <= hi)
        if hits:
            per_study[study] = {"covered": int(sum(hits)), "points": len(hits)}
            inside += sum(hits)
            total += len(hits)
    return {"level": level, "coverage": inside / total if total else math.nan,
            "points": total, "per_study": per_study}


def build(rows: Sequence[Mapping[str, Any]], *, level: float = 0.8) -> dict[str, Any]:
    """The calibration file's content: the model per noise scale, its leave-one-study-out
    coverage, and the points it rests on."""
    models = {s: _fit(_points(rows, s)) | {"loso": leave_one_study_out(rows, s, level=level)}
              for s in SCALES if _points(rows, s)}
    return {"version": VERSION, "studies": sorted({str(r["study"]) for r in rows}), "level": level,
            "models": models,
            "points": [{k: r[k] for k in ("study", "task", "optimizer", "target", "b_crit",
                                          "b_crit_ci", "b_simple", "b_noise", "protocol")
                        if k in r} for r in rows]}


def markdown(calib: Mapping[str, Any]) -> str:
    """The calibration in words and a table: per noise scale and optimizer family, the ratio
    B_crit/B_s, the spread, the interval's width and the leave-one-study-out coverage."""
    lines = [f"Calibration v{calib['version']} ({len(calib['studies'])} studies; "
             f"{calib['level']:.0%} prediction intervals for a new study; `{CALIBRATION_FILE}`):",
             "", "| noise scale | family | studies | B_crit / noise scale | interval factor (×/÷) "
             "| leave-one-study-out coverage |", "|---|---|---|---|---|---|"]
    for scale, m in calib["models"].items():
        t = _t_quantile(0.5 + calib["level"] / 2, m["dof"])
        for f, v in m["families"].items():
            sd = math.sqrt(m["tau2"] + m["sigma2"] + v["var_mu"])
            lines.append(f"| {scale} | {f} | {v['studies']} | {math.exp(v['mu']):.3g} | "
                         f"{math.exp(t * sd):.3g} | {m['loso']['coverage']:.0%} of "
                         f"{m['loso']['points']} points |")
    per = ["", "Leave-one-study-out, points inside the interval fitted without their study: "
           + "; ".join(f"{scale}: " + ", ".join(
               f"{s} {v['covered']}/{v['points']}" for s, v in m["loso"]["per_study"].items())
               for scale, m in calib["models"].items()) + "."]
    return "\n".join(lines + per)


def shipped() -> dict[str, Any]:
    """The calibration file shipped with the package."""
    path = pathlib.Path(__file__).parent / "files" / CALIBRATION_FILE
    return json.loads(path.read_text())


def tradeoff(batch_size: float, b_crit: float, *, exchange: float | None = None
             ) -> dict[str, float]:
    """What batch size B costs against the critical batch (McCandlish et al. 2018, eqs. 2.7
    and 2.11): steps S/S_min = 1 + B_crit/B, examples E/E_min = 1 + B/B_crit; and, for an
    exchange rate λ (examples one would spend to save one step), the B minimising
    λ·S + E, √(λ·B_crit) (B_crit itself at λ = B_crit, where both overheads are 2×)."""
    out = {"steps_ratio": 1.0 + b_crit / batch_size, "examples_ratio": 1.0 + batch_size / b_crit}
    if exchange is not None:
        out["best_batch_size"] = math.sqrt(exchange * b_crit)
    return out
