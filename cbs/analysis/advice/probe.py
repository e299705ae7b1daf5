"""The task's own ratio of local B_crit to the noise scale, from short branches off a checkpoint,
and its combination with the calibration's cross-task prior (docs/guides/advice.md, "The
task's own calibration (probe)").

Letters: B the run's batch at the checkpoint, b_0 the probe's smallest batch, K the ladder of
multipliers k (branch batch k·b_0), S the data-order seeds, Δ the window in examples (the same
for every k), E and t the examples and steps the run has seen, B_s the noise scale at the
checkpoint, φ the budget as a fraction of the run so far.

Local B_crit: Merrill et al.'s criterion (`cbs.analysis.reports.branch_report`) at the
log-midpoint √(k*·k⁺)·b_0 of the bracket [k*·b_0, k⁺·b_0), se² = sd_seeds² + sd_ladder² in log
space: sd_ladder = log(k⁺/k*)/√12, sd_seeds over the exact bootstrap of the seeds (all S^S
resamples; 2,000 random ones past S = 5). At either end of the ladder B* is a bound: no ratio.
The probed log ratio is y = log(B*/B_s).

Combination (`cbs.analysis.advice.calibration`): the task's mean log ratio θ has the prior
N(μ̂_f, v_0), v_0 = τ̂² + var(μ̂_f), and the probe measures y ~ N(θ, se²); the posterior has
1/v_1 = 1/v_0 + 1/se², m_1 = v_1·(μ̂_f/v_0 + y/se²), and one run's B_crit at a target is
predicted as log B_s + m_1 ± t_{q,ν}·√(v_1 + σ̂²). This ASSUMES the task's local B*/B_s equals
its swept B_crit/B_s (tested in `cbs.analysis.advice.probe_evidence`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits.fit import g3
from cbs.analysis.reports import branch_report
from cbs.results.calibration import family, t_quantile

__all__ = [
    "DEFAULT_BUDGET", "UNITS", "calibration_with", "combine", "cost", "ladder", "local_ratio",
    "plan", "summary",
]

DEFAULT_BUDGET = 0.1  # φ: the probe's branches at most 10 % of the run so far
UNITS = ("examples", "steps")  # what the budget counts
BOOTSTRAP_EXACT_SEEDS = 5  # up to this many seeds, every one of the S^S resamples
_RANDOM_RESAMPLES = 2000


def ladder(batch_size: int, batch_sizes: Sequence[int] = ()) -> tuple[int, tuple[int, ...]]:
    """(b_0, K) of the probe: `batch_sizes` (multiples of the smallest) or by default B/2, B,
    2B, 4B, 8B (no B/2 when B is odd)."""
    sizes = sorted(int(b) for b in batch_sizes)
    if not sizes:
        half = [batch_size // 2] if batch_size > 1 and batch_size % 2 == 0 else []
        sizes = half + [batch_size * m for m in (1, 2, 4, 8)]
    b0 = sizes[0]
    if b0 < 1 or len(set(sizes)) < 2 or any(b % b0 for b in sizes):
        raise ValueError(f"probe batch sizes {tuple(sizes)}: give two or more distinct sizes, "
                         "each a multiple of the smallest (e.g. 32,64,128,256)")
    return b0, tuple(b // b0 for b in sizes)


def plan(*, examples_seen: int, steps_seen: int, base: int, ks: Sequence[int], seeds: int,
         budget: float = DEFAULT_BUDGET, unit: str = "examples") -> dict[str, Any]:
    """The longest window Δ (a multiple of lcm(K)·b_0) whose S·|K|·Δ examples or S·Σ_k
    Δ/(k·b_0) steps fit in φ·E or φ·t, and what it costs. ValueError when not one step of the
    largest batch fits."""
    if unit not in UNITS:
        raise ValueError(f"probe budget unit {unit!r}: use one of {UNITS}")
    if not 0 < budget <= 1:
        raise ValueError(f"probe budget {budget:g}: give a fraction of the run so far in (0, 1]")
    quantum = math.lcm(*[int(k) for k in ks]) * base  # Δ: whole steps for every k
    per_example = {"examples": seeds * len(ks), "steps": seeds * sum(1 / (k * base) for k in ks)}
    so_far = examples_seen if unit == "examples" else steps_seen
    allowed = budget * so_far
    window = int(allowed / per_example[unit] / quantum) * quantum
    if window < quantum:
        need = per_example[unit] * quantum
        raise ValueError(
            f"probe budget {budget:g} × {so_far} {unit} so far = {allowed:.4g} {unit}, below one "
            f"step of the largest probe batch ({need:.4g} {unit}: {seeds} seed(s) × batches "
            f"{tuple(k * base for k in ks)}, window {quantum} examples); raise --probe_budget "
            f"to ≥ {need / so_far:.3g}, use fewer seeds or batch sizes, or probe a later "
            "checkpoint")
    examples = seeds * len(ks) * window
    steps = seeds * sum(window // (k * base) for k in ks)
    spent = examples if unit == "examples" else steps
    return {"window": window, "examples": examples, "steps": steps, "budget": budget,
            "unit": unit, "allowed": allowed, "fraction": spent / so_far if so_far else math.inf}


def cost(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Examples and steps the branch records trained (one record per (point, k, seed))."""
    return {"examples": int(sum(int(r["steps"]) * int(r["batch_size"]) for r in rows)),
            "steps": int(sum(int(r["steps"]) for r in rows))}


