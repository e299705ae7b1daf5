"""The payoff of measuring on digits: ramps against fixed batch sizes, three seeds each.

    cbs-ramps --config=digits_payoff --sweep_dir=results/digits --out_dir=results/digits_payoff

Reads the main job's sweep (results/digits: learning rates) and the local-CBS study
(results/digits_branch: the "local CBS" ramp's schedule, 8 → 16 → 32); writes only to
out_dir. `cbs.analysis.studies.payoff` fits the frontier to the fixed batch sizes and reports
each ramp's step saving at equal examples with a bootstrap interval over seeds (payoff.md).
Each fixed baseline runs at every rate that is the sweep's best at its B for some target
("fixed B=… · η=…"), so that it is tuned per target.

`--config=digits_payoff:start` (out_dir results/digits_ramp_start) is Merrill et al.'s
comparison alone: the four ramps and the fixed runs at each ramp's first batch size (tuned
per target), on seeds 0 … 21, seed by seed (22: the most a 15 % saving needed at the spread
twelve seeds measured).
"""

from __future__ import annotations

import os

from cbs.analysis.reports import branch_report
from cbs.analysis.studies import ramp_start
from cbs.configs import base, digits_ramps
from cbs.results.store import SweepStore

__all__ = [
    "BRANCH_DIR", "FIXED", "SEEDS", "START_SEEDS", "SWEEP_DIR", "get_config", "local_cbs_ramp",
    "target_rates", "tuned_fixed",
]

SEEDS = (0, 1, 2)
START_SEEDS = tuple(range(22))  # ":start": the seeds of the ramp-against-its-start study
FIXED = (16, 32, 64, 128, 256)
BRANCH_DIR = "results/digits_branch"  # the local-CBS study this config reads
SWEEP_DIR = "results/digits"  # the sweep whose per-target best rates the fixed runs add


def target_rates(sweep_dir: str, batch_size: int) -> dict[str, float]:
    """target key -> the sweep's fastest learning rate at `batch_size` for that target (one
    seed's fewest steps; targets no trial at B reached are left out)."""
    trials = [r for r in SweepStore(sweep_dir).records() if r["batch_size"] == batch_size]
    keys = sorted({k for r in trials for k in r["steps_to_target"]}, key=float)
    reached = {k: [r for r in trials if r["steps_to_target"].get(k) is not None] for k in keys}
    return {k: float(min(rows, key=lambda r: r["steps_to_target"][k])["learning_rate"])
            for k, rows in reached.items() if rows}


def tuned_fixed(sweep_dir: str, batch_size: int) -> list[dict]:
    """Fixed runs at B for every per-target best rate of the sweep other than "best@B" (the
    lowest target's), labelled "fixed B=… · η=…"."""
    rates = target_rates(sweep_dir, batch_size)
    lowest = rates[min(rates, key=float)] if rates else None
    return [digits_ramps.fixed(batch_size) | {"label": f"fixed B={batch_size} · η={lr:.4g}",
                                              "learning_rate": lr}
            for lr in sorted(set(rates.values())) if lr != lowest]


def local_cbs_ramp(branch_dir: str, micro_batch: int) -> dict:
    """A ramp through a branched study's B*(examples) (`digits_ramps._ramp`)."""
    schedule = branch_report.local_cbs_schedule(branch_dir, multiple=micro_batch)
    return digits_ramps._ramp("local CBS", schedule, schedule["steps"][0][1]) | {
        "micro_batch": micro_batch}


def start_runs(ramps: list[dict], sweep_dir: str) -> list[dict]:
    """The ramps, and the fixed runs at each ramp's first batch size B_0 at every rate that is
    the sweep's best at B_0 for some target (tuned per target, as in the payoff study)."""
    starts = sorted({b for r in ramps if (b := ramp_start.start_batch_size(r)) is not None})
    return list(ramps) + [run for b in starts
                          for run in [digits_ramps.fixed(b), *tuned_fixed(sweep_dir, b)]]


def get_config(arg: str = ""):
    words = base.parse_arg(arg, ("tiny", "start"))
    c = digits_ramps.get_config(",".join(sorted(words & {"tiny"})))
    if "tiny" in words:  # the tiny sweep's batch sizes; two seeds; no branch study needed
        runs = [digits_ramps.fixed(b) for b in (8, 32, 128)] + [
            r for r in c.ramps if not r["label"].startswith("fixed")]
        c.ramps = base.seeded(runs, (0, 1))
        return c
    ramps = {r["label"]: r for r in c.ramps}
    sweep_dir = os.path.join(base.repo_root(), SWEEP_DIR)
    measured = [ramps["adaptive"] | {"label": "adaptive (B_simple)"},
                local_cbs_ramp(os.path.join(base.repo_root(), BRANCH_DIR), 8),
                ramps["step (Llama 3)"], ramps["linear (DeepSeek-V3)"]]
    if "start" in words:  # each ramp against the fixed run at its first B, seed-major
        runs = start_runs(measured, sweep_dir)
        c.ramps = [run for s in START_SEEDS for run in base.seeded(runs, (s,))]
        return c
    runs = [digits_ramps.fixed(b) for b in FIXED] + measured + [
        run for b in FIXED for run in tuned_fixed(sweep_dir, b)]
    c.ramps = base.seeded(runs, SEEDS)
    return c
