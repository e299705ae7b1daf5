"""Local critical batch size from branch records, and the figure that sets it beside the
noise scale and the swept B_crit (reads result files only; docs/guides/local_cbs.md).

Letters: B the reference batch, k a batch multiplier, L_k the compared loss of branch k at the
end of its window (mean over seeds, or one seed), ε the tolerance.

Criterion (Merrill et al. 2025, "Critical Batch Size Revisited", Sec. 3.1): k passes when
L_k ≤ min_{k' < k} L_k' + ε (ε in nats, or ε·min for `tolerance="relative"`). k* is the largest
passing k (`criterion="paper"`), or the largest k such that it and every smaller k pass
(`criterion="ladder"`). B* = k*·B (`b_star="k_star"`) or √(k*·B · k⁺·B), k⁺ the next
multiplier (`b_star="geometric"`); `b_pass` = k*·B and `b_fail` = k⁺·B bracket the crossing.
B* is a bound at either end of the ladder: "≤ B" (k* = 1, `floor`), "≥ k_max·B" (`censored`).
Uncertainty: the range of each data-order seed's own B*. A `branch.json` without `criterion`
and `b_star` is read as "ladder" and "geometric".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.reports import plots, report
from cbs.results import files, records, shared

__all__ = [
    "REFERENCE_METRICS", "critical_batch", "critical_multiplier", "format_b_star", "local_cbs",
    "local_cbs_schedule", "plot_local_cbs", "summarize", "summary_table", "write_report",
]

REFERENCE_METRICS = os.path.join(files.REFERENCE_DIR, files.METRICS_FILE)
_SCALES = (("b_simple", "tab:blue", "B_simple"), ("b_noise", "tab:green", "B_noise"))


def critical_multiplier(ks: Sequence[int], losses: Sequence[float], epsilon: float,
                        tolerance: str = "absolute", criterion: str = "paper") -> int:
    """k* of one ladder; `losses[i]` belongs to `ks[i]` (ascending, starting at 1)."""
    best, k_star = losses[0], ks[0]
    for k, loss in zip(ks[1:], losses[1:], strict=True):
        slack = epsilon * abs(best) if tolerance == "relative" else epsilon
        if math.isfinite(loss) and loss <= best + slack:
            k_star = k
        elif criterion == "ladder":
            break
        if math.isfinite(loss):
            best = min(best, loss)
    return k_star


def critical_batch(ks: Sequence[int], k_star: int, batch_size: int,
                   b_star: str = "k_star") -> tuple[float, bool]:
    """(B*, censored): (k*·B, True) at the top of the ladder."""
    i = list(ks).index(k_star)
    if i + 1 == len(ks):
        return float(k_star * batch_size), True
    if b_star == "k_star":
        return float(k_star * batch_size), False
    return float(batch_size * math.sqrt(k_star * ks[i + 1])), False


def local_cbs(rows: Sequence[dict[str, Any]], *, epsilon: float, tolerance: str = "absolute",
              metric: str = "loss_ema", criterion: str = "paper", b_star: str = "k_star"
              ) -> dict[str, Any]:
    """B* of one branch point from its records (`k`, `seed`, `metric`, `reference_batch_size`):
    seed-mean losses and loss_se, k_star, b_star, b_pass, b_fail (inf at the top), censored,
    floor, b_star_seeds and their range b_star_lo, b_star_hi."""
    ks = sorted({int(r["k"]) for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    bsz = int(rows[0]["reference_batch_size"])
    table = np.full((len(seeds), len(ks)), np.nan)
    for r in rows:
        table[seeds.index(r["seed"]), ks.index(int(r["k"]))] = r[metric]
    mean = table.mean(axis=0)
    se = table.std(axis=0, ddof=1) / math.sqrt(len(seeds)) if len(seeds) > 1 else mean * np.nan
    rule = {"tolerance": tolerance, "criterion": criterion}
    k_star = critical_multiplier(ks, mean.tolist(), epsilon, **rule)
    value, censored = critical_batch(ks, k_star, bsz, b_star)
    per_seed = [critical_batch(ks, critical_multiplier(ks, row.tolist(), epsilon, **rule), bsz,
                               b_star)[0] for row in table]
    i = ks.index(k_star)
    return {"point_step": int(rows[0]["point_step"]),
            "point_examples": int(rows[0]["point_examples"]),
            "window_examples": int(rows[0].get("window_examples", 0)), "ks": ks,
            "losses": mean.tolist(), "loss_se": se.tolist(), "k_star": k_star, "b_star": value,
            "b_pass": float(k_star * bsz),
            "b_fail": float(ks[i + 1] * bsz) if i + 1 < len(ks) else math.inf,
            "censored": censored, "floor": k_star == ks[0], "b_star_seeds": per_seed,
            "b_star_lo": min(per_seed), "b_star_hi": max(per_seed), "num_seeds": len(seeds)}


def summarize(workdir: str) -> list[dict[str, Any]]:
    """`local_cbs` of every complete branch point, by examples, with `b_simple`, `b_noise`."""
    definition = records.read_json(os.path.join(workdir, files.DEFINITION_FILE))
    if definition is None:
        raise FileNotFoundError(f"{workdir} has no {files.DEFINITION_FILE}: run cbs-branch "
                                f"--config=... --workdir={workdir} first")
    b = definition["branch"]
    rows = shared.read_merged(os.path.join(workdir, files.BRANCHES_FILE),
                              ("point_step", "k", "seed"))  # the export and its parts
    want = len(b["ks"]) * len(b["seeds"])
    noise = {r["step"]: r for r in _noise_records(workdir)}
    out = []
    for step in sorted({r["point_step"] for r in rows}):
        point = [r for r in rows if r["point_step"] == step]
        if len(point) == want:
            n = noise.get(step, {})
            out.append(local_cbs(point, epsilon=b["epsilon"], tolerance=b["tolerance"],
                                 metric=b["metric"], criterion=b.get("criterion", "ladder"),
                                 b_star=b.get("b_star", "geometric"))
                       | {"b_simple": n.get("noise/b_simple", math.nan),
                          "b_noise": n.get("noise/b_noise", math.nan)})
    return out


def local_cbs_schedule(workdir: str, *, multiple: int) -> dict[str, Any]:
    """A step batch schedule (`cbs.engine.schedules.Step` config) that follows the study's
    local critical batch: B(e) = the largest B* (bounds as their value) at any point up to e
    examples, rounded down to a multiple of `multiple` (at least `multiple`)."""
    points = summarize(workdir)
    if not points:
        raise ValueError(f"{workdir}: no complete branch point to build a schedule from; "
                         "finish the branch study first (cbs-branch)")
    steps: list[tuple[int, int]] = []
    best = 0
    for p in points:
        b = max(multiple, int(p["b_star"]) // multiple * multiple)
        if b > best:
            steps.append((0 if not steps else int(p["point_examples"]), b))
            best = b
    return {"kind": "step", "steps": tuple(steps)}


def format_b_star(p: dict[str, Any]) -> str:
    """B* as a measurement, or as the bound it is at either end of the ladder."""
    bound = "≥ " if p["censored"] else "≤ " if p["floor"] else ""
    return f"{bound}{p['b_star']:.0f}"


def _noise_records(workdir: str) -> list[dict[str, Any]]:
    return shared.read_merged(os.path.join(workdir, files.REFERENCE_NOISE_FILE),
                              files.REFERENCE_POINT_KEYS)


def summary_table(points: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per branch point."""
    noise = any(math.isfinite(p.get("b_simple", math.nan)) for p in points)
    head = "| examples seen | Δ | k* | B* | B* per seed | loss at k=1 |"
    lines = [head + (" B_simple | B_noise |" if noise else ""),
             "|---" * (8 if noise else 6) + "|"]
    for p in points:
        seeds = ", ".join(f"{v:.0f}" for v in p["b_star_seeds"])
        row = (f"| {p['point_examples']} | {p.get('window_examples', 0)} | {p['k_star']} | "
               f"{format_b_star(p)} | {seeds} | {p['losses'][0]:.3g} |")
        if noise:
            row += f" {p.get('b_simple', math.nan):.0f} | {p.get('b_noise', math.nan):.0f} |"
        lines.append(row)
    return "\n".join(lines)


