"""The text of a sweep report: its markdown tables and the sentences around them, each from
the `analysis` dict of `cbs.analysis.reports.report.analyze` (or analysis.json).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cbs.analysis.fits import fit, noise_at_target
from cbs.results.store import target_key

__all__ = ["b_crit_cell", "held_out_table", "kaplan_table", "ramp_table", "seed_table",
           "summary_table", "to_wandb", "unresolved", "unresolved_text"]

_g = functools.partial(fit.g3, inf="∞")  # an interval's unbounded side is ∞


def unresolved(f: Mapping[str, Any]) -> bool:
    """Whether a fit's B_crit interval has no width at the 3 significant figures printed while
    its points scatter about the fit (log-step residuals above 1e-6): "101 (101–101)"."""
    lo, hi = (f.get("b_crit_ci") or (None, None))[:2]
    scatter = f.get("residual_std")
    return (f.get("status") == fit.OK and lo is not None and hi is not None
            and math.isfinite(float(lo)) and math.isfinite(float(hi)) and _g(lo) == _g(hi)
            and not (scatter is not None and float(scatter) <= 1e-6))


def unresolved_text(f: Mapping[str, Any]) -> str:
    """The flag of an `unresolved` interval: "unresolved (k batch sizes)"."""
    return f"unresolved ({f['n_batch_sizes']} batch sizes)"


def b_crit_cell(f: Mapping[str, Any]) -> str:
    """"B_crit (lo–hi)", "B_crit, unresolved (k batch sizes)" or "B_crit" (no interval)."""
    if unresolved(f):
        return f"{_g(f['b_crit'])}, {unresolved_text(f)}"
    ci = f.get("b_crit_ci")
    return _g(f["b_crit"]) + (f" ({_ci(ci)})" if ci and ci[0] is not None else "")


def summary_table(analysis: dict[str, Any]) -> str:
    """Markdown: B_crit per target with its interval beside the measured noise scales."""
    ref = analysis.get("reference_noise")
    lines = ["| target L | B_crit (95% CI) | S_min | E_min | B_simple at L, median (min–max) "
             "| B_noise at L, median (min–max) | B_simple / B_noise, reference run "
             "| batch sizes fitted | status |", "|---|---|---|---|---|---|---|---|---|"]
    for t in analysis["targets"]:
        f = t["fit"]
        status = f["status"]
        if f["status"] == fit.OK:
            mark = " (extrapolated)" if t.get("b_crit_extrapolated") else ""
            row = [b_crit_cell(f) + mark, _g(f["s_min"]), _g(f["e_min"])]
            if t.get("incomplete_batch_sizes"):
                status += ", incomplete grid"
        else:
            row = ["–", "–", "–"]
        noise = [noise_at_target.spread_cell(t, "b_simple"),
                 noise_at_target.spread_cell(t, "b_noise"),
                 noise_at_target.reference_cell(ref, t["target"])]
        lines.append(f"| {t['target']:g} | " + " | ".join(row + noise)
                     + f" | {len(t['batch_sizes'])} | {status} |")
    return "\n".join(lines)


def kaplan_table(analysis: dict[str, Any]) -> str:
    """Markdown: B_crit(L) in examples and in tokens, and the power law beside Kaplan et al.
    2020 (their loss in nats per BPE token of WebText2: B* is not comparable as is)."""
    tokens = analysis.get("tokens_per_example") or 1
    lines = ["| target L | B_crit (sequences) | B_crit (tokens) | 95% CI (tokens) |",
             "|---|---|---|---|"]
    for t in analysis["targets"]:
        f = t["fit"]
        if f["status"] != fit.OK:
            lines.append(f"| {t['target']:g} | – | – | – |")
            continue
        ci_pair: Any = f["b_crit_ci"] or (None, None)
        lo, hi = ci_pair
        ci = ("–" if lo is None else unresolved_text(f) if unresolved(f)
              else f"{_g(lo * tokens)}–{_g(hi * tokens)}")
        mark = " (extrapolated)" if t.get("b_crit_extrapolated") else ""
        lines.append(f"| {t['target']:g} | {_g(f['b_crit'])}{mark} | "
                     f"{_g(f['b_crit'] * tokens)} | {ci} |")
    pl = analysis["power_law"]
    if pl["status"] == fit.OK:
        lines += ["", "| | this sweep | Kaplan et al. 2020 |", "|---|---|---|",
                  f"| α_B | {_g(pl['alpha_b'])} ({_ci(pl['alpha_b_ci'])}) | ≈ 0.21 |",
                  f"| B* (tokens) | {_g(pl['b_star'] * tokens)} | ≈ 2·10⁸ |"]
    return "\n".join(lines)


def seed_table(analysis: dict[str, Any]) -> str:
    """Markdown: B_crit of all seeds with its interval beside each seed's, and the S spread."""
    rows = analysis.get("seeds") or []
    seeds = list(rows[0]["b_crit_per_seed"]) if rows else []
    lines = ["| target L | B_crit (all seeds) | bootstrap 95% CI | " + " | ".join(
        f"B_crit (seed {sd})" for sd in seeds) + " | range over seeds (max/min) | "
        "S spread between seeds, median (max) |",
        "|---|---|---|" + "---|" * len(seeds) + "---|---|"]
    by_target = {t["target"]: t for t in analysis["targets"]}
    for row in rows:
        f = by_target[row["target"]]["fit"]
        ok = f["status"] == fit.OK
        all_seeds = _g(f["b_crit"]) if ok else "–"
        ci = "–" if not (ok and f.get("b_crit_ci")) else (
            unresolved_text(f) if unresolved(f) else _ci(f["b_crit_ci"]))
        values = list(row["b_crit_per_seed"].values())
        per = " | ".join(_g(v) if v is not None else "–" for v in values)
        got = [v for v in values if v is not None]
        spread = (f"{_g(min(got))}–{_g(max(got))} ({max(got) / min(got):.2f}×)"
                  if len(got) == len(values) and got else "–")
        med, mx = row["steps_spread_median"], row["steps_spread_max"]
        s_spread = f"{med:.0%} ({mx:.0%})" if med is not None else "–"
        lines.append(f"| {row['target']:g} | {all_seeds} | {ci} | {per} | {spread} | "
                     f"{s_spread} |")
    return "\n".join(lines)


