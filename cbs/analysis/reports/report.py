"""Analysis of a sweep directory: per-target fits, the B_crit(L) power law, figures, a report.

Reads only the files a sweep writes (`sweep.json`, `trials.jsonl`, `ramps.jsonl`). For each
target loss L: per batch size the learning rate with the fewest steps
(`cbs.analysis.fits.selection`), the fit S = S_min + E_min/B (`cbs.analysis.fits.fit`) and
the noise scale measured when those best trials passed L; then B_crit(L) = B*/L^(1/α_B).
Fits from an incomplete grid (`cbs.analysis.fits.edges`) are marked. The report's tables and
sentences are `cbs.analysis.reports.report_tables`.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import edges, fit, held_out, joint, misfit, noise_at_target, selection
from cbs.analysis.reports import plots
from cbs.analysis.reports import report_tables as tables
from cbs.results import paths, records, shared
from cbs.results.files import ANALYSIS_FILE, FIGURES_DIR, RAMP_KEYS, RAMPS_FILE, REPORT_FILE
from cbs.results.store import SweepStore, target_key

__all__ = [
    "analyze", "analyze_target", "load_analysis", "make_figures", "read_ramps", "seed_spread",
    "write_report",
]


def analyze_target(records: Sequence[dict[str, Any]], target: float, *,
                   bootstrap: int = 1000, seed: int | None = None,
                   grid: dict[str, Any] | None = None) -> dict[str, Any]:
    """Best learning rate per batch size, the trade-off fit and the measured noise at L. seed:
    of the bootstrap (None: from the selected steps). grid: `edges.grid_status`."""
    key = target_key(target)
    rows = [{"batch_size": r["batch_size"], "learning_rate": r["learning_rate"],
             "seed": int(r.get("seed", 0)), "steps": r["steps_to_target"].get(key),
             "record": r} for r in records]
    best = selection.best_per_batch_size(rows)
    tradeoff = fit.fit_tradeoff(best.batch_sizes, best.steps, bootstrap=bootstrap,
                                seed=joint.data_seed([best]) if seed is None else seed)
    best_records = [row["record"] for rows_b in best.best_rows for row in rows_b]
    measured = noise_at_target.spread(best_records, key)
    unreached = sorted({(r["batch_size"], r["learning_rate"], r["status"])
                        for r in (u["record"] for u in best.unreached)})
    key_edges = {b: e.get(key) for b, e in (grid or {}).get("edges", {}).items()}
    fitted = [float(b) for b in best.batch_sizes]
    extrapolated = tradeoff.ok and fitted and not min(fitted) <= tradeoff.b_crit <= max(fitted)
    return {
        "target": float(target), "fit": tradeoff,
        "incomplete_batch_sizes": [float(b) for b in sorted((grid or {}).get("missing", {}))],
        "capped_batch_sizes": [float(b) for b in best.edge_batch_sizes
                               if key_edges.get(int(b)) == edges.CAPPED],
        "b_crit_extrapolated": bool(extrapolated),
        "batch_sizes": best.batch_sizes.tolist(), "steps": best.steps.tolist(),
        "examples": best.examples.tolist(), "learning_rates": best.learning_rates.tolist(),
        "missing_batch_sizes": [float(b) for b in best.missing_batch_sizes],
        "edge_batch_sizes": [float(b) for b in best.edge_batch_sizes
                             if key_edges.get(int(b)) != edges.CAPPED],
        "unreached": [{"batch_size": b, "learning_rate": lr, "status": s}
                      for b, lr, s in unreached],
        **measured,
        "best_trial_ids": [r["trial_id"] for r in best_records],
        "seed_steps": best.seed_steps, "seed_learning_rates": best.seed_learning_rates,
        "_table": best,
    }


def analyze(sweep_dir: str, *, bootstrap: int = 1000, seed: int | None = None,
            write: bool = True, select_on_seed: int | None = None,
            out_dir: str | None = None) -> dict[str, Any]:
    """Fits every target of the sweep in `sweep_dir`: intervals of B_crit and the power law
    from `cbs.analysis.fits.joint`, of S_min and E_min from `fit.fit_tradeoff`; with
    select_on_seed also "held_out" (`cbs.analysis.fits.held_out`). Returns the JSON-ready
    analysis (written to `out_dir`, default the sweep directory, unless `write=False`) plus
    "fits", "power_law_fit" and "tables" (each target's `selection.BestPerBatchSize`)."""
    store = SweepStore(sweep_dir)
    definition = store.definition() or {}
    grid = edges.grid_status(definition, store.records())
    recs = grid["records"]
    if not recs:
        raise ValueError(f"{sweep_dir} has no finished trials ({store.path} is empty); run "
                         "the sweep first: cbs-sweep --config=... "
                         f"--sweep_dir={sweep_dir}")
    seq_len = definition.get("config", {}).get("data", {}).get("options", {}).get("seq_len")
    targets = definition.get("sweep", {}).get("targets") or sorted(
        {float(k) for r in recs for k in r["steps_to_target"]}, reverse=True)
    per_target = [analyze_target(recs, t, bootstrap=bootstrap, seed=seed, grid=grid)
                  for t in targets]
    power_law, misfit = _joint_fits(per_target, bootstrap, seed)
    analysis = {"sweep_dir": sweep_dir, "num_trials": len(recs),
                "statuses": dict(collections.Counter(r["status"] for r in recs)),
                "target_metric": recs[0]["target_metric"],
                "complete": grid["complete"], "grid_known": grid["known"],
                "num_expected": grid["num_expected"], "num_missing": grid["num_missing"],
                "missing_per_batch_size": {str(b): n for b, n in grid["missing"].items()},
                "tokens_per_example": int(seq_len) if seq_len else None,
                "targets": [{**{k: v for k, v in t.items() if k != "_table"},
                             "fit": t["fit"].to_dict()} for t in per_target],
                "power_law": power_law.to_dict() | {"misfit": misfit},
                "seeds": seed_spread(recs, targets, bootstrap=min(bootstrap, 200)),
                "noise_protocol": noise_at_target.protocol(definition),
                "reference_noise": noise_at_target.reference(
                    sweep_dir, targets, int(definition.get("sweep", {}).get("noise_window", 5)))}
    if select_on_seed is not None:
        analysis["held_out"] = held_out.held_out(recs, targets, select_on_seed,
                                                 bootstrap=min(bootstrap, 200))
    if write:
        records.write_json_atomic(os.path.join(out_dir or sweep_dir, ANALYSIS_FILE), analysis)
    return analysis | {"fits": [t["fit"] for t in per_target], "power_law_fit": power_law,
                       "tables": [t["_table"] for t in per_target]}


def _joint_fits(per_target: list[dict[str, Any]], bootstrap: int, seed: int | None
                ) -> tuple[fit.PowerLawFit, dict[str, Any] | None]:
    """The power law and the joint intervals (the fits updated in place); the misfit check."""
    ok = [t for t in per_target if t["fit"].ok]
    power_law = fit.fit_power_law([t["target"] for t in ok], [t["fit"].b_crit for t in ok],
                                  bootstrap=0)
    if bootstrap <= 0 or not ok:
        return power_law, None
    tables = [t["_table"] for t in per_target]
    j = joint.joint_bootstrap(tables, [t["target"] for t in per_target],
                              [t["fit"] for t in per_target], n=bootstrap, seed=seed)
    for t, ci in zip(per_target, j.b_crit_ci, strict=True):
        if t["fit"].ok:
            t["fit"] = dataclasses.replace(
                t["fit"], b_crit_ci=ci, interval=f"B_crit: {joint.METHOD_B_CRIT}; S_min, "
                "E_min: residual bootstrap-t",
                warnings=fit.tradeoff_warnings(np.asarray(t["batch_sizes"]), t["fit"].b_crit,
                                               ci))
    if power_law.ok:
        power_law = dataclasses.replace(
            power_law, alpha_b_ci=j.alpha_b_ci, b_star_ci=j.b_star_ci, slope_ci=j.slope_ci,
            interval=joint.METHOD_POWER_LAW)
    return power_law, j.to_dict() | {"calibrated": _calibrated(per_target, bootstrap, j.seed)}


def _calibrated(per_target: list[dict[str, Any]], bootstrap: int, seed: int
                ) -> dict[str, Any]:
    """The calibrated misfit test (`cbs.analysis.fits.misfit`) and the law without a target
    that breaks it (p < 0.05 with it, ≥ 0.05 without)."""
    tables = [t["_table"] for t in per_target]
    losses = [t["target"] for t in per_target]
    points = [t["fit"] for t in per_target]
    c = misfit.calibrated_misfit(tables, losses, points, n=2 * bootstrap, seed=seed)
    out = c.to_dict()
    k = c.breaking_target
    if k is None or not c.p < 0.05 or not c.without_target[k] >= 0.05:
        return out
    keep = [i for i in range(len(per_target)) if i != k and points[i].ok]
    law = fit.fit_power_law([losses[i] for i in keep], [points[i].b_crit for i in keep],
                            bootstrap=0)
    jk = joint.joint_bootstrap([tables[i] for i in keep], [losses[i] for i in keep],
                               [points[i] for i in keep], n=bootstrap, seed=seed)
    return out | {"without_breaking": {"target": losses[k], "p": c.without_target[k],
                                       "alpha_b": law.alpha_b, "alpha_b_ci": jk.alpha_b_ci,
                                       "b_star": law.b_star}}


def seed_spread(records: Sequence[dict[str, Any]], targets: Sequence[float], *,
                bootstrap: int = 200) -> list[dict[str, Any]]:
    """Per target, B_crit fitted on each seed's trials alone, and the median and largest over
    batch sizes of the seeds' (max − min)/mean fewest steps. Empty with one seed."""
    seeds = sorted({int(r.get("seed", 0)) for r in records})
    if len(seeds) < 2:
        return []
    out = []
    for target in targets:
        fits = [analyze_target([r for r in records if int(r.get("seed", 0)) == sd], target,
                               bootstrap=bootstrap)["fit"] for sd in seeds]
        per_seed = {str(sd): f.b_crit if f.ok else None for sd, f in zip(seeds, fits, strict=True)}
        best = analyze_target(records, target, bootstrap=0)
        spreads = [(max(s) - min(s)) / float(np.mean(s)) for s in best["seed_steps"]
                   if len(s) > 1]
        out.append({"target": float(target), "b_crit_per_seed": per_seed,
                    "steps_spread_median": float(np.median(spreads)) if spreads else None,
                    "steps_spread_max": float(max(spreads)) if spreads else None})
    return out


def read_ramps(sweep_dir: str) -> list[dict[str, Any]]:
    """Batch-ramp runs recorded beside the sweep (see `cbs.sweeps.ramps`), if any."""
    return shared.read_merged(os.path.join(sweep_dir, RAMPS_FILE), RAMP_KEYS)


def make_figures(sweep_dir: str, analysis: dict[str, Any], out_dir: str | None = None
                 ) -> dict[str, str]:
    """Writes the PNG figures of `analyze`'s result (default: sweep_dir/figures): {name: path}."""
    out_dir = out_dir or os.path.join(sweep_dir, FIGURES_DIR)
    series = [{"target": t["target"], "batch_sizes": t["batch_sizes"], "steps": t["steps"],
               "fit": f} for t, f in zip(analysis["targets"], analysis["fits"], strict=True)]
    figs = {"pareto": plots.pareto_frontier(series, os.path.join(out_dir, "pareto.png")),
            "collapse": plots.tradeoff_collapse(series, os.path.join(out_dir, "collapse.png"))}
    ok = [(t, f) for t, f in zip(analysis["targets"], analysis["fits"], strict=True) if f.ok]
    losses = [t["target"] for t, _ in ok]
    all_losses = [t["target"] for t in analysis["targets"]]
    measured = {label: (all_losses, [t[key] for t in analysis["targets"]])
                for label, key in (("B_simple", "measured_b_simple"),
                                   ("B_noise", "measured_b_noise"))
                if any(math.isfinite(t[key]) for t in analysis["targets"])}
    figs["b_crit_vs_loss"] = plots.b_crit_vs_loss(
        losses, [f.b_crit for _, f in ok], os.path.join(out_dir, "b_crit_vs_loss.png"),
        b_crit_cis=[f.b_crit_ci for _, f in ok], power_law=analysis["power_law_fit"],
        measured=measured)
    records = {r["trial_id"]: r for r in SweepStore(sweep_dir).records()}
    shown = sorted({i for t in analysis["targets"] for i in t["best_trial_ids"]})
    runs = [{"label": f"B={records[i]['batch_size']}", "step": records[i]["curve"]["examples"],
             "b_simple": records[i]["curve"].get("noise/b_simple", []),
             "b_noise": records[i]["curve"].get("noise/b_noise", [])}
            for i in shown if i in records]
    figs["noise"] = plots.noise_over_training(runs, os.path.join(out_dir, "noise_scale.png"),
                                              xlabel="examples seen")
    ramps = read_ramps(sweep_dir)
    for t, f in zip(analysis["targets"], analysis["fits"], strict=True):
        key = target_key(t["target"])
        runs = [{"label": r["label"], "steps": r["steps_to_target"][key],
                 "examples": r["examples_to_target"][key]}
                for r in ramps if r["steps_to_target"].get(key) is not None]
        if f.ok and runs:
            name = f"ramps_L{key}"
            figs[name] = plots.se_plane(
                f, os.path.join(out_dir, f"{name}.png"), runs=runs,
                points={"batch_sizes": t["batch_sizes"], "steps": t["steps"]},
                title=f"Batch ramps against the sweep frontier, target L={key}")
    return figs


def write_report(sweep_dir: str, *, bootstrap: int = 1000, partial: bool = False,
                 select_on_seed: int | None = None, out_dir: str | None = None) -> str:
    """analysis.json, figures/*.png and report.md of the sweep, written into `out_dir`
    (default: the sweep directory; another re-reports a read-only study). Refuses
    (ValueError) a grid with trials missing unless `partial` (a report headed as partial)."""
    out = out_dir or sweep_dir
    if out_dir:
        paths.makedirs(out_dir)
    analysis = analyze(sweep_dir, bootstrap=bootstrap, select_on_seed=select_on_seed,
                       out_dir=out)
    if not analysis["complete"] and not partial:
        raise ValueError(f"{sweep_dir} is incomplete: {tables.missing_text(analysis)}; finish it "
                         "(rerun the sweep command, every shard) or pass --partial for a "
                         "report marked partial")
    figs = make_figures(sweep_dir, analysis, os.path.join(out, FIGURES_DIR))
    lines = [f"# Critical batch size report: `{sweep_dir}`", ""]
    if not analysis["complete"]:
        lines += [f"**PARTIAL SWEEP, not a final result: {tables.missing_text(analysis)}.** Fits "
                  "marked \"incomplete grid\" may change when the missing trials finish.", ""]
    lines += [f"{analysis['num_trials']} trials ({tables.counts_text(analysis['statuses'])}); "
              f"progress metric `{analysis['target_metric']}`.", "",
              "## B_crit per target", "",
              "S = S_min + E_min/B fitted to the best learning rate at each batch size "
              "(McCandlish et al. 2018), S being the mean over seeds of each seed's fewest "
              "steps; B_crit = E_min/S_min. S is the first crossing of the target, "
              "interpolated linearly in log loss between evaluations. " + tables.interval_text(
                  analysis) + " B_simple and B_noise: the noise scale measured when the "
              "best trials passed the target (ratio of window averages, median over batch "
              "sizes). \"(extrapolated)\": B_crit lies outside the batch sizes fitted.", "",
              tables.summary_table(analysis), "", *noise_at_target.protocol_lines(analysis), "",
              *tables.power_law_lines(analysis)]
    if analysis.get("tokens_per_example"):
        lines += ["## In tokens, beside Kaplan et al. 2020", "",
                  f"{analysis['tokens_per_example']} tokens per sequence.", "",
                  tables.kaplan_table(analysis), ""]
    if analysis.get("seeds"):
        lines += ["## Seeds", "", "The fit above uses, at each batch size, the mean over "
                  "seeds of each seed's fewest steps; below, the same fit on each seed's "
                  "trials alone, and how far the seeds' fewest steps lie apart "
                  "((max − min)/mean, over batch sizes). The bootstrap interval resamples "
                  "batch sizes, not seeds: where the per-seed fits range wider, the seed "
                  "spread is the larger error.", "", tables.seed_table(analysis), ""]
    if analysis.get("held_out"):
        lines += ["## Held-out seeds", "", "Each best learning rate selected on one seed "
                  "(fewest steps to L at each B) and its steps measured on the other seeds; "
                  "the fit through those held-out S beside the in-sample fit (each seed's own "
                  "best rate) on the same seeds. A ratio above 1: selecting and measuring on "
                  "the same seed flattered S by that factor. A B whose held-out trial never "
                  "crossed L is left out; \"censored\": its group stopped once a faster rate "
                  "crossed (`sweep.stop_when_dominated`).", "", tables.held_out_table(analysis), ""]
    lines += ["## Learning-rate grid", "", *(f"- {n}" for n in tables.grid_notes(analysis)), ""]
    notes = tables.notes(analysis)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["## Figures", ""] + [f"![{k}]({os.path.relpath(p, out)})"
                                   for k, p in figs.items()] + [""]
    ramps = read_ramps(sweep_dir)
    if ramps:
        lines += ["## Batch-size ramps", "", tables.ramp_table(ramps, analysis), ""]
    path = os.path.join(out, REPORT_FILE)
    records.write_atomic(path, "\n".join(lines))
    return path


def load_analysis(sweep_dir: str) -> dict[str, Any]:
    """analysis.json of a sweep directory; FileNotFoundError without one."""
    path = os.path.join(sweep_dir, ANALYSIS_FILE)
    analysis = records.read_json(path)
    if analysis is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return analysis