def write_report(workdir: str, *, sweep_dir: str | None = None, bootstrap: int = 200) -> str:
    """Writes `workdir/report.md`; returns its text."""
    d: Any = records.read_json(os.path.join(workdir, files.DEFINITION_FILE))
    if d is None:
        raise ValueError(f"{workdir} has no {files.DEFINITION_FILE}: give the --workdir of a "
                         "branch study (cbs-branch --config=... --workdir=...)")
    b, points = d["branch"], summarize(workdir)
    tol = (f"{100 * b['epsilon']:g}% of the loss" if b["tolerance"] == "relative"
           else f"{b['epsilon']:g} nats")
    window = (f"Δ = {b['window_fraction']:g} × examples seen" if b.get("window_fraction")
              else f"Δ = {d['window_examples']} examples")
    lines = [f"# Local critical batch size: {workdir}", "",
             f"Reference: {d['optimizer']}, B = {d['reference_batch_size']}, "
             f"η_0 = {d['learning_rate']:g}. Branches: k = {tuple(b['ks'])}, f(k) = "
             f"{'√k' if b['lr_rule'] == 'sqrt' else 'k'}, {window}, seeds {tuple(b['seeds'])}.",
             f"Compared loss: `{b['metric']}`"
             + (f" (EMA decay {b['loss_ema_decay']:g} per {b.get('loss_ema_per', 'step')})"
                if b["metric"] == "loss_ema" else "")
             + f"; ε = {tol}; criterion `{b.get('criterion', 'ladder')}`; "
             f"B* = `{b.get('b_star', 'geometric')}`. "
             "\"≤ B\": k* = 1, the crossing is below 2B and the ladder cannot resolve it; "
             "\"≥ B\": k* at the top of the ladder.", "", summary_table(points), ""]
    est = [r.get("estimator") for r in _noise_records(workdir)][:1]  # None: measured none
    if est and est[0]:
        lines += [f"B_simple, B_noise at each point: {est[0]}.", ""]
    if sweep_dir:
        sw = swept_b_crit(sweep_dir, workdir, bootstrap=bootstrap)
        lines += ["Swept B_crit (fit of S/S_min = 1 + B_crit/B; interval: 95% bootstrap over "
                  f"{bootstrap} resamples), placed where the reference's full training-set "
                  "loss (without one: its eval loss) first reaches the target:", "",
                  "| target L | reference crosses at (examples) | B_crit | interval |",
                  "|---|---|---|---|"]
        lines += [f"| {s['target']:g} | {s['examples']:.0f} | {s['b_crit']:.3g} | "
                  f"{s['lo']:.3g}–{s['hi']:.3g} |" for s in sw]
        lines.append("")
    text = "\n".join(lines)
    records.write_atomic(os.path.join(workdir, files.REPORT_FILE), text)
    return text


