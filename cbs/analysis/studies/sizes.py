"""B_crit against the loss across model sizes (Kaplan et al. 2020, §5 and Fig. 10).

Kaplan et al. find B_crit(L) = B*·L^(−1/α_B) with one B* and α_B ≈ 0.21 for every size. Each
sweep directory is one size; every (size, target) with a B_crit fit is one point, log B_crit
with its study's joint-bootstrap covariance (`cbs.analysis.fits.joint`; block-diagonal across
studies). Three generalised least squares (GLS) fits of log B_crit:

- "depends on L alone": log B_crit = μ_L (one value per target, shared by the sizes) at the
  targets every size reached, χ² on (sizes − 1) × targets degrees of freedom;
- the joint power law log B_crit = log B* − (1/α_B)·log L, with a normal interval of the
  slope from the GLS covariance (α_B = −1/slope);
- the same with one B* per size (α_B shared), tested against the joint law by the χ²
  difference.

Every test's p is also calibrated as `cbs.analysis.fits.misfit` does, and the loss whose
removal lifts the law's calibrated p above 0.05 is named and both laws refitted without it
(docs/guides/across_studies.md, "Across model sizes").
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.linalg
import scipy.stats

from cbs.analysis.fits import fit, joint, misfit
from cbs.analysis.reports import plots, report, report_tables
from cbs.results import files, paths, records
from cbs.results.store import SweepStore

__all__ = ["analyze", "collect", "figure", "summary", "table", "write_report"]


def check_comparable(sweep_dirs: Sequence[str]) -> None:
    """Raises ValueError unless the studies share data, model family, metric and a target."""
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
    """One entry per study: B_crit per target, their log covariance, power law and `_noise`."""
    out = []
    for d in sweep_dirs:
        a = report.analyze(d, bootstrap=bootstrap, write=False)
        pl = a["power_law"]
        law = pl.get("misfit") or {}
        ok = [i for i, t in enumerate(a["targets"]) if t["fit"]["status"] == fit.OK]
        cov_targets = law.get("cov_targets") or []
        cov = np.asarray(law.get("log_b_crit_cov") or [], dtype=np.float64)
        if cov_targets != ok or cov.shape != (len(ok), len(ok)):
            raise ValueError(f"{d}: no bootstrap covariance of its B_crit fits (need a "
                             "bootstrap and at least one fitted target)")
        model = ((SweepStore(d).definition() or {}).get("config") or {}).get("model", {})
        size = {"name": model.get("name", "?"), "d_model": model.get("d_model"),
                "num_layers": model.get("num_layers")}
        noise = misfit.study_noise(a["tables"], [t["target"] for t in a["targets"]],
                                   a["fits"], n=2 * bootstrap, seed=joint.data_seed(a["tables"]))
        out.append({"study": os.path.basename(os.path.normpath(d)), "sweep_dir": d, **size,
                    "_noise": noise,
                    "label": f"D = {size['d_model']}" if size["d_model"] else d,
                    "targets": [a["targets"][i]["target"] for i in ok],
                    "b_crit": [a["targets"][i]["fit"]["b_crit"] for i in ok],
                    "b_crit_ci": [a["targets"][i]["fit"]["b_crit_ci"] for i in ok],
                    "unresolved": [report_tables.unresolved_text(a["targets"][i]["fit"])
                                   if report_tables.unresolved(a["targets"][i]["fit"]) else ""
                                   for i in ok],
                    "cov": cov.tolist(), "alpha_b": pl.get("alpha_b", math.nan),
                    "alpha_b_ci": pl.get("alpha_b_ci"), "b_star": pl.get("b_star", math.nan),
                    "power_law_p": (law.get("calibrated") or {}).get("p", law.get("misfit_p"))})
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
    return np.asarray(y), np.asarray(x), np.asarray(k), scipy.linalg.block_diag(*blocks)


def _p(q: float, dof: int) -> float:
    return float(scipy.stats.chi2.sf(q, dof)) if dof > 0 else math.nan


def analyze(studies: Sequence[dict[str, Any]], confidence: float = 0.95, *,
            calibrate: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The three GLS fits, JSON-ready, and with every study's noise their calibrated p."""
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
    out.update(_laws(studies, None, confidence))
    if calibrate and all(s.get("_noise") is not None for s in studies):
        _calibrate(studies, out, calibrate, seed, confidence)
    return out


