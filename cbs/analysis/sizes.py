"""B_crit against the loss across model sizes (Kaplan et al. 2020, §5 and Fig. 10).

Kaplan et al. find that the critical batch depends on the loss reached, not on the model's
size: B_crit(L) = B*·L^(−1/α_B) with one B* and α_B ≈ 0.21 for every size. Here each sweep
directory is one size trained on the same data with the same protocol; every (size, target)
with a B_crit fit is one point, log B_crit with the covariance across its study's targets
from that study's joint batch-size bootstrap (`cbs.analysis.joint`; studies are
independent, so the covariance of all points is block-diagonal). Three generalised least
squares (GLS) fits of log B_crit answer:

- "depends on L alone", without assuming a power law: log B_crit = μ_L (one free value per
  target, shared by the sizes) at the targets every size reached; its χ² on (sizes − 1) ×
  targets degrees of freedom tests whether the sizes differ at equal loss;
- the joint power law log B_crit = log B* − (1/α_B)·log L over every point, with a normal
  interval of the slope from the GLS covariance (α_B = −1/slope);
- the same with one B* per size (the sizes' α_B shared): its B* ratios say how far apart
  the sizes sit, and the χ² difference from the joint law tests them.

Intervals per point are each study's own (the report's bootstrap-t). Needs no model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats

from cbs.analysis import fit, report
from cbs.results import files, records
from cbs.results.store import SweepStore

__all__ = ["analyze", "collect", "figure", "study_size", "summary", "table", "write_report"]


def study_size(sweep_dir: str) -> dict[str, Any]:
    """The model of a sweep directory: its name, width, depth and parameter count when the
    definition has them."""
    model = ((SweepStore(sweep_dir).definition() or {}).get("config") or {}).get("model", {})
    return {"name": model.get("name", "?"), "d_model": model.get("d_model"),
            "num_layers": model.get("num_layers")}


def check_comparable(sweep_dirs: Sequence[str]) -> None:
    """Raises ValueError (one line) unless the studies are sizes of one experiment: the same
    data (dataset and options), model family and target metric, and at least one target in
    common (each study's sweep.json)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    for d in sweep_dirs:
        config = (SweepStore(d).definition() or {}).get("config") or {}
        sweep = config.get("sweep") or {}
        seen.append((d, {"data": config.get("data"),
                         "model family": (config.get("model") or {}).get("name"),
                         "target metric": sweep.get("target_metric"),
                         "targets": set(sweep.get("targets") or ())}))
    first_dir, first = seen[0]
    for d, this in seen[1:]:
        for key in ("data", "model family", "target metric"):
            if this[key] != first[key]:
                raise ValueError(f"--sizes compares model sizes of one experiment, but {d} "
                                 f"has {key} {this[key]!r} and {first_dir} {first[key]!r}")
    if not set.intersection(*(this["targets"] for _, this in seen)):
        raise ValueError("--sizes needs a target every study swept; these have "
                         + "; ".join(f"{d}: {sorted(t['targets'])}" for d, t in seen))


def collect(sweep_dirs: Sequence[str], *, bootstrap: int = 1000) -> list[dict[str, Any]]:
    """One entry per study: size, targets, B_crit and interval per target, the covariance of
    log B_crit over its fitted targets, and its own power law."""
    out = []
    for d in sweep_dirs:
        a = report.analyze(d, bootstrap=bootstrap, write=False)
        pl = a["power_law"]
        misfit = pl.get("misfit") or {}
        ok = [i for i, t in enumerate(a["targets"]) if t["fit"]["status"] == fit.OK]
        cov_targets = misfit.get("cov_targets") or []
        cov = np.asarray(misfit.get("log_b_crit_cov") or [], dtype=np.float64)
        if cov_targets != ok or cov.shape != (len(ok), len(ok)):
            raise ValueError(f"{d}: no bootstrap covariance of its B_crit fits (need a "
                             "bootstrap and at least one fitted target)")
        size = study_size(d)
        out.append({"study": os.path.basename(os.path.normpath(d)), "sweep_dir": d, **size,
                    "label": f"D = {size['d_model']}" if size["d_model"] else d,
                    "targets": [a["targets"][i]["target"] for i in ok],
                    "b_crit": [a["targets"][i]["fit"]["b_crit"] for i in ok],
                    "b_crit_ci": [a["targets"][i]["fit"]["b_crit_ci"] for i in ok],
                    "cov": cov.tolist(), "alpha_b": pl.get("alpha_b", math.nan),
                    "alpha_b_ci": pl.get("alpha_b_ci"), "b_star": pl.get("b_star", math.nan),
                    "power_law_p": misfit.get("misfit_p")})
    return out


def _gls(X: np.ndarray, y: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """β, cov(β) and the χ² of the GLS fit of y = Xβ with covariance C."""
    Ci = np.linalg.pinv(C)
    cov_beta = np.linalg.pinv(X.T @ Ci @ X)
    beta = cov_beta @ X.T @ Ci @ y
    r = y - X @ beta
    return beta, cov_beta, float(r @ Ci @ r)


def _points(studies: Sequence[dict[str, Any]], targets: Sequence[float] | None = None):
    """Stacked log B_crit, log L, study index and the block-diagonal covariance."""
    y, x, k, blocks = [], [], [], []
    for i, s in enumerate(studies):
        keep = [j for j, t in enumerate(s["targets"]) if targets is None or t in targets]
        y += [math.log(s["b_crit"][j]) for j in keep]
        x += [math.log(s["targets"][j]) for j in keep]
        k += [i] * len(keep)
        blocks.append(np.asarray(s["cov"])[np.ix_(keep, keep)])
    n = len(y)
    C = np.zeros((n, n))
    at = 0
    for b in blocks:
        C[at:at + len(b), at:at + len(b)] = b
        at += len(b)
    return np.asarray(y), np.asarray(x), np.asarray(k), C


def _p(q: float, dof: int) -> float:
    return float(scipy.stats.chi2.sf(q, dof)) if dof > 0 else math.nan


def analyze(studies: Sequence[dict[str, Any]], confidence: float = 0.95) -> dict[str, Any]:
    """The three GLS fits of the module docstring, JSON-ready."""
    common = sorted(set.intersection(*(set(s["targets"]) for s in studies)), reverse=True)
    out: dict[str, Any] = {"common_targets": common, "sizes": [s["label"] for s in studies]}
    if len(studies) >= 2 and common:
        y, _, _, C = _points(studies, common)
        t_index = np.concatenate([[common.index(t) for t in s["targets"] if t in common]
                                  for s in studies])
        X = np.eye(len(common))[t_index]
        _, _, q = _gls(X, y, C)
        dof = y.size - len(common)
        out["loss_alone"] = {"chi2": q, "dof": dof, "p": _p(q, dof)}
        # per target: the sizes' spread against their own intervals (independent studies)
        out["per_target"] = []
        for t in common:
            yt, _, _, Ct = _points(studies, [t])
            _, _, qt = _gls(np.ones((yt.size, 1)), yt, Ct)
            out["per_target"].append({"target": t, "chi2": qt, "dof": yt.size - 1,
                                      "p": _p(qt, yt.size - 1),
                                      "ratio_max_min": float(np.exp(yt.max() - yt.min()))})
    y, x, k, C = _points(studies)
    if y.size >= 3:
        X = np.stack([np.ones_like(x), x], axis=1)
        beta, cov, q0 = _gls(X, y, C)
        z = scipy.stats.norm.ppf(0.5 + confidence / 2)
        half = z * math.sqrt(cov[1, 1])
        slope_ci = (beta[1] - half, beta[1] + half)
        out["joint"] = {"slope": float(beta[1]), "slope_ci": slope_ci,
                        "alpha_b": float(-1 / beta[1]),
                        "alpha_b_ci": fit.alpha_interval(slope_ci),
                        "b_star": float(math.exp(beta[0])), "chi2": q0, "dof": y.size - 2,
                        "p": _p(q0, y.size - 2)}
        if len(studies) >= 2:
            Xk = np.concatenate([np.eye(len(studies))[k], x[:, None]], axis=1)
            bk, _, qk = _gls(Xk, y, C)
            dq = q0 - qk
            out["per_size_b_star"] = {
                "b_star": [float(math.exp(v)) for v in bk[:-1]], "alpha_b": float(-1 / bk[-1]),
                "chi2": qk, "dof": y.size - len(studies) - 1,
                "delta_chi2": dq, "delta_dof": len(studies) - 1,
                "p_sizes_differ": _p(dq, len(studies) - 1)}
    return out


def _g(x: float) -> str:
    return f"{x:.3g}"


def summary(result: dict[str, Any]) -> list[str]:
    """The sentences of the report, in numbers."""
    lines = []
    la = result.get("loss_alone")
    if la:
        verdict = "not rejected" if la["p"] >= 0.05 else "rejected"
        lines.append(f"- B_crit depends on L alone (one value per target, shared by the sizes, "
                     f"at L = {', '.join(map(_g, result['common_targets']))}): {verdict}, "
                     f"χ² = {_g(la['chi2'])} on {la['dof']} degrees of freedom, p = "
                     f"{la['p']:.2g}.")
        for t in result["per_target"]:
            lines.append(f"  - L = {_g(t['target'])}: largest/smallest B_crit across sizes "
                         f"{t['ratio_max_min']:.2f}, χ² = {_g(t['chi2'])} on {t['dof']}, p = "
                         f"{t['p']:.2g}.")
    j = result.get("joint")
    if j:
        lines.append(f"- Joint power law over all sizes: α_B = {_g(j['alpha_b'])} "
                     f"({_g(j['alpha_b_ci'][0])}–{_g(j['alpha_b_ci'][1])}), B* = "
                     f"{_g(j['b_star'])} examples; misfit χ² = {_g(j['chi2'])} on {j['dof']}, "
                     f"p = {j['p']:.2g} (Kaplan et al. 2020: α_B ≈ 0.21).")
    s = result.get("per_size_b_star")
    if s:
        ratios = ", ".join(f"{lab}: {_g(b)}" for lab, b in zip(result["sizes"], s["b_star"],
                                                                strict=True))
        lines.append(f"- One B* per size, α_B shared ({_g(s['alpha_b'])}): B* = {ratios}; "
                     f"the sizes differ with Δχ² = {_g(s['delta_chi2'])} on {s['delta_dof']}, "
                     f"p = {s['p_sizes_differ']:.2g}.")
    return lines


def table(studies: Sequence[dict[str, Any]]) -> str:
    targets = sorted({t for s in studies for t in s["targets"]}, reverse=True)
    lines = ["| size | " + " | ".join(f"B_crit at L={_g(t)}" for t in targets)
             + " | α_B (own fit) | single power law p |", "|---" * (len(targets) + 3) + "|"]
    for s in studies:
        cells = []
        for t in targets:
            if t in s["targets"]:
                j = s["targets"].index(t)
                lo, hi = s["b_crit_ci"][j]
                cells.append(f"{_g(s['b_crit'][j])} ({_g(lo)}–{_g(hi)})")
            else:
                cells.append("–")
        ci = s.get("alpha_b_ci") or (math.nan, math.nan)
        p = s.get("power_law_p")
        lines.append(f"| {s['label']} | " + " | ".join(cells) + f" | {_g(s['alpha_b'])} "
                     f"({_g(ci[0])}–{_g(ci[1])}) | {'–' if p is None else f'{p:.2g}'} |")
    return "\n".join(lines)


def figure(studies: Sequence[dict[str, Any]], result: dict[str, Any], path: str) -> str:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    colours = colormaps["viridis"](np.linspace(0.1, 0.85, len(studies)))
    for s, c in zip(studies, colours, strict=True):
        b = np.asarray(s["b_crit"])
        ci = np.asarray(s["b_crit_ci"])
        ax.errorbar(s["targets"], b, yerr=np.abs(ci.T - b), fmt="o-", color=c, capsize=3,
                    lw=1, label=s["label"])
    j = result.get("joint")
    if j:
        loss = np.geomspace(min(min(s["targets"]) for s in studies),
                            max(max(s["targets"]) for s in studies), 50)
        ax.plot(loss, j["b_star"] * loss ** (-1 / j["alpha_b"]), "k--", lw=1,
                label=f"joint fit, α_B = {j['alpha_b']:.2g}")
    from cbs.analysis import plots

    ax.set_xscale("log")
    ax.set_yscale("log")
    plots.log_labels(ax.xaxis, np.concatenate([np.asarray(s["targets"], float) for s in studies]))
    plots.log_labels(ax.yaxis, np.concatenate([np.asarray(s["b_crit"], float) for s in studies]))
    ax.invert_xaxis()
    ax.set_xlabel("target loss L (lower: later in training)")
    ax.set_ylabel("B_crit (examples)")
    ax.set_title("Critical batch against the loss, by model size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_report(sweep_dirs: Sequence[str], out_dir: str, *, bootstrap: int = 1000) -> str:
    """report.md, sizes.json and the figure in out_dir; returns the report's path. Studies
    that are not sizes of one experiment are refused first (`check_comparable`)."""
    check_comparable(sweep_dirs)
    studies = collect(sweep_dirs, bootstrap=bootstrap)
    result = analyze(studies)
    figure(studies, result, os.path.join(out_dir, files.SIZES_FIGURE_FILE))
    names = ", ".join(f"{s['label']}: `{s['sweep_dir']}`" for s in studies)
    lines = ["# B_crit against the loss across model sizes", "",
             f"{len(studies)} studies ({names}), "
             "each fitted by its own report (B_crit with a 95% bootstrap-t interval over batch "
             "sizes, resampled jointly across targets). Pooled fits: generalised least squares "
             "in log B_crit with each study's bootstrap covariance across its targets "
             "(studies independent); the power law's interval is normal from the GLS "
             "covariance.", "", *summary(result), "", table(studies), "",
             f"![B_crit against the loss by size]({files.SIZES_FIGURE_FILE})", ""]
    path = os.path.join(out_dir, files.REPORT_FILE)
    os.makedirs(out_dir, exist_ok=True)
    records.write_atomic(path, "\n".join(lines))
    records.write_json_atomic(os.path.join(out_dir, files.SIZES_FILE),
                              fit.json_ready({"studies": studies, "result": result}))
    return path
