"""Held-out seeds: each best learning rate selected on one seed, its steps measured on the others.

Letters: B batch size, η learning rate, S optimizer steps to a target loss L. The fewest S over
η is biased low (the minimum of noisy S), so η*(B, L) is selected on seed k alone, S at (B, η*)
measured on every other seed, and S = S_min + E_min/B fitted through their mean, beside the
in-sample fit on the same seeds (docs/guides/sweeps.md, "Seeds"). A B whose held-out trial never
crossed L, or was stopped by a faster rate (`sweep.stop_when_dominated`: censored), is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.analysis.fits import fit
from cbs.results.store import target_key

__all__ = ["DOMINATED", "held_out", "held_out_target"]

DOMINATED = "dominated"  # the status of a trial its group stopped once another rate crossed


def _steps(record: dict[str, Any], key: str) -> float | None:
    s = record["steps_to_target"].get(key)
    return float(s) if s is not None and math.isfinite(float(s)) else None


def held_out_target(records: Sequence[dict[str, Any]], target: float, select_on_seed: int, *,
                    bootstrap: int = 200) -> dict[str, Any]:
    """One target: η* per B from seed `select_on_seed`, S at η* on the other seeds, both fits.
    JSON-ready: "rows" (per B: rate, steps on the selecting seed and held out, their mean,
    the in-sample mean and the ratio, or why B is left out), "fit", "fit_in_sample"."""
    key = target_key(target)
    seeds = sorted({int(r.get("seed", 0)) for r in records})
    others = [s for s in seeds if s != select_on_seed]
    cell = {(float(r["batch_size"]), int(r.get("seed", 0)), float(r["learning_rate"])): r
            for r in records}
    rows = []
    for b in sorted({float(r["batch_size"]) for r in records}):
        chosen = [(s, lr) for (bb, sd, lr), r in cell.items()
                  if bb == b and sd == select_on_seed and (s := _steps(r, key)) is not None]
        row: dict[str, Any] = {"batch_size": b}
        if not chosen:
            rows.append(row | {"left_out": f"seed {select_on_seed} never reached L"})
            continue
        s_sel, lr = min(chosen)
        held = {sd: cell.get((b, sd, lr)) for sd in others}
        steps = {sd: _steps(r, key) if r else None for sd, r in held.items()}
        row |= {"learning_rate": lr, "selected_steps": s_sel,
                "held_out_steps": {str(sd): v for sd, v in steps.items()}}
        if any(v is None for v in steps.values()):
            censored = sum(1 for r in held.values() if r and r.get("status") == DOMINATED)
            row["left_out"] = (f"{censored} held-out trial(s) stopped by a faster rate "
                               "(censored)" if censored else "a held-out seed never reached L")
            rows.append(row)
            continue
        own = [min(s for (bb, sd2, _), r in cell.items() if bb == b and sd2 == sd
                   and (s := _steps(r, key)) is not None) for sd in others]
        row |= {"steps": float(np.mean(list(steps.values()))),
                "in_sample_steps": float(np.mean(own))}
        row["ratio"] = row["steps"] / row["in_sample_steps"]
        rows.append(row)
    used = [r for r in rows if "steps" in r]
    sizes = [r["batch_size"] for r in used]
    held_fit = fit.fit_tradeoff(sizes, [r["steps"] for r in used], bootstrap=bootstrap)
    own_fit = fit.fit_tradeoff(sizes, [r["in_sample_steps"] for r in used], bootstrap=bootstrap)
    return {"target": float(target), "select_on_seed": int(select_on_seed),
            "measured_on_seeds": others, "rows": rows, "fit": held_fit.to_dict(),
            "fit_in_sample": own_fit.to_dict(),
            "median_ratio": float(np.median([r["ratio"] for r in used])) if used else None}


def held_out(records: Sequence[dict[str, Any]], targets: Sequence[float], select_on_seed: int,
             *, bootstrap: int = 200) -> list[dict[str, Any]]:
    """`held_out_target` at every target; ValueError unless another seed is left to measure on."""
    seeds = sorted({int(r.get("seed", 0)) for r in records})
    if select_on_seed not in seeds or len(seeds) < 2:
        raise ValueError(f"--select_on_seed={select_on_seed}: the sweep has seeds {seeds}; "
                         "give one of them, in a sweep with at least two (sweep.seeds)")
    return [held_out_target(records, t, select_on_seed, bootstrap=bootstrap) for t in targets]