def held_out_table(analysis: dict[str, Any]) -> str:
    """Markdown: per target, the held-out and in-sample B_crit (`cbs.analysis.fits.held_out`)."""
    rows = analysis.get("held_out") or []
    lines = ["| target L | rates from seed | S on seeds | B_crit, held out (95% CI) | "
             "B_crit, in sample (95% CI) | held-out / in-sample S, median over B | "
             "B left out |", "|---|---|---|---|---|---|---|"]
    for t in rows:
        cells = [b_crit_cell(f) if f["status"] == fit.OK else "–"
                 for f in (t["fit"], t["fit_in_sample"])]
        ratio = f"{t['median_ratio']:.2f}" if t["median_ratio"] is not None else "–"
        left = ", ".join(f"{r['batch_size']:g} ({r['left_out']})" for r in t["rows"]
                         if "left_out" in r) or "none"
        lines.append(f"| {t['target']:g} | {t['select_on_seed']} | "
                     f"{', '.join(map(str, t['measured_on_seeds']))} | {cells[0]} | "
                     f"{cells[1]} | {ratio} | {left} |")
    return "\n".join(lines)


def ramp_table(ramps: Sequence[dict[str, Any]], analysis: dict[str, Any]) -> str:
    """Steps S and examples E to each target per ramp run, and E/E_frontier(S), E_frontier(S) =
    E_min·S/(S − S_min) (< 1: fewer examples than any fixed batch at as many steps)."""
    targets = analysis["targets"]
    head = "| run | " + " | ".join(f"S, E (E/E_frontier) to L={t['target']:g}"
                                   for t in targets) + " |"
    lines = [head, "|---|" + "---|" * len(targets)]
    for r in ramps:
        cells = []
        for t in targets:
            key = target_key(t["target"])
            s, e = r["steps_to_target"].get(key), r["examples_to_target"].get(key)
            cells.append("not reached" if s is None else f"{s:.0f}, {e:.3g}{_vs_frontier(t, s, e)}")
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def interval_text(analysis: dict[str, Any]) -> str:
    """The sentence naming how the report's intervals were formed."""
    fits = [t["fit"] for t in analysis["targets"] if t["fit"]["status"] == fit.OK]
    if not fits or fits[0].get("b_crit_ci") is None:
        return "No intervals (no bootstrap)."
    method = fits[0].get("interval", "residual bootstrap-t")
    return f"Intervals are 95%: {method}."


