"""A ramp against the fixed run at its starting batch size, seed by seed: the comparison
Merrill et al. (2025) report (43 % fewer steps for OLMo 1B with batch-size warmup against the
run that keeps the small batch; docs/guides/ramps.md).

For a ramp whose schedule starts at B_0 and the fixed run at B_0 with the same seeds (a
paired design), at each target L and seed s, with S the steps and E the examples to reach L:

    r_s = log(S_ramp,s / S_fixed,s)    q_s = log(E_ramp,s / E_fixed,s)

Steps saved: 1 − exp(mean r); examples beside: exp(mean q) − 1. Intervals: a percentile
bootstrap over seed pairs and the paired Student-t interval of mean r. Seeds needed: the
fewest n for which a two-sided paired t-test at level α detects a saving of `effect` with
probability `power`: power(n) = P(|T| > t_{1−α/2, n−1}), T noncentral t with n − 1 degrees
of freedom and noncentrality −log(1 − effect)·√n/σ, σ from the seeds run.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

__all__ = [
    "ALPHA", "EFFECT", "POWER", "compare", "recorded_rng", "detectable_effect", "paired_power",
    "seeds_needed", "start_batch_size", "summary_lines", "table", "verdict",
]

EFFECT = 0.15  # the step saving to detect (15 % fewer steps)
ALPHA = 0.05  # two-sided level of the paired t-test
POWER = 0.8  # probability of detecting EFFECT


def recorded_rng(recorded: str) -> np.random.Generator:
    """A generator seeded from the recorded values (JSON text) a bootstrap resamples."""
    return np.random.default_rng(int(hashlib.sha256(recorded.encode()).hexdigest()[:16], 16))


def start_batch_size(spec: dict[str, Any]) -> int | None:
    """B_0, the first batch size of a ramp spec's schedule (None if unknown)."""
    sched = spec.get("schedule", {})
    kind = sched.get("kind")
    if kind == "constant":
        return int(sched["batch_size"])
    if kind == "step":
        return int(sorted(sched["steps"])[0][1])
    if kind == "linear":
        return int(sched["start"])
    if kind == "adaptive":
        return int(sched.get("initial", sched.get("min_batch")))
    return None


