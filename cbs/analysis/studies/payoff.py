"""The payoff of a batch ramp: seeds of ramps against seeds of fixed batch sizes
(docs/guides/ramps.md).

Reads `ramps.jsonl` (`cbs.sweeps.ramps`) of a ramp study repeated over seeds (spec fields `name`
and `seed`); constant schedules are the fixed-batch baseline. At each target L: S and E of
every run (geometric mean over its seeds); the frontier S = S_min + E_min/B fitted to the
fastest fixed run at each B; for each ramp the step saving at equal examples, 1 − S_ramp /
S_frontier(E_ramp) with S_frontier(E) = S_min·E/(E − E_min) (+∞ when E ≤ E_min), the example
cost at equal steps, E_ramp / E_frontier(S_ramp) − 1, and the comparison against the fixed
run at its first batch size (`cbs.analysis.studies.ramp_start`). A ramp beats the frontier
when the saving's interval (percentile bootstrap over seeds) lies above zero.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from cbs.analysis.fits import fit
from cbs.analysis.reports import plots
from cbs.analysis.studies import ramp_start
from cbs.results import files, records
from cbs.results.store import target_key

__all__ = [
    "BOOTSTRAP", "analyze", "analyze_target", "best_fixed", "figure", "frontier_examples",
    "frontier_steps", "geometric_mean", "run_name", "summary_lines", "t_interval", "table",
    "verdict", "write_report",
]

BOOTSTRAP = 1000  # replicates of the saving's interval
CONFIDENCE = 0.95
T_INTERVAL = "Student-t over seeds in log S, log E"
BOOTSTRAP_INTERVAL = ("percentile bootstrap over seeds (resampled within every run, the "
                      "frontier refitted per replicate)")


def run_name(record: dict[str, Any]) -> str:
    """The run a seeded record belongs to (its spec's `name`; else its label)."""
    return str((record.get("spec") or {}).get("name", record["label"]))


def group_runs(ramps: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records by run name, in first-seen order, each run's seeds in seed order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in ramps:
        out.setdefault(run_name(r), []).append(r)
    for runs in out.values():
        runs.sort(key=lambda r: (r.get("spec") or {}).get("seed", 0))
    return out


def geometric_mean(values: Any) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=np.float64)))))