def _reference_curves(workdir: str) -> dict[str, np.ndarray]:
    recs = records.read_records(os.path.join(workdir, REFERENCE_METRICS))
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    col = lambda rs, k: np.asarray([r.get(k, np.nan) for r in rs], np.float64)
    noise = ("ema_b_simple", "b_simple", "b_noise", "measured_ema_b_simple", "measured_ema_b_noise")
    return {"E": col(train, "data/examples_seen"), "loss": col(train, "train/loss"),
            "eval_E": col(evals, "data/examples_seen"), "full_train": col(evals, "full_train/loss"),
            "eval_loss": col(evals, "eval/loss"), **{k: col(train, f"noise/{k}") for k in noise}}


def swept_b_crit(sweep_dir: str, workdir: str, *, bootstrap: int = 200
                 ) -> list[dict[str, float]]:
    """The sweep's B_crit per target reached, at the examples where the reference run's
    full training-set loss (without one, its `eval/loss`) first reaches it."""
    analysis = report.analyze(sweep_dir, bootstrap=bootstrap, write=False)
    ref = _reference_curves(workdir)
    curve = ref["full_train"] if np.isfinite(ref["full_train"]).any() else ref["eval_loss"]
    out = []
    for t in analysis["targets"]:
        f = t["fit"]
        hit = np.nonzero(curve <= t["target"])[0]
        if f["status"] != "ok" or not len(hit):
            continue
        lo, hi = f["b_crit_ci"] or (math.nan, math.nan)
        out.append({"target": t["target"], "examples": float(ref["eval_E"][hit[0]]),
                    "b_crit": f["b_crit"], "lo": lo, "hi": hi})
    return out