def _laws(studies: Sequence[dict[str, Any]], targets: Sequence[float] | None,
          confidence: float) -> dict[str, Any]:
    """The joint power law and the law with one B* per size at `targets` (None: all)."""
    out: dict[str, Any] = {}
    y, x, k, C = _points(studies, targets)
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
        if len(set(k.tolist())) >= 2:
            Xk = np.concatenate([np.eye(len(studies))[k][:, sorted(set(k.tolist()))],
                                 x[:, None]], axis=1)
            bk, cov_k, qk = _gls(Xk, y, C)
            dq = q0 - qk
            half_k = z * math.sqrt(cov_k[-1, -1])
            out["per_size_b_star"] = {
                "b_star": [float(math.exp(v)) for v in bk[:-1]], "alpha_b": float(-1 / bk[-1]),
                "alpha_b_ci": fit.alpha_interval((bk[-1] - half_k, bk[-1] + half_k)),
                "chi2": qk, "dof": y.size - Xk.shape[1],
                "chi2_p": _p(qk, y.size - Xk.shape[1]),
                "delta_chi2": dq, "delta_dof": Xk.shape[1] - 2,
                "p_sizes_differ": _p(dq, Xk.shape[1] - 2)}
    return out


def _calibrate(studies: Sequence[dict[str, Any]], out: dict[str, Any], n: int, seed: int,
               confidence: float) -> None:
    """Adds the calibrated p-values to the fits in `out`."""
    noise = [s["_noise"] for s in studies]
    y = np.concatenate([z.log_b_crit for z in noise])
    loss = np.concatenate([z.losses for z in noise])
    k = np.concatenate([np.full(len(z.losses), i) for i, z in enumerate(noise)])
    C = scipy.linalg.block_diag(*(z.cov for z in noise))
    parts = np.cumsum([len(z.losses) for z in noise])[:-1]

    def gls_fit(X, m):  # the null values at every point (unchanged off the mask m)
        y0 = y.copy()
        y0[m] = X @ _gls(X, y[m], C[np.ix_(m, m)])[0]
        return np.split(y0, parts)

    def q(X, m, Y, CR):  # observed and simulated GLS statistics over the points in m
        return (float(joint.gls_q(X, y[m][None], C[np.ix_(m, m)])[0]),
                joint.gls_q(X, Y[:, m], CR[:, m][:, :, m]))

    common = out.get("common_targets") or []
    if "loss_alone" in out:
        m = np.isin(loss, common)
        X = (loss[m][:, None] == np.asarray(common)[None]).astype(float)
        Y, CR = misfit.pooled_draws(noise, gls_fit(X, m), n=n, seed=seed)
        qo, qs = q(X, m, Y, CR)
        out["loss_alone"].update(q_calibrated=qo, p_calibrated=misfit.calibrated_p(qo, qs))
        for entry in out["per_target"]:
            mt = loss == entry["target"]
            qo, qs = q(np.ones((int(mt.sum()), 1)), mt, Y, CR)
            entry.update(q_calibrated=qo, p_calibrated=misfit.calibrated_p(qo, qs))
    if "joint" not in out:
        return
    every = np.ones(y.size, bool)

    def designs(m):  # the joint law's and the per-size law's design matrices on points m
        Xj = np.stack([np.ones(int(m.sum())), np.log(loss[m])], axis=1)
        kk = np.unique(k[m])
        Xk = np.concatenate([(k[m][:, None] == kk[None]).astype(float), Xj[:, 1:]], axis=1)
        return Xj, (Xk if kk.size >= 2 else None)

    def laws_p(m, joint_null, size_null):
        """Calibrated p of the joint law, of "the sizes differ" (both under the joint law's
        simulations) and of the per-size law (under its own), on the points m."""
        Xj, Xk = designs(m)
        qj, qjs = q(Xj, m, *joint_null)
        if Xk is None:
            return misfit.calibrated_p(qj, qjs), math.nan, math.nan
        qk, qks = q(Xk, m, *joint_null)
        qk_own, qk_sims = q(Xk, m, *size_null)
        return (misfit.calibrated_p(qj, qjs), misfit.calibrated_p(qj - qk, qjs - qks),
                misfit.calibrated_p(qk_own, qk_sims))

    Xj, Xk = designs(every)
    joint_null = misfit.pooled_draws(noise, gls_fit(Xj, every), n=n, seed=seed + 1)
    size_null = (misfit.pooled_draws(noise, gls_fit(Xk, every), n=n, seed=seed + 2)
                 if Xk is not None else joint_null)
    pj, pd, pk = laws_p(every, joint_null, size_null)
    out["joint"].update(p_calibrated=pj, simulated=int(joint_null[0].shape[0]))
    if "per_size_b_star" in out:
        out["per_size_b_star"].update(p_sizes_differ_calibrated=pd, p_calibrated=pk)
    losses = sorted(set(loss.tolist()), reverse=True)
    if len(losses) < 4:
        return
    # the loss that breaks the law that lets sizes differ (the joint law with one study)
    law = 2 if Xk is not None else 0
    without = {lv: laws_p(loss != lv, joint_null, size_null) for lv in losses}
    out["p_calibrated_without"] = {str(lv): {"joint": p[0], "sizes_differ": p[1],
                                             "per_size": p[2]} for lv, p in without.items()}
    worst = max(without, key=lambda lv: without[lv][law])
    if (pk if law == 2 else pj) < 0.05 <= without[worst][law]:
        keep = [lv for lv in losses if lv != worst]
        refit = _laws(studies, keep, confidence)
        p_joint, p_differ, p_size = without[worst]
        refit["joint"]["p_calibrated"] = p_joint
        if "per_size_b_star" in refit:
            refit["per_size_b_star"].update(p_sizes_differ_calibrated=p_differ,
                                            p_calibrated=p_size)
        out["without_breaking"] = {"target": worst, "targets": keep, "sizes": out["sizes"],
                                   **refit}


