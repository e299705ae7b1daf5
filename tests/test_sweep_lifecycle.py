"""A sweep directory's life: validation before writing, --redefine, learning-rate extension
rounds, reports of partial sweeps, and two launchers sharing one directory."""

import json
import os

import _warm
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.analysis.reports import report
from cbs.results import files
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


_BAD = [
    ({"batch_sizes": (0, 8)}, "config.sweep.batch_sizes"),
    ({"batch_sizes": (8, 4096)}, "config.sweep.batch_sizes: 4096 is larger than the training"),
    ({"extend_lr_count": 0}, "config.sweep.extend_lr_count"),
]


def test_a_bad_config_writes_nothing_and_the_corrected_one_runs(tmp_path):
    d = str(tmp_path / "sweep")
    for changes, match in _BAD:  # one directory: no refused launch leaves anything in it
        with pytest.raises(ValueError, match=match):
            launch.run_sweep(_tiny(**changes), d, log=_quiet)
        assert not os.path.exists(d), changes
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
    # One learning rate per batch size is at both edges of its grid: the first round adds
    # 2η; if 2η is best it is again the largest and the round limit (one step per side)
    # leaves it at an edge, else η is the smallest and η/2 is added below.
    c = _tiny(lr_factors=(1.0,), extend_lr_rounds=1, targets=(1.5,))
    d = str(tmp_path)
    results = launch.run_sweep(c, d, log=_quiet)
    base = grid.make_trials(c.sweep)
    assert all(r.index >= len(base) for r in results[len(base):])
    for t in base:
        lrs = sorted(r.learning_rate for r in results if r.batch_size == t.batch_size)
        x = t.learning_rate
        assert lrs in ([pytest.approx(x), pytest.approx(2 * x)],
                       [pytest.approx(x / 2), pytest.approx(x), pytest.approx(2 * x)])
    assert launch.run_sweep(c, d, log=_quiet) == []  # resumable: nothing left to do
    analysis = report.analyze(d, bootstrap=0, write=False)
    assert analysis["complete"] and analysis["num_trials"] == len(results)
    text = open(report.write_report(d, bootstrap=0, partial=False)).read()
    assert "interpolated linearly in log loss" in text and "## Learning-rate grid" in text
    best = {b: lr for b, lr in zip(analysis["targets"][0]["batch_sizes"],
                                   analysis["targets"][0]["learning_rates"], strict=True)}
    tried = {b: [r.learning_rate for r in results if r.batch_size == b] for b in best}
    at_edge = [b for b in best if best[b] in (min(tried[b]), max(tried[b]))]
    assert analysis["targets"][0]["edge_batch_sizes"] == pytest.approx(at_edge)


def test_partial_sweep_is_refused_or_marked(tmp_path):
    # the short trials of the tests above (their programs are compiled already)
    c = _tiny(lr_factors=(1.0,), batch_sizes=(8, 16, 32), max_steps=10, evals_per_trial=3)
    d = str(tmp_path)
    launch.run_sweep(c, d, shard="1/2", log=_quiet)  # B = 16 only
    analysis = report.analyze(d, bootstrap=0, write=False)
    assert not analysis["complete"] and analysis["num_missing"] == 2
    assert analysis["missing_per_batch_size"] == {"8": 1, "32": 1}
    with pytest.raises(ValueError, match=r"2 of at least 3 trials have no record \(B=8: 1, "
                                         r"B=32: 1\).*--partial"):
        report.write_report(d, bootstrap=0)
    text = open(report.write_report(d, bootstrap=0, partial=True)).read()
    assert "PARTIAL SWEEP" in text and "fit from an incomplete grid" in text
    launch.run_sweep(c, d, shard="0/2", log=_quiet)
    text = open(report.write_report(d, bootstrap=0)).read()
    assert "PARTIAL" not in text and "incomplete grid" not in text


def test_two_launchers_on_one_directory_share_the_work(tmp_path):
    d = str(tmp_path / "shared")
    cmd = ["-m", "experiments.sweep",
           "--config=experiments/configs/digits_sweep.py:tiny", f"--sweep_dir={d}",
           "--config.sweep.batch_sizes=8,32", "--config.sweep.lr_factors=(1.0,)",
           "--config.sweep.max_steps=10", "--config.sweep.evals_per_trial=3", "--noanalyze"]
    env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    procs = [_warm.popen(cmd, env=env, stderr_to_stdout=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with open(os.path.join(d, files.TRIALS_FILE)) as f:
        ids = [json.loads(line)["trial_id"] for line in f]
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes, c.sweep.lr_factors = (8, 32), (1.0,)
    assert sorted(ids) == sorted(t.trial_id for t in grid.make_trials(c.sweep))  # each once