def plot_local_cbs(workdir: str, *, sweep_dir: str | None = None, path: str | None = None,
                   bootstrap: int = 200) -> str:
    """Writes the figure of B*, the noise scales, the swept B_crit and the loss; its path."""
    from matplotlib.figure import Figure  # no pyplot: no backend or global state is touched

    points, ref = summarize(workdir), _reference_curves(workdir)
    fig = Figure(figsize=(8, 6.5))
    ax = fig.subplots()
    ok = ref["E"] > 0
    noise = _noise_records(workdir)
    if noise:  # exact on the whole training set: the study's own measurement
        e = np.asarray([r["examples_seen"] for r in noise], np.float64)
        for key, color, name in _SCALES:
            y = np.asarray([r.get(f"noise/{key}", np.nan) for r in noise], np.float64)
            m = np.isfinite(y) & (y > 0) & (e > 0)
            ax.plot(e[m], y[m], "o-", color=color, ms=3, lw=1.2,
                    label=f"{name} (exact, all {noise[0]['num_examples']} training examples)")
    else:
        ax.plot(ref["E"][ok], ref["ema_b_simple"][ok], color="tab:blue", lw=1, alpha=0.7,
                label="B_simple (two-batch EMA)")
        for key, color, name in _SCALES:
            m = ok & np.isfinite(ref[key]) & (ref[key] > 0)
            if m.any():
                ax.scatter(ref["E"][m], ref[key][m], s=10, color=color, alpha=0.5,
                           label=f"{name} (in-run, measured batch)")
                ema = ref[f"measured_ema_{key}"]
                ax.plot(ref["E"][m], ema[m], color=color, ls="--", lw=1.5,
                        label=f"{name} (in-run EMA)")
    if points:
        x = np.asarray([p["point_examples"] for p in points], np.float64)
        y = np.asarray([p["b_star"] for p in points])
        err = np.stack([y - [p["b_star_lo"] for p in points],
                        np.asarray([p["b_star_hi"] for p in points]) - y])
        ax.errorbar(x, y, yerr=np.clip(err, 0, None), fmt="none", color="black", capsize=4)
        cens = np.asarray([p["censored"] for p in points])
        floor = np.asarray([p["floor"] for p in points]) & ~cens
        mid = ~cens & ~floor
        ax.scatter(x[mid], y[mid], marker="o", s=45, color="black",
                   label="local CBS B* = k*·B (branched; bars: range over seeds)")
        if floor.any():
            ax.scatter(x[floor], y[floor], marker="v", s=80, color="black",
                       label="B* ≤ B (k* = 1, bottom of the k ladder)")
        if cens.any():
            ax.scatter(x[cens], y[cens], marker="^", s=80, color="black",
                       label="B* ≥ k_max·B (top of the k ladder)")
    if sweep_dir:
        sw = swept_b_crit(sweep_dir, workdir, bootstrap=bootstrap)
        if sw:
            xs = np.asarray([s["examples"] for s in sw])
            ys = np.asarray([s["b_crit"] for s in sw])
            lo, hi = np.asarray([s["lo"] for s in sw]), np.asarray([s["hi"] for s in sw])
            ax.errorbar(xs, ys, yerr=np.nan_to_num(np.clip([ys - lo, hi - ys], 0, None)),
                        fmt="s", color="tab:red", ms=7, capsize=4,
                        label="swept B_crit at target loss (95% CI)")
            for s in sw:
                ax.annotate(f"L={s['target']:g}", (s["examples"], s["b_crit"]), fontsize=7,
                            xytext=(4, 4), textcoords="offset points", color="tab:red")
    ax.set(xscale="log", yscale="log", xlabel="examples seen by the reference run",
           ylabel="batch size (examples)")
    if noise:  # the study's span, not the reference's first steps
        ax.set_xlim(left=0.7 * min(r["examples_seen"] for r in noise if r["examples_seen"]))
        ax.set_ylim(2, 5e3)
    else:
        ax.set_ylim(3, 3e4)  # the per-step two-batch estimate spikes where |G|² ≈ 0
    ax2 = ax.twinx()
    ax2.plot(ref["E"][ok], _ema(ref["loss"][ok], 0.9), color="gray", lw=1, label="train loss (EMA)")
    if np.isfinite(ref["full_train"]).any():
        ax2.plot(ref["eval_E"], ref["full_train"], color="gray", ls=":", label="full train loss")
    elif np.isfinite(ref["eval_loss"]).any():
        ax2.plot(ref["eval_E"], ref["eval_loss"], color="gray", ls=":", label="eval loss")
    ax2.set(yscale="log", ylabel="loss (nats)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13),
              ncol=2)
    ax.set_title("Local critical batch size vs noise scale vs swept B_crit")
    fig.tight_layout()
    path = path or os.path.join(workdir, "local_cbs.png")
    return plots.save_figure(fig, path)


def _ema(x: np.ndarray, decay: float) -> np.ndarray:
    out, e = np.empty(len(x)), math.nan
    for i, v in enumerate(x):
        e = v if math.isnan(e) else decay * e + (1 - decay) * v
        out[i] = e
    return out