_g = "{:.3g}".format


def _verdict(d: dict[str, Any], key: str = "p") -> str:
    """"rejected, calibrated p = … (χ² reading …)", or the χ² reading alone."""
    cal = d.get({"p": "p_calibrated", "chi2_p": "p_calibrated"}.get(key, key + "_calibrated"))
    p = cal if cal is not None else d[key]
    word = "not rejected" if p >= 0.05 else "rejected"
    if cal is None:
        return f"{word}, p = {d[key]:.2g} (χ² reading)"
    return f"{word}, calibrated p = {cal:.2g} (χ² reading {d[key]:.2g})"


def summary(result: dict[str, Any]) -> list[str]:
    """The sentences of the report, in numbers."""
    lines = []
    la = result.get("loss_alone")
    if la:
        lines.append(f"- B_crit depends on L alone (one value per target, shared by the sizes, "
                     f"at L = {', '.join(map(_g, result['common_targets']))}): "
                     f"{_verdict(la)}; χ² = {_g(la['chi2'])} on {la['dof']} degrees of "
                     "freedom.")
        for t in result["per_target"]:
            lines.append(f"  - L = {_g(t['target'])}: largest/smallest B_crit across sizes "
                         f"{t['ratio_max_min']:.2f}, χ² = {_g(t['chi2'])} on {t['dof']}, "
                         f"{_verdict(t).split(', ', 1)[1]}.")
    lines += _law_lines(result, "over all sizes")
    wb = result.get("without_breaking")
    if wb:
        law = "per_size_b_star" if "per_size_b_star" in wb else "joint"
        name = "the law with one B* per size" if law != "joint" else "the joint law"
        lines.append(f"- The points at L = {_g(wb['target'])} break {name} (calibrated p "
                     f"{result[law]['p_calibrated']:.2g} with them, "
                     f"{wb[law]['p_calibrated']:.2g} without); refitted without them "
                     f"(L = {', '.join(map(_g, wb['targets']))}):")
        lines += ["  " + line for line in _law_lines(wb, "over all sizes")]
    return lines


