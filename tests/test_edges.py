"""Learning-rate grids extended past edge optima: the rule, its determinism, the grid status."""

import math
import random

import pytest

from cbs.analysis.fits import edges
from cbs.analysis.reports import report_tables
from cbs.sweeps import grid

RULES = {"count": 1, "steps": 4, "max_lr": 0.0, "min_lr": 0.0}


def _steps(lr: float, best_lr: float) -> float:
    """Steps to the target: a parabola in log2(lr) with its minimum at best_lr."""
    return 50.0 + 10.0 * math.log2(lr / best_lr) ** 2


def _record(b, lr, seed, best_lr, index=0):
    return {"trial_id": f"b{b}_lr{lr:.4e}_s{seed}", "index": index, "batch_size": b,
            "learning_rate": lr, "seed": seed,
            "steps_to_target": {"0.5": _steps(lr, best_lr), "0.2": 2 * _steps(lr, best_lr)}}


def _converge(base_lrs, best_lr, rules, seeds=(0,)):
    """Runs the extension rule to its end as a launcher would: record every requested trial."""
    records = []
    for _ in range(20):
        state = edges.grid_at_batch_size(base_lrs, seeds, records, (0.5, 0.2), rules)
        todo = [(lr, s) for lr in state["lrs"] for s in seeds
                if not any(r["learning_rate"] == lr and r["seed"] == s for r in records)]
        if not todo:
            return state
        records += [_record(8, lr, s, best_lr) for lr, s in todo]
    raise AssertionError("the extension did not terminate")


def test_next_rates_go_a_factor_two_past_the_edge_within_the_limits():
    base = [1.0, 2.0, 4.0]
    assert edges.next_learning_rates(base, base, "high", RULES | {"count": 2}) == [8.0, 16.0]
    assert edges.next_learning_rates([1, 2, 4, 8], base, "high", RULES) == [16.0]
    assert edges.next_learning_rates([1, 2, 4, 8, 16, 32, 64], base, "high", RULES) == []
    assert edges.next_learning_rates(base, base, "high", RULES | {"max_lr": 6.0}) == [6.0]
    assert edges.next_learning_rates([1, 2, 4, 6], base, "high", RULES | {"max_lr": 6.0}) == []
    assert edges.next_learning_rates(base, base, "low", RULES | {"count": 2}) == [0.5, 0.25]
    assert edges.next_learning_rates(base, base, "low", RULES | {"min_lr": 0.7}) == [0.7]
    assert edges.step_of(16.0, base) == ("high", 2) and edges.step_of(0.25, base) == ("low", 2)
    assert edges.step_of(6.0, base) == ("high", 1) and edges.step_of(2.0, base) == ("base", 0)


@pytest.mark.parametrize("best_lr,expected", [(16.0, [1, 2, 4, 8, 16, 32]),
                                              (0.25, [0.125, 0.25, 0.5, 1, 2, 4]),
                                              (2.0, [1, 2, 4])])
def test_extension_rounds_bring_the_optimum_inside(best_lr, expected):
    state = _converge([1.0, 2.0, 4.0], best_lr, RULES)
    assert state["lrs"] == pytest.approx(expected)
    assert state["complete"] and state["edges"] == {}


def test_limits_leave_the_optimum_at_an_edge_or_capped():
    limited = _converge([1.0, 2.0, 4.0], 64.0, RULES | {"steps": 2})
    assert limited["lrs"] == pytest.approx([1, 2, 4, 8, 16])
    assert limited["edges"] == {"0.5": "high", "0.2": "high"}
    capped = _converge([1.0, 2.0, 4.0], 64.0, RULES | {"max_lr": 6.0})
    assert capped["lrs"] == pytest.approx([1, 2, 4, 6])
    assert capped["edges"] == {"0.5": "capped", "0.2": "capped"}


def test_no_extension_until_every_seed_has_a_record():
    records = [_record(8, lr, 0, 16.0) for lr in (1.0, 2.0, 4.0)]
    records += [_record(8, lr, 1, 16.0) for lr in (1.0, 2.0)]  # seed 1 at lr 4 unfinished
    state = edges.grid_at_batch_size([1.0, 2.0, 4.0], (0, 1), records, (0.5,), RULES)
    assert state["lrs"] == [1.0, 2.0, 4.0] and not state["complete"]
    records.append(_record(8, 4.0, 1, 16.0))
    state = edges.grid_at_batch_size([1.0, 2.0, 4.0], (0, 1), records, (0.5,), RULES)
    assert state["lrs"] == [1.0, 2.0, 4.0, 8.0] and not state["complete"]


def _sweep():
    s = grid.default_sweep_config()
    s.batch_sizes, s.base_lr, s.base_batch_size, s.lr_rule = (8, 32), 1.0, 8, "none"
    s.lr_factors, s.seeds, s.targets = (1.0, 2.0, 4.0), (0, 1), (0.5, 0.2)
    s.extend_lr_rounds, s.extend_lr_count = 3, 1
    return s


