"""Learning-rate grids that bracket the optimum: edges, caps and factor-2 extensions
(docs/guides/sweeps.md). A best learning rate (`cbs.analysis.fits.selection`) at an edge of
its grid makes S(B) only an upper bound. From the finished records alone (so shards and reruns
agree) the rule decides which further rates a sweep must try at a batch size:

- best rate (for any target) the largest tried → `count` more rates above it, each a factor 2
  beyond the last (never above `max_lr`; the cap itself when the next factor would pass it);
- the smallest tried → `count` rates below it, never below `min_lr`;
- at most `steps` such rates on each side of the base grid (rounds × count);
- only once every trial at the batch size (all seeds, all rates) has a record.

A best rate at `max_lr` (or `min_lr`) is "capped"; one at an edge after the last allowed step
is "edge". Works on plain dicts (sweep.json's sweep section, the records of trials.jsonl).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cbs.analysis.fits import selection
from cbs.results.store import target_key

__all__ = [
    "CAPPED", "HIGH", "LOW", "edge_directions", "extension_rules", "grid_at_batch_size",
    "grid_status", "next_learning_rates", "step_of", "sweep_grid",
]

HIGH, LOW, CAPPED = "high", "low", "capped"
_REL = 1e-9  # learning rates equal to this relative precision are the same rate


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= _REL * max(abs(a), abs(b))


def extension_rules(sweep: Mapping[str, Any]) -> dict[str, float]:
    """count, steps (per side), max_lr and min_lr (0 = none) from a sweep section (a dict)."""
    count = int(sweep.get("extend_lr_count", 1))
    return {"count": count, "steps": int(sweep.get("extend_lr_rounds", 0)) * count,
            "max_lr": float(sweep.get("max_lr", 0.0) or 0.0),
            "min_lr": float(sweep.get("min_lr", 0.0) or 0.0)}


def edge_directions(records: Sequence[Mapping[str, Any]], targets: Iterable[float],
                    lrs: Sequence[float], rules: Mapping[str, float]) -> dict[str, str]:
    """Per target key, where the best rate at one batch size sits: "high" (largest tried),
    "low" (smallest) or "capped" (at max_lr/min_lr); absent inside the grid or unreached. One
    seed's own best rate at an edge puts the batch size there; "high" comes first."""
    out = {}
    top, bottom = max(lrs), min(lrs)
    for target in targets:
        key = target_key(target)
        rows = [{"batch_size": r["batch_size"], "learning_rate": r["learning_rate"],
                 "seed": int(r.get("seed", 0) or 0), "steps": r["steps_to_target"].get(key)}
                for r in records]
        best = selection.best_per_batch_size(rows)
        if best.batch_sizes.size == 0:
            continue
        seed_lrs = [float(x) for x in best.seed_learning_rates[0]]
        at_top = any(_same(lr, top) for lr in seed_lrs)
        at_bottom = any(_same(lr, bottom) for lr in seed_lrs)
        up_capped = bool(rules["max_lr"]) and top >= rules["max_lr"] * (1 - _REL)
        down_capped = bool(rules["min_lr"]) and bottom <= rules["min_lr"] * (1 + _REL)
        if at_top and not up_capped:
            out[key] = HIGH
        elif at_bottom and not down_capped:
            out[key] = LOW
        elif at_top or at_bottom:
            out[key] = CAPPED
    return out


def step_of(lr: float, base_lrs: Sequence[float]) -> tuple[str, int]:
    """("high", k) for the k-th rate above the base grid, ("low", k) below; ("base", 0)."""
    top, bottom = max(base_lrs), min(base_lrs)
    if lr > top * (1 + _REL):
        return HIGH, max(1, math.ceil(math.log2(lr / top) - 1e-6))
    if lr < bottom * (1 - _REL):
        return LOW, max(1, math.ceil(math.log2(bottom / lr) - 1e-6))
    return "base", 0


