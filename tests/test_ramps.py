"""Batch ramps beside a sweep: records on their own S and E axes, resume by label, report."""

import os

import jax
import numpy as np
import pytest

from cbs.analysis.reports import report_tables
from cbs.results import files, records, shared, store
from cbs.results.store import SweepStore, TrialResult
from cbs.runtime import mesh
from cbs.sweeps import ramps
from cbs.sweeps.grid import Trial
from experiments.configs import digits_ramps


def _config():
    c = digits_ramps.get_config("tiny")
    c.sweep.targets = (1.5, 1.0)
    c.ramps = [
        {"label": "fixed", "micro_batch": 32, "learning_rate": 5e-3,
         "schedule": {"kind": "constant", "batch_size": 32}, "max_steps": 40},
        {"label": "steps", "micro_batch": 16, "learning_rate": "best@32", "max_steps": 40,
         "schedule": {"kind": "step", "steps": ((0, 16), (200, 32), (600, 64))},
         "lr_coupling": {"rule": "sqrt", "base_batch_size": 16, "cap": 0.03}},
    ]
    return c


def _fake_sweep(sweep_dir):
    store = SweepStore(sweep_dir)
    rows = [(0, 32, 1e-3, 30.0), (1, 32, 4e-3, 12.0), (2, 32, 8e-3, None)]
    store.append([TrialResult(Trial(i, b, lr, 0).trial_id, i, b, lr, 0, "done",
                              "full_train/loss", {"1": s}, {"1": s and s * b}, {"1": {}}, 50,
                              0.5, {"step": []}, 1.0) for i, b, lr, s in rows])


def test_best_learning_rate_reads_the_sweep(tmp_path):
    _fake_sweep(str(tmp_path))
    assert ramps.best_learning_rate(str(tmp_path), 32) == 4e-3
    with pytest.raises(ValueError, match="batch size 64"):
        ramps.best_learning_rate(str(tmp_path), 64)


def test_ramp_runs_record_steps_and_examples_on_their_own_axes(tmp_path):
    d = str(tmp_path)
    _fake_sweep(d)
    c = _config()
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    out = ramps.run_ramps(c, d, log=lambda _: None, mesh=one)
    assert [r["label"] for r in out] == ["fixed", "steps"]
    fixed, stepped = out
    assert stepped["learning_rate"] == 4e-3  # best@32 from the sweep
    s, e = fixed["steps_to_target"]["1.5"], fixed["examples_to_target"]["1.5"]
    assert s is not None and e == pytest.approx(32 * s)  # constant B: E = B·S
    sizes = stepped["schedule"]["batch_size"]
    assert sizes[0] == 16 and set(sizes) <= {16, 32, 64} and len(set(sizes)) >= 2
    lrs = dict(zip(sizes, stepped["schedule"]["lr"], strict=False))
    for b, lr in lrs.items():  # square-root coupling from B_0 = 16, applied once per size
        assert lr == pytest.approx(4e-3 * (b / 16) ** 0.5, rel=1e-5)
    s, e = stepped["steps_to_target"]["1.5"], stepped["examples_to_target"]["1.5"]
    assert s is not None and 16 * s <= e <= 64 * s
    curve_e = np.asarray(stepped["curve"]["examples"])
    assert np.all(np.diff(curve_e) > 0)
    # a rerun finds both labels recorded and trains nothing
    before = os.path.getmtime(os.path.join(d, files.RAMPS_FILE))
    assert len(ramps.run_ramps(c, d, log=lambda _: None, mesh=one)) == 2
    assert os.path.getmtime(os.path.join(d, files.RAMPS_FILE)) == before
    assert len(records.read_records(os.path.join(d, files.RAMPS_FILE))) == 2
    written = shared.part_paths(os.path.join(d, files.RAMPS_FILE))  # one write-once part a run
    assert [records.read_records(p)[0]["label"] for p in written] == ["fixed", "steps"]
    assert records.read_records(os.path.join(d, files.RAMPS_FILE)) == out  # the export


def test_duplicate_labels_are_rejected(tmp_path):
    c = _config()
    c.ramps = [c.ramps[0], c.ramps[0]]
    with pytest.raises(ValueError, match="unique"):
        ramps.validate_ramps(c, replicas=1)


def test_ramp_table_lists_each_run():
    analysis = {"targets": [{"target": 1.5}, {"target": 1.0}]}
    table = report_tables.ramp_table([{"label": "a", "steps_to_target": {"1.5": 10.0, "1": None},
                                "examples_to_target": {"1.5": 320.0, "1": None}}], analysis)
    assert "| a | 10, 320 | not reached |" in table
    fitted = {"status": "ok", "s_min": 5.0, "e_min": 100.0}  # frontier at S=10: E = 200
    analysis = {"targets": [{"target": 1.5, "fit": fitted}]}
    table = report_tables.ramp_table([{"label": "a", "steps_to_target": {"1.5": 10.0},
                                "examples_to_target": {"1.5": 320.0}}], analysis)
    assert "| a | 10, 320 (1.60) |" in table
    assert store.target_key(1.0) == "1"