def power_law_lines(analysis: dict[str, Any]) -> list[str]:
    """The power law B_crit(L), its interval and the check that one power law fits."""
    pl = analysis["power_law"]
    if pl["status"] != fit.OK:
        return [f"Power law B_crit(L): {pl['status']} (needs ≥ 3 targets with a fit).", ""]
    lines = [f"Power law (Kaplan et al. 2020): B_crit(L) = {_g(pl['b_star'])} / "
             f"L^(1/{_g(pl['alpha_b'])}) (least squares in log B_crit on log L), α_B 95% "
             f"interval {_ci(pl['alpha_b_ci'])} ({pl.get('interval', 'residual bootstrap-t')})."]
    m = pl.get("misfit")
    if m and m.get("misfit_p") is not None:
        cis = m["local_slope_cis"]
        targets = [t["target"] for t in analysis["targets"] if t["fit"]["status"] == fit.OK]
        local = ", ".join(
            f"{a:g}→{b:g}: α {_g(-1 / s)} ({_alpha_ci(ci)})"
            for a, b, s, ci in zip(targets, targets[1:], m["local_slopes"], cis, strict=False))
        lines += ["", f"Misfit check: a single power law over L = {max(targets):g} → "
                  f"{min(targets):g} {_misfit_verdict(m)} Local α_B between adjacent targets "
                  f"(percentile interval): {local}."]
    return lines + [""]


def _misfit_verdict(m: dict[str, Any]) -> str:
    """The misfit test's sentence, and the law without a target that breaks it."""
    chi2 = (f"generalised least squares on the bootstrap covariance of the targets' log "
            f"B_crit, χ² = {m['misfit_q']:.3g} on {m['misfit_dof']} degrees of freedom, "
            f"p = {m['misfit_p']:.2g}")
    c = m.get("calibrated") or {}
    if c.get("p") is None:
        verdict = "is supported" if m["power_law_supported"] else "is NOT supported"
        return f"{verdict} ({chi2})."
    verdict = "is supported" if c["p"] >= 0.05 else "is NOT supported"
    text = (f"{verdict} at 5 %: calibrated p = {c['p']:.2g} (Q of the law's generalised least "
            f"squares against {c['n']} studies simulated under the fitted law with this "
            f"study's noise, `cbs.analysis.fits.misfit`; uncalibrated: {chi2}).")
    w = c.get("without_breaking")
    if w:
        lo, hi = (w["alpha_b_ci"] or [None, None])[:2]
        ci = "interval –" if lo is None or hi is None else f"95% interval {_g(lo)}–{_g(hi)}"
        text += (f" The target that breaks it is L = {w['target']:g}: without it calibrated "
                 f"p = {w['p']:.2g}, and α_B = {_g(w['alpha_b'])} ({ci}) on the other targets.")
    return text


def missing_text(analysis: dict[str, Any]) -> str:
    """How many trials of the grid have no record, per batch size."""
    per_b = ", ".join(f"B={b}: {n}" for b, n in analysis["missing_per_batch_size"].items())
    return (f"{analysis['num_missing']} of at least {analysis['num_expected']} trials have no "
            f"record ({per_b})")


