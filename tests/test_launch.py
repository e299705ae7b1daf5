"""Sweeps end to end on a tiny digits study: records, report, resume, shards, back ends."""

import csv
import os

import numpy as np
import pytest

from cbs.analysis.reports import report
from cbs.results import files, store
from cbs.runtime import checkpoint
from cbs.sweeps import grid, groups, launch
from experiments.configs import digits_sweep

# One worker runs the module, so the finished sweep of the module fixture is made once.
pytestmark = pytest.mark.xdist_group("launch")


def _tiny():
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes = (8, 32, 128)
    return c


def _table(sweep_dir):
    with open(os.path.join(sweep_dir, files.CSV_FILE)) as f:
        return sorted(csv.DictReader(f), key=lambda r: (r["trial_id"], r["target"]))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sweep"))
    results = launch.run_sweep(_tiny(), d, log=lambda _: None)
    return d, results


def test_sweep_records_every_trial_with_crossings_and_noise(finished):
    d, results = finished
    records = store.SweepStore(d).records()
    trial_list = grid.make_trials(_tiny().sweep)
    assert [r["trial_id"] for r in records] == [t.trial_id for t in trial_list]
    for r in records:
        assert r["status"] in ("done", "budget", "dominated")
        s = r["steps_to_target"]["1.5"]
        if s is not None:
            assert 0 < s <= 60
            assert r["examples_to_target"]["1.5"] == pytest.approx(s * r["batch_size"])
            assert r["noise_at_target"]["1.5"]["b_simple"] > 0
        curve = r["curve"]
        assert curve["step"][0] == 0 and curve["full_train/loss"][0] > 2.0  # ≈ ln 10 at init
        assert np.all(np.diff(curve["step"]) > 0)
    # one learning rate per batch size reached every target; B_noise was measured
    assert {r["batch_size"] for r in records if r["status"] == "done"} == {8, 32, 128}
    assert any(r["noise_at_target"]["1"].get("b_noise", 0) > 0 for r in records)
    # larger batches need fewer steps to reach the first target
    best = {b: min(r["steps_to_target"]["1.5"] or np.inf for r in records
                   if r["batch_size"] == b) for b in (8, 32, 128)}
    assert best[8] > best[32] > best[128]


def test_report_fits_and_figures(finished):
    d, _ = finished
    path = report.write_report(d, bootstrap=50)
    text = open(path).read()
    assert "| target L | B_crit" in text and "![pareto]" in text
    analysis = report.load_analysis(d)
    first = analysis["targets"][0]
    assert first["fit"]["status"] == "ok" and first["fit"]["b_crit"] > 0
    assert first["measured_b_simple"] > 0
    for name in ("pareto", "collapse", "b_crit_vs_loss", "noise_scale"):
        assert os.path.getsize(os.path.join(d, "figures", f"{name}.png")) > 1000


def test_rerun_skips_finished_trials(finished):
    d, _ = finished
    assert launch.run_sweep(_tiny(), d, log=lambda _: None) == []


def test_crash_then_rerun_gives_the_uninterrupted_table(finished, tmp_path, monkeypatch):
    d_ref, _ = finished
    d = str(tmp_path / "crash")
    c = _tiny()
    c.sweep.batch_sizes = (8, 32)  # the first two groups of the finished sweep
    calls = {"n": 0}
    original = groups.TrialGroup._evaluate

    def crashing(self, *args):
        calls["n"] += 1
        if calls["n"] == 11:  # inside the second group (≤ 7 evaluations each), after a save
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(groups.TrialGroup, "_evaluate", crashing)
    with pytest.raises(KeyboardInterrupt):
        launch.run_sweep(c, d, log=lambda _: None)
    monkeypatch.setattr(groups.TrialGroup, "_evaluate", original)
    gdir = os.path.join(d, "groups")
    assert any(os.listdir(os.path.join(gdir, g, "checkpoints")) for g in os.listdir(gdir))
    assert 0 < len(store.SweepStore(d).records()) < len(grid.make_trials(c.sweep))
    restores = []
    original_restore = checkpoint.Checkpointer.restore

    def counting_restore(self, *args, **kwargs):
        restores.append(args[0])
        return original_restore(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpointer, "restore", counting_restore)
    launch.run_sweep(c, d, log=lambda _: None)
    assert restores  # the interrupted group resumed from its checkpoint
    # a group's trials do not depend on the other groups of the grid
    assert _table(d) == [r for r in _table(d_ref) if int(r["batch_size"]) in (8, 32)]


def test_shards_together_cover_the_sweep_once(finished, tmp_path):
    d_ref, _ = finished
    d = str(tmp_path / "shards")
    for i in range(2):
        launch.run_sweep(_tiny(), d, shard=f"{i}/2", log=lambda _: None)
    ids = [r["trial_id"] for r in store.SweepStore(d).records()]
    assert sorted(ids) == sorted(t.trial_id for t in grid.make_trials(_tiny().sweep))
    # Sharding splits the vmapped groups (one learning rate each here), so no trial stops
    # early as dominated; the fastest trial per batch size, which the fit uses, is the same.
    ref, got = report.analyze(d_ref, bootstrap=0), report.analyze(d, bootstrap=0)
    for a, b in zip(ref["targets"], got["targets"], strict=True):
        assert a["batch_sizes"] == b["batch_sizes"]
        assert a["learning_rates"] == b["learning_rates"]
        np.testing.assert_allclose(a["steps"], b["steps"], rtol=1e-3)


@pytest.mark.slow
def test_kill_9_then_same_command_gives_the_uninterrupted_table(finished, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    d_ref, _ = finished
    d = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "experiments.sweep",
           "--config=experiments/configs/digits_sweep.py:tiny", f"--sweep_dir={d}",
           "--config.sweep.batch_sizes=8,32,128", "--noanalyze"]
    env = dict(os.environ)  # the 8 host devices of the reference run: float32 sums equal
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    groups = os.path.join(d, "groups")
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once a checkpoint of the second group exists
        if os.path.isdir(groups) and len(os.listdir(groups)) >= 2 and any(
                os.listdir(os.path.join(groups, g, "checkpoints"))
                for g in sorted(os.listdir(groups))[1:]
                if os.path.isdir(os.path.join(groups, g, "checkpoints"))):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(store.SweepStore(d).records())
    assert done_before < len(grid.make_trials(_tiny().sweep))
    subprocess.run(cmd, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    assert _table(d) == _table(d_ref)
