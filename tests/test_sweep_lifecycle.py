"""A sweep directory's life: validation before writing, --redefine, learning-rate extension
rounds, reports of partial sweeps, and two launchers sharing one directory."""

import json
import os
import subprocess
import sys

import pytest

from cbs.analysis import report
from cbs.results import store
from cbs.sweeps import grid, launch
from experiments.configs import digits_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(**changes):
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes = (8, 32)
    c.sweep.update(changes)
    return c


def _quiet(_):
    pass


@pytest.mark.parametrize("changes,match", [
    ({"batch_sizes": (0, 8)}, "config.sweep.batch_sizes"),
    ({"batch_sizes": (8, 4096)}, "config.sweep.batch_sizes: 4096 is larger than the training"),
    ({"extend_lr_count": 0}, "config.sweep.extend_lr_count"),
])
def test_a_bad_config_writes_nothing_and_the_corrected_one_runs(tmp_path, changes, match):
    d = str(tmp_path / "sweep")
    with pytest.raises(ValueError, match=match):
        launch.run_sweep(_tiny(**changes), d, log=_quiet)
    assert not os.path.exists(d)
    c = _tiny(batch_sizes=(8,), lr_factors=(1.0,), max_steps=10, evals_per_trial=3)
    assert len(launch.run_sweep(c, d, log=_quiet)) == 1


def test_redefine_extends_the_grid_and_keeps_finished_trials(tmp_path):
    d = str(tmp_path)
    small = dict(lr_factors=(1.0,), max_steps=10, evals_per_trial=3)
    first = launch.run_sweep(_tiny(batch_sizes=(8,), **small), d, log=_quiet)
    bigger = _tiny(batch_sizes=(8, 32), **small)
    with pytest.raises(ValueError, match="--redefine"):
        launch.run_sweep(bigger, d, log=_quiet)
    second = launch.run_sweep(bigger, d, redefine=True, log=_quiet)
    assert [r.batch_size for r in first] == [8] and [r.batch_size for r in second] == [32]
    other_targets = _tiny(batch_sizes=(8, 32), targets=(1.2,), **small)
    with pytest.raises(ValueError, match="targets"):
        launch.run_sweep(other_targets, d, redefine=True, log=_quiet)
    shrunk = _tiny(batch_sizes=(32,), **small)
    assert launch.run_sweep(shrunk, d, redefine=True, log=_quiet) == []
    analysis = report.analyze(d, bootstrap=0, write=False)
    assert analysis["num_trials"] == 1 and analysis["complete"]  # B = 8 is no longer in it


def test_learning_rates_extend_past_the_edge_resumably(tmp_path):
    # A grid far below the optimum: the best rate is the largest at every batch size until
    # the extension rounds (two, one rate each) carry it up.
    c = _tiny(base_lr=1e-4, lr_factors=(1.0, 2.0), extend_lr_rounds=2, targets=(2.0,),
              max_steps=40)
    d = str(tmp_path)
    results = launch.run_sweep(c, d, log=_quiet)
    base = grid.make_trials(c.sweep)
    added = [r for r in results if r.index >= len(base)]
    assert {r.batch_size for r in added} == {8, 32}
    for b in (8, 32):
        lrs = sorted(r.learning_rate for r in results if r.batch_size == b)
        top = max(t.learning_rate for t in base if t.batch_size == b)
        assert lrs[-2:] == pytest.approx([2 * top, 4 * top])  # factor 2 past the edge, twice
    assert launch.run_sweep(c, d, log=_quiet) == []  # resumable: nothing left to do
    analysis = report.analyze(d, bootstrap=0, write=False)
    assert analysis["complete"] and analysis["num_trials"] == len(results)
    text = open(report.write_report(d, bootstrap=0)).read()
    assert "interpolated linearly in log loss" in text
    assert "still at an edge of the grid at B = 8, 32" in text  # the limit was reached


def test_partial_sweep_is_refused_or_marked(tmp_path):
    c = _tiny(lr_factors=(1.0,), batch_sizes=(8, 16, 32, 64))
    d = str(tmp_path)
    launch.run_sweep(c, d, shard="0/2", log=_quiet)
    analysis = report.analyze(d, bootstrap=0, write=False)
    assert not analysis["complete"] and analysis["num_missing"] == 2
    assert analysis["missing_per_batch_size"] == {"16": 1, "64": 1}
    with pytest.raises(ValueError, match=r"2 of at least 4 trials have no record \(B=16: 1, "
                                         r"B=64: 1\).*--partial"):
        report.write_report(d, bootstrap=0)
    text = open(report.write_report(d, bootstrap=0, partial=True)).read()
    assert "PARTIAL SWEEP" in text and "fit from an incomplete grid" in text
    launch.run_sweep(c, d, shard="1/2", log=_quiet)
    text = open(report.write_report(d, bootstrap=0)).read()
    assert "PARTIAL" not in text and "incomplete grid" not in text


def test_two_launchers_on_one_directory_share_the_work(tmp_path):
    d = str(tmp_path / "shared")
    cmd = [sys.executable, "-m", "experiments.sweep",
           "--config=experiments/configs/digits_sweep.py:tiny", f"--sweep_dir={d}",
           "--config.sweep.batch_sizes=8,16,32,64", "--config.sweep.max_steps=30",
           "--noanalyze"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with open(os.path.join(d, store.TRIALS_FILE)) as f:
        ids = [json.loads(line)["trial_id"] for line in f]
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes = (8, 16, 32, 64)
    assert sorted(ids) == sorted(t.trial_id for t in grid.make_trials(c.sweep))  # each once