def local_ratio(rows: Sequence[Mapping[str, Any]], noise_scale: float, *, epsilon: float,
                tolerance: str = "relative", metric: str = "full_train/loss",
                criterion: str = "paper") -> dict[str, Any]:
    """The probed log ratio y and its standard error from the branch records of ONE point
    (`reference_batch_size` = b_0); at a bound ("< X" or "≥ X") log_ratio and se are NaN."""
    rule: dict[str, Any] = {"epsilon": epsilon, "tolerance": tolerance, "criterion": criterion}
    p = branch_report.local_cbs([dict(r) for r in rows], metric=metric, b_star="geometric", **rule)
    ks, b0 = p["ks"], int(rows[0]["reference_batch_size"])
    out = {"b_star": p["b_star"], "b_pass": p["b_pass"], "b_fail": p["b_fail"],
           "k_star": p["k_star"], "ks": ks, "losses": p["losses"], "seeds": p["num_seeds"],
           "noise_scale": float(noise_scale), "log_ratio": math.nan, "se": math.nan,
           "sd_seeds": math.nan, "sd_ladder": math.nan, "bound": ""}
    if p["floor"] or p["censored"]:  # k⁺ fails at the bottom; nothing fails at the top
        out["bound"] = f"< {p['b_fail']:.0f}" if p["floor"] else f"≥ {p['b_pass']:.0f}"
        return out
    seeds = sorted({r["seed"] for r in rows})
    table = np.full((len(seeds), len(ks)), np.nan)
    for r in rows:
        table[seeds.index(r["seed"]), ks.index(int(r["k"]))] = float(r[metric])
    logs = []
    n = len(seeds)  # every resample with replacement up to BOOTSTRAP_EXACT_SEEDS, else 2,000
    for idx in (np.asarray(list(itertools.product(range(n), repeat=n)))
                if n <= BOOTSTRAP_EXACT_SEEDS else
                np.random.default_rng(0).integers(0, n, (_RANDOM_RESAMPLES, n))):
        losses = table[idx].mean(axis=0).tolist()
        k = branch_report.critical_multiplier(ks, losses, **rule)
        logs.append(math.log(branch_report.critical_batch(ks, k, b0, "geometric")[0]))
    sd_seeds = float(np.std(logs))
    sd_ladder = math.log(p["b_fail"] / p["b_pass"]) / math.sqrt(12.0)
    if noise_scale > 0 and math.isfinite(noise_scale):
        out["log_ratio"] = math.log(p["b_star"] / noise_scale)
        out["se"] = math.hypot(sd_seeds, sd_ladder)
    return out | {"sd_seeds": sd_seeds, "sd_ladder": sd_ladder}