def _run_to_end(sweep, best, order_seed):
    """Simulated launcher that finishes pending trials in a random order, one at a time."""
    rng = random.Random(order_seed)
    records = []
    while True:
        done = {r["trial_id"] for r in records}
        todo = [t for t in grid.grid_trials(sweep, records) if t.trial_id not in done]
        if not todo:
            return grid.grid_trials(sweep, records), records
        t = rng.choice(todo)
        rec = _record(t.batch_size, t.learning_rate, t.seed, best[t.batch_size], t.index)
        records.append(rec | {"trial_id": t.trial_id})


def test_added_trials_have_the_same_indices_whatever_the_order():
    sweep = _sweep()
    best = {8: 0.25, 32: 8.0}
    runs = [_run_to_end(sweep, best, seed) for seed in range(3)]
    tables = [[(t.index, t.trial_id) for t in trials] for trials, _ in runs]
    assert tables[0] == tables[1] == tables[2]
    trials = runs[0][0]
    assert len({t.index for t in trials}) == len(trials)
    assert sorted({t.learning_rate for t in trials if t.batch_size == 8}) == pytest.approx(
        [0.125, 0.25, 0.5, 1, 2, 4])
    assert sorted({t.learning_rate for t in trials if t.batch_size == 32}) == pytest.approx(
        [1, 2, 4, 8, 16])
    assert all(t.index >= 12 for t in trials if t.learning_rate not in (1.0, 2.0, 4.0))
    shards = [grid.shard_trials(trials, f"{i}/3", sweep.batch_sizes) for i in range(3)]
    assert sorted(t.trial_id for s in shards for t in s) == sorted(t.trial_id for t in trials)


def test_grid_status_counts_missing_trials_and_ignores_foreign_records():
    sweep = _sweep()
    trials, records = _run_to_end(sweep, {8: 2.0, 32: 2.0}, 0)
    definition = {"sweep": sweep.to_dict(), "trials": grid.trial_table(grid.make_trials(sweep))}
    foreign = _record(8, 3.0, 0, 2.0, 99)  # a trial of an earlier grid (--redefine)
    status = edges.grid_status(definition, records + [foreign])
    assert status["complete"] and status["num_expected"] == 12
    assert foreign not in status["records"] and len(status["records"]) == 12
    partial = [r for r in records if r["batch_size"] == 8 or r["seed"] == 0]
    status = edges.grid_status(definition, partial)
    assert not status["complete"] and status["missing"] == {32: 3}
    assert status["num_missing"] == 3
    old = edges.grid_status({"sweep": sweep.to_dict()}, partial)
    assert not old["known"] and old["complete"]


def test_report_marks_extrapolated_b_crit_incomplete_grids_and_caps():

    fit_ok = {"status": "ok", "b_crit": 3.0, "b_crit_ci": [2.0, 4.0], "s_min": 10.0,
              "e_min": 30.0, "warnings": []}
    target = {"target": 0.5, "fit": fit_ok, "measured_b_simple": 5.0,
              "measured_b_noise": float("nan"), "batch_sizes": [8.0, 16.0, 32.0],
              "b_crit_extrapolated": True, "incomplete_batch_sizes": [16.0],
              "edge_batch_sizes": [8.0], "capped_batch_sizes": [32.0]}
    analysis = {"targets": [target], "power_law": {"status": "insufficient data"},
                "tokens_per_example": 32}
    row = report_tables.summary_table(analysis).splitlines()[2]
    assert "3 (2–4) (extrapolated)" in row and "ok, incomplete grid" in row
    notes = report_tables.grid_notes(analysis)
    assert "still at an edge of the grid at B = 8" in notes[0]
    assert "cap at B = 32" in notes[1]
    assert "| 0.5 | 3 (extrapolated) | 96 | 64–128 |" in report_tables.kaplan_table(analysis)


def test_one_seed_at_an_edge_extends_the_grid_as_the_analysis_selects():
    # Seed 0's optimum lies below the grid, seed 1's inside it: per seed (the analysis'
    # selection) B sits at the low edge, although the mean over seeds per rate is fastest
    # inside the grid (the rule used to look only at that mean and never extended).
    lrs = [1.0, 2.0, 4.0]
    best = {0: 0.25, 1: 2.0}
    records = [_record(8, lr, s, best[s]) for lr in lrs for s in (0, 1)]
    for r in records:  # seed 1 is much slower overall, so it dominates the per-rate mean
        if r["seed"] == 1:
            r["steps_to_target"] = {k: 20 * v for k, v in r["steps_to_target"].items()}
    state = edges.grid_at_batch_size(lrs, (0, 1), records, (0.5,), RULES)
    assert state["lrs"] == [0.5, 1.0, 2.0, 4.0]  # one more rate below, for both seeds
    assert edges.edge_directions(records, (0.5,), lrs, RULES) == {"0.5": edges.LOW}
