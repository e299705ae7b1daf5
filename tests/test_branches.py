"""Branched local critical batch size: the criterion, resume, and vmapped = engine branches."""

import os

import numpy as np
import pytest

from cbs.analysis import branch_report
from cbs.results import records
from cbs.sweeps import branches
from experiments.configs import digits_branch


def _config(**branch):
    c = digits_branch.get_config("tiny")
    c.train.max_steps = 40  # checkpoints at 20 and 40
    c.noise.every = 0  # the reference's noise measurements are not under test here
    b = c.branch
    b.points_examples, b.ks, b.window_examples, b.seeds = (320,), (1, 2, 4), 128, (1, 2)
    b.metric = "full_train/loss"
    for k, v in branch.items():
        b[k] = v
    return c


def test_criterion_on_known_ladders():
    ks = [1, 2, 4, 8, 16]
    # flat to k = 4, then 0.05 worse: k* = 4, B* = √(4·8)·B
    assert branch_report.critical_multiplier(ks, [1.0, 0.995, 1.005, 1.05, 1.2], 0.01) == 4
    assert branch_report.critical_batch(ks, 4, 10) == (pytest.approx(10 * np.sqrt(32)), False)
    # a lucky larger k after a failure does not count
    assert branch_report.critical_multiplier(ks, [1.0, 1.02, 1.0, 1.0, 1.0], 0.01) == 1
    # within the tolerance against the best smaller k, not only against k = 1
    assert branch_report.critical_multiplier(ks, [1.0, 0.9, 0.915, 0.9, 0.9], 0.01) == 2
    assert branch_report.critical_multiplier(ks, [1.0, 0.9, 0.905, 0.9, 0.9], 0.01) == 16
    assert branch_report.critical_batch(ks, 16, 10) == (160.0, True)
    # relative tolerance scales with the loss
    assert branch_report.critical_multiplier(ks, [0.1, 0.101, 0.2, 0, 0], 0.02,
                                             "relative") == 2


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="branch.ks"):
        branches.validate_branch_config(_config(ks=(2, 4)))
    with pytest.raises(ValueError, match="branch.window_examples"):
        branches.validate_branch_config(_config(window_examples=100))


def test_killed_study_resumes_to_the_same_records_and_vmap_equals_engine(tmp_path):
    c = _config()
    full = branches.run_branches(c, str(tmp_path / "full"))
    assert len(full) == 3 * 2 and {r["k"] for r in full} == {1, 2, 4}
    part_dir = str(tmp_path / "part")
    branches.run_branches(c, part_dir, stop_after=1)
    path = os.path.join(part_dir, branches.BRANCHES_FILE)
    with open(path, "a") as f:  # a kill in the middle of an append
        f.write('{"point_step": 20, "k"')
    resumed = branches.run_branches(c, part_dir)
    key = lambda r: (r["point_step"], r["k"], r["seed"])
    assert sorted(map(key, resumed)) == sorted(map(key, full))
    for a, b in zip(sorted(full, key=key), sorted(resumed, key=key), strict=True):
        assert a == b
    # the same branches through the engine's own step loop, one per seed
    runner = branches.BranchRunner(c, str(tmp_path / "full"))
    try:
        for r in full:
            ema, last, final = runner.engine_branch(r["point_step"], r["k"], r["seed"])
            np.testing.assert_allclose([ema, last, final],
                                       [r["loss_ema"], r["train/loss"], r["full_train/loss"]],
                                       rtol=2e-5)
    finally:
        runner.close()
    points = branch_report.summarize(str(tmp_path / "full"))
    assert len(points) == 1 and points[0]["point_examples"] == 320
    assert points[0]["b_star_lo"] <= points[0]["b_star"] <= points[0]["b_star_hi"] or \
        points[0]["num_seeds"] == 2
    assert records.read_json(os.path.join(tmp_path, "full", branches.DEFINITION_FILE))