def _law_lines(result: dict[str, Any], where: str) -> list[str]:
    lines = []
    j = result.get("joint")
    if j:
        lines.append(f"- Joint power law {where}: α_B = {_g(j['alpha_b'])} "
                     f"({_g(j['alpha_b_ci'][0])}–{_g(j['alpha_b_ci'][1])}), B* = "
                     f"{_g(j['b_star'])} examples; misfit χ² = {_g(j['chi2'])} on {j['dof']}, "
                     f"{_verdict(j)} (Kaplan et al. 2020: α_B ≈ 0.21).")
    s = result.get("per_size_b_star")
    if s:
        ratios = ", ".join(f"{lab}: {_g(b)}" for lab, b in zip(result["sizes"], s["b_star"],
                                                               strict=True))
        ci = s.get("alpha_b_ci") or (math.nan, math.nan)
        lines.append(f"- One B* per size, α_B shared ({_g(s['alpha_b'])}, {_g(ci[0])}–"
                     f"{_g(ci[1])}): B* = {ratios}; "
                     f"the sizes differ with Δχ² = {_g(s['delta_chi2'])} on {s['delta_dof']}, "
                     f"{_verdict(s, 'p_sizes_differ')}; this law's own misfit χ² = "
                     f"{_g(s['chi2'])} on {s['dof']}, {_verdict(s, 'chi2_p')}.")
    return lines


def table(studies: Sequence[dict[str, Any]]) -> str:
    targets = sorted({t for s in studies for t in s["targets"]}, reverse=True)
    lines = ["| size | " + " | ".join(f"B_crit at L={_g(t)}" for t in targets)
             + " | α_B (own fit) | single power law p (calibrated) |",
             "|---" * (len(targets) + 3) + "|"]
    for s in studies:
        cells = []
        for t in targets:
            if t in s["targets"]:
                j = s["targets"].index(t)
                lo, hi = s["b_crit_ci"][j]
                flag = (s.get("unresolved") or [""] * len(s["targets"]))[j]
                cells.append(f"{_g(s['b_crit'][j])}, {flag}" if flag
                             else f"{_g(s['b_crit'][j])} ({_g(lo)}–{_g(hi)})")
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
    ax.set(xscale="log", yscale="log", xlabel="target loss L (lower: later in training)",
           ylabel="B_crit (examples)", title="Critical batch against the loss, by model size")
    plots.log_labels(ax.xaxis, np.concatenate([np.asarray(s["targets"], float) for s in studies]))
    plots.log_labels(ax.yaxis, np.concatenate([np.asarray(s["b_crit"], float) for s in studies]))
    ax.invert_xaxis()
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return plots.save_figure(fig, path, dpi=110)


def write_report(sweep_dirs: Sequence[str], out_dir: str, *, bootstrap: int = 1000) -> str:
    """report.md, sizes.json and the figure in out_dir; returns the report's path."""
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
             "covariance. Every test's p-value is calibrated by a studentized parametric "
             f"bootstrap ({result.get('joint', {}).get('simulated', 0)} simulated sets of "
             "studies under the tested law, each study with the noise of its own residuals; "
             "the χ² reading beside it).", "", *summary(result), "", table(studies), "",
             f"![B_crit against the loss by size]({files.SIZES_FIGURE_FILE})", ""]
    path = os.path.join(out_dir, files.REPORT_FILE)
    paths.makedirs(out_dir)
    records.write_atomic(path, "\n".join(lines))
    plain = [{k: v for k, v in s.items() if k != "_noise"} for s in studies]
    records.write_json_atomic(os.path.join(out_dir, files.SIZES_FILE),
                              fit.json_ready({"studies": plain, "result": result}))
    return path