def paired_power(n: int, sd: float, effect: float = EFFECT, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test with n pairs (log-ratio σ `sd`) against `effect`."""
    if n < 2:
        return 0.0
    delta = -math.log1p(-effect)
    if sd <= 0:
        return 1.0
    df, nc = n - 1, delta * math.sqrt(n) / sd
    crit = stats.t.ppf(1 - alpha / 2, df)
    p = float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    if not math.isfinite(p):  # scipy's noncentral t fails far in its tail: there, power is 1
        return 1.0 if nc > crit else 0.0
    return p


def seeds_needed(sd: float, effect: float = EFFECT, alpha: float = ALPHA, power: float = POWER,
                 max_seeds: int = 10_000) -> int | None:
    """The fewest seeds for `power` against `effect` (None: σ not finite, or > max_seeds)."""
    if not math.isfinite(sd):
        return None
    lo, hi = 2, 2
    while paired_power(hi, sd, effect, alpha) < power:
        if hi >= max_seeds:
            return None
        lo, hi = hi, min(2 * hi, max_seeds)
    while lo < hi:  # power grows with n: the smallest n with enough
        mid = (lo + hi) // 2
        if paired_power(mid, sd, effect, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return hi


def detectable_effect(n: int, sd: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest step saving detected with `power` from n seeds (NaN: n < 2, σ not finite)."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if paired_power(n, sd, mid, alpha) >= power else (mid, hi)
    return hi


def _paired(ramp: Sequence[dict[str, Any]], fixed: Sequence[dict[str, Any]], key: str
            ) -> tuple[list[int], np.ndarray, np.ndarray, str]:
    """Seeds both runs reached L with, the per-seed log ratios of steps and examples, and the
    recorded values as text (the generator's seed: logarithms' last bit may vary by machine)."""
    def by_seed(runs):
        return {int((r.get("spec") or {}).get("seed", 0)): r for r in runs
                if r["steps_to_target"].get(key) is not None
                and r["examples_to_target"].get(key) is not None}
    a, b = by_seed(ramp), by_seed(fixed)
    seeds = sorted(set(a) & set(b))
    raw = [[x[s][f][key] for x in (a, b) for f in ("steps_to_target", "examples_to_target")]
           for s in seeds]
    r = np.log([a_s / b_s for a_s, _, b_s, _ in raw])
    q = np.log([a_e / b_e for _, a_e, _, b_e in raw])
    return seeds, np.asarray(r, np.float64), np.asarray(q, np.float64), json.dumps([seeds, raw])


def compare(ramp: Sequence[dict[str, Any]], fixed: Sequence[dict[str, Any]], key: str, *,
            bootstrap: int = 1000, confidence: float = 0.95) -> dict[str, Any]:
    """One ramp's seeds against the fixed run at its B_0 at target `key`, JSON-ready."""
    seeds, r, q, recorded = _paired(ramp, fixed, key)
    out: dict[str, Any] = {"seeds": seeds, "num_pairs": len(seeds),
                           "reached": [sum(x["steps_to_target"].get(key) is not None
                                           for x in runs) for runs in (ramp, fixed)]}
    if len(seeds) < 2:
        return out
    sd = float(r.std(ddof=1))
    half = stats.t.ppf(0.5 + confidence / 2, len(r) - 1) * sd / math.sqrt(len(r))
    rng = recorded_rng(recorded)
    idx = rng.integers(0, len(r), (bootstrap, len(r)))
    pct = (50 * (1 - confidence), 50 * (1 + confidence))
    boot_r, boot_q = (np.percentile(x[idx].mean(axis=1), pct) for x in (r, q))
    return out | {
        "step_saving": float(1 - math.exp(r.mean())),
        "step_saving_ci": (float(1 - math.exp(boot_r[1])), float(1 - math.exp(boot_r[0]))),
        "step_saving_t_ci": (float(1 - math.exp(r.mean() + half)),
                             float(1 - math.exp(r.mean() - half))),
        "example_ratio": float(math.exp(q.mean()) - 1),
        "example_ratio_ci": (float(math.exp(boot_q[0]) - 1), float(math.exp(boot_q[1]) - 1)),
        "sd_log_steps": sd, "seeds_needed": seeds_needed(sd),
        "detectable_saving": detectable_effect(len(r), sd)}


def _unmoved(row: dict[str, Any]) -> bool:
    """The ramp took the fixed run's steps on every seed (to 1e-4): it had not left B_0 by L."""
    return row["sd_log_steps"] < 1e-4 and abs(row["step_saving"]) < 1e-4


def verdict(row: dict[str, Any]) -> str:
    """The paired t interval of the steps saved, in words."""
    if row.get("fixed_run") is None:
        return f"no fixed run at B = {row.get('start_batch_size')}"
    if "step_saving" not in row:
        return f"{row['num_pairs']} seed pair(s) reached L"
    lo, hi = row["step_saving_t_ci"]
    if _unmoved(row):
        return "the fixed run's steps (the ramp had not left B_0)"
    examples = ("no more examples" if row["example_ratio"] <= 0 else
                f"{_pct(row['example_ratio'])} examples")
    if lo > 0:
        return f"fewer steps than the fixed run, {examples}"
    if hi < 0:
        return f"more steps than the fixed run, {examples}"
    return f"not distinguished with {row['num_pairs']} seeds"


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per ramp at one target."""
    lines = [f"| ramp | first B | fixed run at it | seed pairs | steps saved at L (95 % "
             f"bootstrap; paired t) | examples vs fixed (95 % bootstrap) | σ of log step ratio "
             f"| seeds for {EFFECT:.0%} ({POWER:.0%} power) | saving detectable with these "
             "seeds | verdict |", "|---" * 10 + "|"]
    for row in rows:
        cells = [row["run"], str(row.get("start_batch_size") or "–"),
                 row.get("fixed_run") or "–"]
        if "step_saving" in row:
            bl, bh = row["step_saving_ci"]
            tl, th = row["step_saving_t_ci"]
            el, eh = row["example_ratio_ci"]
            need = row["seeds_needed"]
            cells += [str(row["num_pairs"]),
                      f"{_pct(row['step_saving'])} ({_pct(bl)} to {_pct(bh)}; "
                      f"{_pct(tl)} to {_pct(th)})",
                      f"{_pct(row['example_ratio'])} ({_pct(el)} to {_pct(eh)})",
                      f"{row['sd_log_steps']:.3f}",
                      "–" if _unmoved(row) else (str(need) if need else "> 10,000"),
                      "–" if _unmoved(row) else f"{100 * row['detectable_saving']:.0f} %"]
        else:
            cells += [str(row.get("num_pairs", "–"))] + ["–"] * 5
        lines.append("| " + " | ".join(cells + [verdict(row)]) + " |")
    return "\n".join(lines)


def summary_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    """One line per ramp over the targets of `cbs.analysis.studies.payoff.analyze`, then the
    range of seeds needed where the ramp had left its first batch size."""
    out, needed = [], []
    for name in [row["run"] for row in targets[0]["start"]]:
        parts = []
        for t in targets:
            row = next(r for r in t["start"] if r["run"] == name)
            if "step_saving" not in row:
                parts.append(f"L={t['target']:g}: {verdict(row)}")
                continue
            lo, hi = row["step_saving_t_ci"]
            moved = not _unmoved(row)
            if moved and row["seeds_needed"]:
                needed.append(row["seeds_needed"])
            parts.append(f"L={t['target']:g}: {_pct(row['step_saving'])} ({_pct(lo)} to "
                         f"{_pct(hi)}), examples {_pct(row['example_ratio'])}, "
                         f"{row['seeds_needed'] if moved else '–'} seeds")
        b0 = next(r for r in targets[0]["start"] if r["run"] == name)["start_batch_size"]
        out.append(f"- **{name}** against fixed B = {b0} (its fastest rate at each L; steps "
                   "saved, paired t interval; examples beside; seeds for "
                   f"{EFFECT:.0%} at {POWER:.0%} power): " + "; ".join(parts) + ".")
    if needed:
        out.append(f"- Seeds needed to detect {EFFECT:.0%} fewer steps ({POWER:.0%} power, "
                   f"paired t at {ALPHA:g}), over the ramps and targets where the ramp had left "
                   f"its first batch size: {min(needed)}–{max(needed)} (median "
                   f"{int(np.median(needed))}).")
    return out