def grid_notes(analysis: dict[str, Any]) -> list[str]:
    """Per target, the batch sizes whose best learning rate is still at an edge or capped."""
    out = []
    for t in analysis["targets"]:
        edge, capped = t["edge_batch_sizes"], t.get("capped_batch_sizes", [])
        if not edge and not capped:
            out.append(f"L={t['target']:g}: the best learning rate is inside the grid at every "
                       "batch size that reached the target.")
            continue
        if edge:
            out.append(f"L={t['target']:g}: best learning rate still at an edge of the grid at "
                       f"B = {_bs(edge)} (S there is an upper bound).")
        if capped:
            out.append(f"L={t['target']:g}: best learning rate at the max_lr/min_lr cap at "
                       f"B = {_bs(capped)}.")
    return out


def notes(analysis: dict[str, Any]) -> list[str]:
    """Per target: batch sizes that never reached it, an incomplete grid, fit warnings."""
    notes = []
    for t in analysis["targets"]:
        if t["missing_batch_sizes"]:
            notes.append(f"L={t['target']:g}: no learning rate reached the target at B = "
                         f"{', '.join(f'{b:g}' for b in t['missing_batch_sizes'])} "
                         "(excluded from the fit).")
        if t.get("incomplete_batch_sizes"):
            notes.append(f"L={t['target']:g}: fit from an incomplete grid (trials missing at "
                         f"B = {_bs(t['incomplete_batch_sizes'])}).")
        f = t["fit"]
        if unresolved(f):
            notes.append(f"L={t['target']:g}: B_crit unresolved: its bootstrap interval from "
                         f"{f['n_batch_sizes']} batch sizes has no width ({_ci(f['b_crit_ci'])})"
                         "; sweep more batch sizes to resolve it.")
        notes += [f"L={t['target']:g}: {w}" for w in f.get("warnings", [])]
    return notes


def counts_text(counts: dict[str, int]) -> str:
    """"3 budget, 12 done" from {"done": 12, "budget": 3}."""
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def _vs_frontier(target: dict[str, Any], steps: float, examples: float) -> str:
    f = target.get("fit")
    if not f or f.get("status") != fit.OK or not steps > f["s_min"]:
        return ""
    return f" ({examples / (f['e_min'] * steps / (steps - f['s_min'])):.2f})"


def _alpha_ci(slope_ci) -> str:
    """α's interval from a slope interval; an unbounded end (slope interval reaching 0) is ∞."""
    if not slope_ci or slope_ci[0] is None or slope_ci[1] is None:
        return "–"
    lo, hi = fit.alpha_interval(tuple(slope_ci))
    return f"{_g(lo)}–{_g(hi)}"


def _ci(ci) -> str:
    return "–" if not ci else f"{_g(ci[0])}–{_g(ci[1])}"


def _bs(values: Sequence[float]) -> str:
    return ", ".join(f"{b:g}" for b in values)


def to_wandb(analysis: dict[str, Any], project: str, *, group: str) -> None:
    """The sweep's B_crit table as the W&B run "<group> summary" (`b_crit/L=<target>`)."""
    from cbs.results.writers import WandbWriter

    columns = ["target", "b_crit", "b_crit_lo", "b_crit_hi", "extrapolated", "s_min", "e_min",
               "b_simple", "b_noise", "status"]
    rows, summary = [], {}
    for t in analysis["targets"]:
        f = t["fit"]
        lo, hi = f.get("b_crit_ci") or (None, None)
        rows.append([float(t["target"]), f.get("b_crit"), lo, hi,
                     bool(t.get("b_crit_extrapolated")), f.get("s_min"), f.get("e_min"),
                     t.get("measured_b_simple"), t.get("measured_b_noise"), f["status"]])
        if f["status"] == fit.OK:
            summary[f"b_crit/L={t['target']:g}"] = f["b_crit"]
    writer = WandbWriter(project, name=f"{group} summary", group=group)
    try:
        writer.write_table("sweep/b_crit", columns, rows, summary)
    finally:
        writer.close()