def t_interval(values: Any, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student-t interval of the geometric mean of positive `values` (NaNs below two)."""
    x = np.log(np.asarray(values, dtype=np.float64))
    if x.size < 2:
        return (math.nan, math.nan)
    half = stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return (float(np.exp(x.mean() - half)), float(np.exp(x.mean() + half)))


def frontier_steps(s_min: float, e_min: float, examples: Any) -> Any:
    """S on the frontier at E examples: S_min·E/(E − E_min), +∞ at or below E_min."""
    e = np.asarray(examples, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(e > e_min, s_min * e / (e - e_min), np.inf)


def frontier_examples(s_min: float, e_min: float, steps: Any) -> Any:
    """E on the frontier at S steps: E_min·S/(S − S_min), +∞ at or below S_min."""
    return frontier_steps(e_min, s_min, steps)


def _seed_values(runs: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    s = [r["steps_to_target"].get(key) for r in runs]
    e = [r["examples_to_target"].get(key) for r in runs]
    if any(a is None or b is None for a, b in zip(s, e, strict=True)):
        return np.array([]), np.array([])
    return np.asarray(s, dtype=np.float64), np.asarray(e, dtype=np.float64)


def _tuned(values, fixed) -> dict[int, str]:
    """B -> the fixed run at B with the fewest steps at this target (all seeds reached L)."""
    out: dict[int, str] = {}
    for name in sorted((n for n, b in fixed.items() if b is not None and values[n][0].size)):
        b = int(fixed[name])
        if b not in out or geometric_mean(values[name][0]) < geometric_mean(values[out[b]][0]):
            out[b] = name
    return out


def analyze_target(runs: dict[str, list[dict[str, Any]]], target: float, *,
                   bootstrap: int = BOOTSTRAP, confidence: float = CONFIDENCE
                   ) -> dict[str, Any]:
    """One target: every run's S, E, the frontier, and each ramp against it and its first B."""
    key = target_key(target)
    values = {name: _seed_values(v, key) for name, v in runs.items()}
    schedules = {name: (v[0].get("spec") or {}).get("schedule", {}) for name, v in runs.items()}
    fixed = {name: int(s["batch_size"]) if s.get("kind") == "constant" else None
             for name, s in schedules.items()}  # B of a fixed run, None for a ramp
    tuned = _tuned(values, fixed)
    usable = [tuned[b] for b in sorted(tuned)]
    sizes = sorted(tuned)
    means = [geometric_mean(values[n][0]) for n in usable]
    frontier = fit.fit_tradeoff(sizes, means, bootstrap=0)  # NaNs unless ok
    s_min, e_min = frontier.s_min, frontier.e_min
    rows = []
    for name, v in runs.items():
        s, e = values[name]
        row: dict[str, Any] = {"run": name, "batch_size": fixed[name], "num_seeds": len(v),
                               "learning_rate": v[0].get("learning_rate"),
                               "tuned": name in usable,
                               "reached": int(sum(r["steps_to_target"].get(key) is not None
                                                  for r in v))}
        if s.size:
            s_, e_ = geometric_mean(s), geometric_mean(e)
            row |= {"steps": s_, "steps_ci": t_interval(s, confidence),
                    "examples": e_, "examples_ci": t_interval(e, confidence)}
            if math.isfinite(s_min):  # at equal examples, and at equal steps
                row["step_saving"] = float(1.0 - s_ / frontier_steps(s_min, e_min, e_))
                row["example_cost"] = float(e_ / frontier_examples(s_min, e_min, s_) - 1.0)
        rows.append(row)
    resid = np.log(means) - np.log(s_min + e_min / np.asarray(sizes, dtype=np.float64))
    out = {"target": float(target), "frontier": {
               "s_min": s_min, "e_min": e_min, "batch_sizes": sorted(sizes),
               "rms_log_residual": float(np.sqrt(np.mean(resid ** 2))) if sizes else math.nan},
           "tuned_fixed": {str(b): n for b, n in sorted(tuned.items())}, "rows": rows,
           "start": _against_start(runs, fixed, tuned, key, bootstrap or BOOTSTRAP, confidence)}
    if math.isfinite(s_min) and bootstrap:
        recorded = json.dumps([[n, [r["steps_to_target"].get(key) for r in runs[n]]]
                               for n in sorted(runs)])  # the generator's seed: the records
        _bootstrap(out, values, usable, sizes, bootstrap, confidence,
                   ramp_start.recorded_rng(recorded))
    return out


def _against_start(runs, fixed, tuned, key, bootstrap, confidence) -> list[dict[str, Any]]:
    """Each ramp against the fixed run at its first batch size, tuned at this target."""
    out = []
    for name, v in runs.items():
        if fixed[name] is not None:
            continue
        b0 = ramp_start.start_batch_size(v[0].get("spec") or {})
        row = {"run": name, "start_batch_size": b0, "fixed_run": tuned.get(b0) if b0 else None}
        if row["fixed_run"] is not None:
            row |= ramp_start.compare(v, runs[row["fixed_run"]], key, bootstrap=bootstrap,
                                      confidence=confidence)
        out.append(row)
    return out


def _bootstrap(out, values, usable, sizes, n_rep, confidence, rng) -> None:
    """Adds percentile intervals of each ramp's saving and cost (all replicates in one fit)."""
    ramps = [row for row in out["rows"] if row["batch_size"] is None and "steps" in row]

    draws = {n: rng.integers(0, len(values[n][0]), (n_rep, len(values[n][0])))
             for n in sorted({*usable, *(row["run"] for row in ramps)})}

    def resampled(name: str, k: int) -> np.ndarray:  # [R] geometric means of drawn seeds
        return np.exp(np.log(values[name][k])[draws[name]].mean(axis=1))

    logs = np.log(np.stack([resampled(n, 0) for n in usable], axis=1))
    logb = np.broadcast_to(np.log(np.asarray(sizes, dtype=np.float64)), logs.shape)
    f = out["frontier"]
    theta = fit.solve(logb, logs, np.log([f["s_min"], f["e_min"]]), iters=200, tol=1e-10)[0]
    s_min, e_min = np.exp(theta[:, 0]), np.exp(theta[:, 1])
    q = (50 * (1 - confidence), 50 * (1 + confidence))
    for row in ramps:
        s, e = resampled(row["run"], 0), resampled(row["run"], 1)  # the same seeds
        saving = 1.0 - s / frontier_steps(s_min, e_min, e)
        cost = e / frontier_examples(s_min, e_min, s) - 1.0
        row["step_saving_ci"] = tuple(float(x) for x in np.percentile(saving, q))
        row["example_cost_ci"] = tuple(float(x) for x in np.percentile(cost, q))


def verdict(row: dict[str, Any], best: dict[str, Any] | None = None) -> str:
    """Whether a ramp beat the frontier at this target, in words, and `best` (`best_fixed`)."""
    ci = row.get("step_saving_ci")
    if "steps" not in row:
        return f"{row['reached']}/{row['num_seeds']} seeds reached"
    if ci is None:
        return "no interval"
    if ci[0] > 0:
        cost_hi = row.get("example_cost_ci", (math.nan, math.nan))[1]
        if best is None:
            return "beats the frontier"
        if cost_hi < best["example_cost"]:
            return "beats the frontier and every fixed batch"
        return (f"beats the fitted frontier, not the best fixed batch ({best['run']}: "
                f"{_pct(best['example_cost'])})")
    if ci[1] < 0:
        return "behind the frontier"
    return "on the frontier (interval contains 0)"


def best_fixed(target: dict[str, Any]) -> dict[str, Any] | None:
    """The fixed batch size furthest below the fitted frontier (examples at equal steps)."""
    fixed = [r for r in target["rows"]
             if r["batch_size"] is not None and r.get("tuned", True) and "example_cost" in r]
    return min(fixed, key=lambda r: r["example_cost"]) if fixed else None


def analyze(ramps: Sequence[dict[str, Any]], targets: Sequence[float], *,
            bootstrap: int = BOOTSTRAP, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Every target's analysis (`analyze_target`) and the methods, JSON-ready."""
    runs = group_runs(ramps)
    return {"confidence": confidence, "runs": list(runs),
            "seeds": {n: [(r.get("spec") or {}).get("seed") for r in v] for n, v in runs.items()},
            "intervals": {"steps, examples": T_INTERVAL, "saving, cost": BOOTSTRAP_INTERVAL},
            "bootstrap": bootstrap,
            "targets": [analyze_target(runs, t, bootstrap=bootstrap, confidence=confidence)
                        for t in targets]}


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _pct(x: float) -> str:
    return "−∞" if x == -math.inf else f"{100 * x:+.0f} %"


def _saving(x: float) -> str:
    """A step saving; 1: E ≤ E_min, fewer examples than any fixed B reaches L with."""
    return "100 %*" if x >= 1.0 else _pct(x)


def _cell_ci(value: float, ci: tuple[float, float] | None, fmt) -> str:
    if ci is None or not all(math.isfinite(c) for c in ci):
        return fmt(value)
    return f"{fmt(value)} ({fmt(ci[0])}–{fmt(ci[1])})"


def table(target: dict[str, Any]) -> str:
    """Markdown: one row per run at one target."""
    best = best_fixed(target)
    lines = ["| run | seeds reached | S (CI) | E (CI) | step saving at equal E (CI) | "
             "examples vs frontier at equal S (CI) | verdict |", "|---" * 7 + "|"]
    for row in target["rows"]:
        cells = [row["run"], f"{row['reached']}/{row['num_seeds']}"]
        if "steps" in row:
            cells += [_cell_ci(row["steps"], row["steps_ci"], _num),
                      _cell_ci(row["examples"], row["examples_ci"], _num)]
        else:
            cells += ["–", "–"]
        if row["batch_size"] is None and "step_saving" in row:
            cells += [_cell_ci(row["step_saving"], row.get("step_saving_ci"), _saving),
                      _cell_ci(row["example_cost"], row.get("example_cost_ci"), _pct),
                      verdict(row, best)]
        elif row["batch_size"] is not None and "step_saving" in row:
            cells += [_saving(row["step_saving"]), _pct(row["example_cost"]),
                      "fixed batch (frontier residual)" if row.get("tuned", True) else
                      "fixed batch, a slower rate at this L (not in the frontier)"]
        else:
            cells += ["–", "–",
                      verdict(row, best) if row["batch_size"] is None else "fixed batch"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per ramp: at each target its examples vs the frontier at equal steps, verdict."""
    out = []
    names = [row["run"] for row in result["targets"][0]["rows"] if row["batch_size"] is None]
    for name in names:
        parts = []
        for t in result["targets"]:
            row = next(r for r in t["rows"] if r["run"] == name)
            if "example_cost" in row:
                parts.append(f"L={t['target']:g}: "
                             + _cell_ci(row["example_cost"], row.get("example_cost_ci"), _pct)
                             + f", {verdict(row, best_fixed(t))}")
            else:
                parts.append(f"L={t['target']:g}: {verdict(row)}")
        out.append(f"- **{name}** (examples vs the frontier at equal steps): "
                   + "; ".join(parts) + ".")
    return out


def figure(result: dict[str, Any], ramps: Sequence[dict[str, Any]], path: str) -> str:
    """Each target's S–E plane: every seed, run means with intervals, and the frontier."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    runs = group_runs(ramps)
    targets = result["targets"]
    fig = Figure(figsize=(4.2 * len(targets), 4.2), layout="constrained")
    colours = colormaps["tab10"]
    for i, t in enumerate(targets):
        ax = fig.add_subplot(1, len(targets), i + 1)
        key = target_key(t["target"])
        for j, (name, v) in enumerate(runs.items()):
            s, e = _seed_values(v, key)
            row = next(r for r in t["rows"] if r["run"] == name)
            if not s.size:
                continue
            marker = "o" if row["batch_size"] is not None else "D"
            ax.scatter(e, s, s=8, color=colours(j % 10), alpha=0.4, marker=marker)
            xerr = np.abs(np.array(row["examples_ci"]) - row["examples"])[:, None]
            yerr = np.abs(np.array(row["steps_ci"]) - row["steps"])[:, None]
            ax.errorbar(row["examples"], row["steps"], xerr=np.nan_to_num(xerr),
                        yerr=np.nan_to_num(yerr), fmt=marker, color=colours(j % 10), ms=6,
                        capsize=2, lw=0.8, label=name if i == 0 else None)
        f = t["frontier"]
        if math.isfinite(f["s_min"]):
            b = np.geomspace(min(f["batch_sizes"]) / 4, max(f["batch_sizes"]) * 4, 200)
            ax.plot(f["s_min"] * b + f["e_min"], f["s_min"] + f["e_min"] / b, "k--", lw=1,
                    label="fixed-batch frontier" if i == 0 else None)
        ax.set(xscale="log", yscale="log", xlabel="examples E", title=f"L = {t['target']:g}")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].set_ylabel("steps S")
    fig.legend(loc="outside right center", fontsize=7)
    return plots.save_figure(fig, path, dpi=110)


def _schedule_text(spec: dict[str, Any]) -> str:
    sched = spec.get("schedule", {})
    kind = sched.get("kind")
    if kind == "constant":
        return f"B = {sched['batch_size']}"
    if kind == "step":
        return "B = " + " → ".join(f"{b} at {e:,}" for e, b in sched["steps"]) + " examples"
    if kind == "linear":
        return f"B = {sched['start']} → {sched['end']} linearly over {sched['over']:,} examples"
    if kind == "adaptive":
        return (f"B = {sched.get('k', 1)}·{sched.get('source', 'b_simple')} (live, ladder "
                f"{sched.get('min_batch')}–{sched.get('max_batch')})")
    return json.dumps(sched)


def write_report(out_dir: str, ramps: Sequence[dict[str, Any]], targets: Sequence[float], *,
                 sweep_dir: str, bootstrap: int = BOOTSTRAP) -> str:
    """payoff.md, payoff.json and payoff.png in out_dir; returns the report's path."""
    result = analyze(ramps, targets, bootstrap=bootstrap)
    runs = group_runs(ramps)
    figure(result, ramps, os.path.join(out_dir, files.PAYOFF_FIGURE_FILE))
    seeds = sorted({s for v in result["seeds"].values() for s in v if s is not None})
    lines = [f"# Batch ramps against fixed batch sizes: {out_dir}", "",
             f"{len(ramps)} runs: {len(runs)} schedules × seeds {seeds}, learning rates from "
             f"the sweep in `{sweep_dir}` (fixed B: its best rate at B, and any other rate run "
             "at B; ramps: its best rate at their first B, then the square-root rule). Every "
             "run is evaluated and stopped the same way; at each target the frontier S = "
             "S_min + E_min/B is fitted to the mean steps of the fastest fixed run at each B "
             "(tuned per target, selected on the same seeds). S and E: geometric means over "
             "seeds. Intervals are "
             f"{int(100 * result['confidence'])} %: S and E, "
             f"{T_INTERVAL}; step saving and example cost, {BOOTSTRAP_INTERVAL}, {bootstrap} "
             "replicates. Step saving at equal examples: 1 − S/S_frontier(E) (> 0: fewer "
             "steps than any fixed batch size using as many examples); examples vs frontier at "
             "equal steps: E/E_frontier(S) − 1 (< 0: fewer examples); 100 %*: the run used at most "
             "E_min examples, fewer than the fitted frontier allows any fixed batch size. The "
             "frontier's fit is only as good as its RMS residual (given per target): where "
             "fixed batch sizes sit far off it, so do the savings. Below each target's table, "
             "Merrill et al.'s comparison: each ramp against the fixed run at its first batch "
             "size, seed by seed (`cbs.analysis.studies.ramp_start`): steps saved to L and the "
             "examples beside (a saving at equal examples where those are ≤ 0), the seeds a paired "
             f"t-test needs to detect {ramp_start.EFFECT:.0%} fewer steps with "
             f"{ramp_start.POWER:.0%} power at the seed-to-seed σ observed, and the saving "
             "these seeds could detect.", "", "## Schedules", ""]
    lines += [f"- {name}: {_schedule_text(v[0].get('spec') or {})}"
              + (f" (η = {v[0]['learning_rate']:.4g})" if "learning_rate" in v[0] else "")
              for name, v in runs.items()]
    lines += ["", "## Verdict per ramp", "", *summary_lines(result), "",
              "## Against the fixed run at the first batch size (Merrill et al.'s comparison)",
              "", *ramp_start.summary_lines(result["targets"]), ""]
    for t in result["targets"]:
        f = t["frontier"]
        front = (f"frontier S_min = {f['s_min']:.3g}, E_min = {f['e_min']:.3g} "
                 f"(B_crit = {f['e_min'] / f['s_min']:.3g}) from "
                 f"{', '.join(t['tuned_fixed'].values())}, RMS residual "
                 f"{f['rms_log_residual']:.2f} in log S" if math.isfinite(f["s_min"])
                 else "no frontier (fewer than 3 fixed batch sizes reached it with every seed)")
        lines += [f"## L = {t['target']:g}", "", front, "", table(t), "",
                  "Against the fixed run at the ramp's first batch size:", "",
                  ramp_start.table(t["start"]), ""]
    lines += [f"![Runs on the S–E plane]({files.PAYOFF_FIGURE_FILE})", ""]
    path = os.path.join(out_dir, files.PAYOFF_REPORT_FILE)
    records.write_atomic(path, "\n".join(lines))
    records.write_json_atomic(os.path.join(out_dir, files.PAYOFF_FILE), fit.json_ready(result))
    return path