def next_learning_rates(lrs: Sequence[float], base_lrs: Sequence[float], direction: str,
                        rules: Mapping[str, float]) -> list[float]:
    """Up to `count` rates beyond the current edge in `direction`, a factor 2 apart."""
    out: list[float] = []
    if direction not in (HIGH, LOW):
        return out
    up = direction == HIGH
    k0 = step_of(max(lrs) if up else min(lrs), base_lrs)[1]
    for k in range(k0 + 1, min(k0 + int(rules["count"]), int(rules["steps"])) + 1):
        lr = (min(max(base_lrs) * 2.0 ** k, rules["max_lr"] or math.inf) if up
              else max(min(base_lrs) / 2.0 ** k, rules["min_lr"]))
        beyond = lr > max(lrs) * (1 + _REL) if up else lr < min(lrs) * (1 - _REL)
        if beyond and not any(_same(lr, x) for x in out):
            out.append(lr)
    return out


def grid_at_batch_size(base_lrs: Sequence[float], seeds: Sequence[int],
                       records: Sequence[Mapping[str, Any]], targets: Sequence[float],
                       rules: Mapping[str, float]) -> dict[str, Any]:
    """The learning rates one batch size must try given its finished records: the base grid
    extended while every (rate, seed) has a record and some best rate is at an extendable
    edge. Returns {"lrs" (sorted), "complete" (every (rate, seed) has a record), "edges" (per
    target key the best rate's final position), "records" (those in the grid)}."""
    lrs = sorted(float(x) for x in base_lrs)
    done: dict[tuple[float, int], Mapping[str, Any]] = {}
    for r in records:
        done.setdefault((float(r["learning_rate"]), int(r["seed"])), r)

    def find(lr: float, seed: int) -> Mapping[str, Any] | None:
        return next((r for (x, s), r in done.items() if s == seed and _same(x, lr)), None)

    while True:
        found = [find(lr, int(s)) for lr in lrs for s in seeds]
        complete = all(r is not None for r in found)
        mine = [r for r in found if r is not None]
        edges = edge_directions(mine, targets, lrs, rules) if complete and mine else {}
        new = [lr for d in (HIGH, LOW) if d in edges.values()
               for lr in next_learning_rates(lrs, base_lrs, d, rules)]
        if not complete or not new:
            return {"lrs": lrs, "complete": complete, "edges": edges, "records": mine}
        lrs = sorted(lrs + new)


def sweep_grid(base: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
               sweep: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """`grid_at_batch_size` per batch size; base: sweep.json's "trials", sweep: its section."""
    rules = extension_rules(sweep)
    out = {}
    for b in sorted({int(t["batch_size"]) for t in base}):
        base_lrs = sorted({float(t["learning_rate"]) for t in base if t["batch_size"] == b})
        seeds = sorted({int(t["seed"]) for t in base if t["batch_size"] == b})
        at_b = [r for r in records if int(r["batch_size"]) == b]
        out[b] = grid_at_batch_size(base_lrs, seeds, at_b, sweep["targets"], rules) | {
            "seeds": seeds, "base_lrs": base_lrs}
    return out


def grid_status(definition: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
                ) -> dict[str, Any]:
    """What a sweep directory holds against what its grid needs (sweep.json's "trials"; without
    them the records are the grid: "known" False): "complete", "num_expected" (a lower bound
    while trials are missing), "missing" {B: count}, "records" (those in the grid), "edges"."""
    base = definition.get("trials") if definition else None
    if not base:
        return {"known": False, "complete": True, "num_expected": len(records),
                "num_missing": 0, "missing": {}, "records": list(records), "edges": {}}
    state = sweep_grid(base, records, definition["sweep"])
    need = {b: len(st["lrs"]) * len(st["seeds"]) for b, st in state.items()}
    missing = {b: n - len(state[b]["records"]) for b, n in need.items()
               if n != len(state[b]["records"])}
    num_missing = sum(missing.values())
    return {"known": True, "complete": num_missing == 0, "num_expected": sum(need.values()),
            "num_missing": num_missing, "missing": missing,
            "records": sorted((r for st in state.values() for r in st["records"]),
                              key=lambda r: r["index"]),
            "edges": {b: st["edges"] for b, st in state.items()}}
