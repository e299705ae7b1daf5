"""Tests of cbs.sweeps.trials: budgets and evaluation grids, the run config of a trial, the
progress monitor (loss EMA, targets, divergence), curves from run records, results at each
target and their round trip through the sweep store. No training: records are written by
hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cbs.results import store
from cbs.sweeps import grid, trials
from cbs.sweeps.grid import Trial
from experiments.configs import digits_sweep


def _sweep(**fields):
    s = grid.default_sweep_config()
    s.update(fields)
    return s


def test_budget_is_the_smaller_of_steps_and_examples():
    assert trials.step_budget(_sweep(max_steps=100, max_examples=1000), 32) == 32  # ⌈1000/32⌉
    assert trials.step_budget(_sweep(max_steps=100, max_examples=10_000), 32) == 100
    assert trials.step_budget(_sweep(max_steps=0, max_examples=10), 64) == 1
    s = _sweep(max_steps=1000, max_examples=0, evals_per_trial=3)
    assert trials.eval_steps(s, 8) == [0, 1, 32, 1000]
    assert trials.eval_every(s, 8) == 333


def test_micro_batch_divides_the_batch_per_replica():
    assert trials.micro_batch_for(96, 64, 1) == 48
    assert trials.micro_batch_for(96, 64, 4) == 24
    with pytest.raises(ValueError, match="not divisible by the 4 data replicas"):
        trials.micro_batch_for(6, 64, 4)


def test_trial_config_sets_the_point_of_the_grid_and_hands_divergence_to_the_sweep():
    c = digits_sweep.get_config("tiny")
    t = Trial(index=3, batch_size=32, learning_rate=0.02, seed=5)
    rc = trials.trial_config(c, t)
    assert "sweep" not in rc and rc.seed == 5 and rc.optim.learning_rate == 0.02
    assert rc.batch.schedule.to_dict() == {"kind": "constant", "batch_size": 32}
    assert rc.batch.lr_coupling.rule == "none"
    assert rc.train.max_steps == trials.step_budget(c.sweep, 32) and rc.train.max_examples == 0
    assert rc.eval.every == trials.eval_every(c.sweep, 32)
    assert rc.eval.enabled and rc.noise.every == 0  # measured at the evaluations instead
    assert rc.train.divergence_factor == 0.0


def test_monitor_smooths_the_batch_loss_and_stops_at_the_lowest_target():
    m = trials.ProgressMonitor(_sweep(target_metric="train/loss_ema", targets=(2.0, 1.0),
                                      loss_ema_decay=0.5, divergence_factor=0.0))
    assert not m(0, {"kind": "eval", "step": 0, "full_train/loss": 0.1})  # not its metric
    assert not m(0, {"kind": "train", "step": 0, "train/loss": 3.0})
    assert m.ema == 3.0
    assert not m(1, {"kind": "train", "step": 1, "train/loss": 1.0})  # 0.5·3 + 0.5·1 = 2
    assert m.ema == 2.0
    assert m(2, {"kind": "train", "step": 2, "train/loss": 0.0})  # 1.0: the lowest target
    assert not m.exploded


def test_monitor_declares_divergence_after_patience():
    m = trials.ProgressMonitor(_sweep(target_metric="eval/loss", targets=(0.1,),
                                      divergence_factor=2.0, divergence_patience=2))
    values = [1.0, 3.0, 1.0, 3.0, 3.0]
    stops = [m(i, {"kind": "eval", "step": i, "eval/loss": v}) for i, v in enumerate(values)]
    assert stops == [False, False, False, False, True] and m.exploded


def _train(step, loss, b=4, **noise):
    return {"step": step, "kind": "train", "data/examples_seen": step * b,
            "data/batch_size": b, "train/loss": loss} | noise


def test_curve_from_records_of_the_batch_loss_ema_and_of_an_eval_metric():
    recs = [_train(1, 1.0), _train(0, 3.0, **{"noise/trace_sigma": 2.0,
                                              "noise/grad_sq_norm": 0.5}),
            {"step": 2, "kind": "eval", "data/examples_seen": 8, "eval/loss": 0.7},
            {"step": 0, "kind": "eval", "data/examples_seen": 0, "eval/loss": 2.5}]
    ema = trials.curve_from_records(recs, "train/loss_ema", 0.5)
    assert ema["step"] == [1, 2] and ema["examples"] == [4, 8]  # after each step
    assert ema["train/loss_ema"] == [3.0, 2.0]
    assert ema["noise/step"] == [0] and ema["noise/trace_sigma"] == [2.0]
    assert math.isnan(ema["noise/b_noise"][0])  # not measured: NaN, not absent
    ev = trials.curve_from_records(recs, "eval/loss", 0.5)
    assert ev["step"] == [0, 2] and ev["examples"] == [0, 8] and ev["eval/loss"] == [2.5, 0.7]


def test_curve_from_records_reads_the_noise_measured_at_the_evaluations():
    noise = {"noise/trace_sigma": 2.0, "noise/grad_sq_norm": 0.5, "noise/ema_b_simple": 3.0}
    recs = [_train(0, 3.0, **{"noise/ema_b_simple": 9.0}),
            {"step": 0, "kind": "eval", "data/examples_seen": 0, "eval/loss": 2.5} | noise,
            {"step": 2, "kind": "eval", "data/examples_seen": 8, "eval/loss": 0.7} | noise]
    ev = trials.curve_from_records(recs, "eval/loss", 0.5)
    assert ev["noise/step"] == [0, 2] and ev["noise/trace_sigma"] == [2.0, 2.0]
    assert ev["noise/ema_b_simple"] == [3.0, 3.0]  # the evaluation's, not a train record's


def _curve(losses, steps=(0, 10, 20, 40)):
    n = len(losses)
    return {"step": list(steps[:n]), "examples": [s * 8 for s in steps[:n]],
            "full_train/loss": list(losses), "noise/step": list(steps[:n]),
            "noise/trace_sigma": [4.0] * n, "noise/grad_sq_norm": [0.5] * n,
            "noise/b_simple": [8.0] * n, "noise/trace_h_sigma": [math.nan] * n,
            "noise/g_h_g": [math.nan] * n, "noise/b_noise": [math.nan] * n,
            "noise/ema_b_simple": [7.0] * n}


def test_result_interpolates_each_crossing_and_measures_the_noise_there():
    s = _sweep(targets=(1.0, 0.25), target_metric="full_train/loss", noise_window=2)
    t = Trial(index=0, batch_size=8, learning_rate=0.1, seed=0)
    r = trials.result_from_curve(t, s, _curve([2.0, 1.0, 0.5, 0.2]), "done", 1.5)
    assert r.steps_to_target["1"] == 10.0
    # log-linear between (20, 0.5) and (40, 0.2): 20 + 20·log(0.5/0.25)/log(0.5/0.2)
    assert r.steps_to_target["0.25"] == pytest.approx(20 + 20 * np.log(2) / np.log(2.5))
    assert r.examples_to_target["1"] == 80.0
    assert r.noise_at_target["1"]["b_simple"] == pytest.approx(8.0)
    assert r.noise_at_target["1"]["ema_b_simple"] == 7.0
    assert "b_noise" not in r.noise_at_target["1"]
    assert r.final_steps == 40 and r.final_metric == pytest.approx(0.2)
    assert r.curve["noise/b_noise"] == [None] * 4  # JSON-safe


def test_unreached_and_diverged_targets_are_none():
    s = _sweep(targets=(1.0, 0.1), target_metric="full_train/loss")
    t = Trial(index=1, batch_size=8, learning_rate=0.1, seed=0)
    r = trials.result_from_curve(t, s, _curve([2.0, 0.5]), "budget", 0.0)
    assert r.steps_to_target["0.1"] is None and r.examples_to_target["0.1"] is None
    assert r.noise_at_target["0.1"] == {}
    d = trials.result_from_curve(t, s, _curve([]), "diverged", 0.0)
    assert d.steps_to_target == {"1": None, "0.1": None} and d.final_steps == 0
    assert math.isnan(d.final_metric)


def test_a_trial_record_round_trips_through_the_store(tmp_path):
    s = _sweep(targets=(1.0, 0.25), target_metric="full_train/loss")
    made = [trials.result_from_curve(Trial(i, 8, lr, 0), s, _curve([2.0, 1.0, 0.5, 0.2]),
                                     "done", 1.5) for i, lr in enumerate((0.1, 0.2))]
    st = store.SweepStore(str(tmp_path))
    st.append(made)
    st.append(made[:1])  # a repeated append is ignored
    back = [store.TrialResult(**r) for r in st.records()]
    assert back == made
    assert "B=8      lr=0.1  done     steps L=1: 10, L=0.25: 35  (1.5 s)" in trials.summarize(back)