def combine(model: Mapping[str, Any], optimizer: str, probed: Mapping[str, Any], *,
            level: float = 0.8) -> dict[str, Any]:
    """The cross-task and the probed prediction at the probe's noise scale, local_now (None
    at a bound) and weight (the probe's share of the task's mean log ratio). model:
    `calibration.model`'s; probed: `local_ratio`'s."""
    fam = model["families"].get(family(optimizer))
    if fam is None:
        raise ValueError(f"the calibration has no {family(optimizer)!r} study")
    mu, v0, sigma2 = fam["mu"], model["tau2"] + fam["var_mu"], model["sigma2"]
    t = t_quantile(0.5 + level / 2, model["dof"])
    log_bs = math.log(probed["noise_scale"]) if probed["noise_scale"] > 0 else math.nan
    y, se = probed["log_ratio"], probed["se"]
    if math.isfinite(y) and se > 0:
        v1 = 1.0 / (1.0 / v0 + 1.0 / se**2)
        m1, weight = v1 * (mu / v0 + y / se**2), v1 / se**2
    else:
        m1, v1, weight = mu, v0, 0.0
    target = "fixed-batch B_crit of a target loss near here (sweep protocol)"

    def prediction(m: float, v: float, predicts: str) -> dict[str, Any]:
        sd = math.sqrt(v + sigma2)
        return {"log_ratio": m, "var_task": v, "sd": sd, "ratio": math.exp(m), "predicts": predicts,
                "b_crit": math.exp(log_bs + m),
                "interval": (math.exp(log_bs + m - t * sd), math.exp(log_bs + m + t * sd))}

    local = None
    if math.isfinite(y):
        from scipy.special import ndtri

        z = float(ndtri(0.5 + level / 2))
        local = {"b_crit": probed["b_star"], "predicts": "local B_crit at this checkpoint "
                 "(Merrill et al.: the branch criterion)",
                 "interval": (probed["b_star"] * math.exp(-z * se),
                              probed["b_star"] * math.exp(z * se))}
    return {"cross_task": prediction(mu, v0, target + ", cross-task prior alone"),
            "probed": prediction(m1, v1, target + ", the prior updated by the probed ratio "
                                 "(assumes local B*/B_s = swept B_crit/B_s)"),
            "local_now": local, "weight": weight, "level": level,
            "rule": "precision weighting in log space: the task's mean log ratio N(μ, τ² + "
                    "var μ) updated by the probe's N(y, se²); interval ± t_ν √(v_1 + σ²)"}


def calibration_with(calib: Mapping[str, Any], scale: str, optimizer: str,
                     combined: Mapping[str, Any]) -> dict[str, Any]:
    """The calibration with the probed ratio for `optimizer`'s family, for live advice."""
    model = dict(calib["models"][scale])
    p, fam = combined["probed"], family(optimizer)
    model["families"] = {fam: {"mu": p["log_ratio"], "var_mu": p["var_task"],
                               "studies": model["families"][fam]["studies"]}}
    model["tau2"] = 0.0
    return dict(calib) | {"models": {scale: model}, "level": combined["level"],
                          "probed": {"scale": scale, "family": fam, "weight": combined["weight"]}}


def summary(probed: Mapping[str, Any], combined: Mapping[str, Any], spent: Mapping[str, Any],
            scale: str) -> str:
    """The probe's result and both predictions in a few lines."""
    lines = [f"probe: {probed['seeds']} seed(s) × batches "
             f"{', '.join(str(int(k * spent['base'])) for k in probed['ks'])}, window "
             f"{spent['window']} examples: {spent['examples']} examples, {spent['steps']} steps "
             f"= {100 * spent['fraction_examples']:.3g} % of the run's examples, "
             f"{100 * spent['fraction_steps']:.3g} % of its steps (budget "
             f"{100 * spent['budget']:g} % of its {spent['unit']})"]
    if probed["bound"]:
        lines.append(f"local B_crit {probed['bound']} (at the end of the probe's ladder: a "
                     "bound, no ratio; the cross-task prior alone)")
    else:
        loc = combined["local_now"]
        lines.append(f"local B_crit now = {g3(loc['b_crit'])} ({combined['level']:.0%} interval "
                     f"{g3(loc['interval'][0])}–{g3(loc['interval'][1])}; bracket "
                     f"{g3(probed['b_pass'])}–{g3(probed['b_fail'])}): ratio to {scale} "
                     f"{g3(math.exp(probed['log_ratio']))} (log se {probed['se']:.2f}: seeds "
                     f"{probed['sd_seeds']:.2f}, ladder {probed['sd_ladder']:.2f})")
    for key, name in (("cross_task", "cross-task prior"), ("probed", "with the probe")):
        p = combined[key]
        lines.append(f"fixed-batch B_crit near here, {name}: {g3(p['b_crit'])} "
                     f"({combined['level']:.0%} interval {g3(p['interval'][0])}–"
                     f"{g3(p['interval'][1])}; ratio {g3(p['ratio'])} × {scale})")
    lines.append(f"the probe's weight in the task's ratio: {combined['weight']:.2f} "
                 f"({combined['rule']}); the probed line assumes local B*/{scale} equals the "
                 f"swept B_crit/{scale} (results/probe tests it)")
    return "\n".join(lines)
