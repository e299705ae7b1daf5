"""The batch-size advice (`cbs.analysis.advice`, `cbs-advise`)."""

import json
import math
import os
import subprocess
import sys

import pytest

from cbs.analysis import advice, calibration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_advice_is_the_calibrated_prediction_and_the_tradeoff():
    calib = calibration.shipped()
    a = advice.advise(200.0, optimizer="adamw", batch_size=512, exchange=50.0)
    p = calibration.predict(calib["models"]["b_simple"], 200.0, "adamw", level=0.8)
    assert a.b_crit == pytest.approx(p["b_crit"]) and a.interval == pytest.approx(p["interval"])
    assert a.steps_ratio == pytest.approx(1 + a.b_crit / 512)
    assert a.examples_ratio == pytest.approx(1 + 512 / a.b_crit)
    assert a.best_batch_size == pytest.approx(math.sqrt(50.0 * a.b_crit))
    assert a.interval[0] < a.b_crit < a.interval[1]
    assert a.calibration["studies"] == len(calib["studies"])
    # a wider level gives a wider interval around the same point
    b = advice.advise(200.0, optimizer="adamw", batch_size=512, level=0.95)
    assert b.interval[0] < a.interval[0] and b.interval[1] > a.interval[1]
    assert b.b_crit == pytest.approx(a.b_crit)


def test_a_noise_scale_from_few_examples_or_not_positive_is_flagged():
    few = advice.advise(80.0, optimizer="adam", batch_size=128, examples=128)
    assert any("128 examples" in f for f in few.flags)
    assert "note: noise scale from 128 examples" in advice.summary(few)
    bad = advice.advise(-3.0, optimizer="sgd", batch_size=128)
    assert math.isnan(bad.b_crit) and any("not positive" in f for f in bad.flags)


def _run_dir(path, optimizer="adam"):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"optim": {"name": optimizer}, "batch": {"schedule": {"batch_size": 64}}}, f)
    rows = [{"step": 0, "kind": "eval", "full_train/loss": 2.3},
            {"step": 0, "kind": "train", "data/batch_size": 64, "noise/b_simple": 40.0,
             "noise/batch_size": 1024, "noise/ema_b_simple": 41.0},
            {"step": 5, "kind": "train", "data/batch_size": 64, "noise/ema_b_simple": 55.0},
            {"step": 10, "kind": "eval", "full_train/loss": 1.1},
            {"step": 10, "kind": "train", "data/batch_size": 64, "noise/b_simple": 90.0,
             "noise/batch_size": 1024}]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_trajectory_reads_every_measured_step(tmp_path):
    run = _run_dir(str(tmp_path / "run"))
    tr = advice.trajectory(run)
    assert [a.step for a in tr] == [0, 10]
    assert [a.loss for a in tr] == [2.3, 1.1]
    assert [a.noise_scale for a in tr] == [40.0, 90.0]
    assert tr[1].b_crit == pytest.approx(advice.advise(90.0, optimizer="adam",
                                                       batch_size=64).b_crit)
    assert not tr[1].flags  # 1,024 examples: no flag


def test_cbs_advise_prints_the_answer_and_writes_the_trajectory(tmp_path):
    run = _run_dir(str(tmp_path / "run"), optimizer="sgd")
    out = subprocess.run([sys.executable, "-m", "experiments.advise", f"--workdir={run}",
                          "--exchange=100"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "predicted B_crit" in out.stdout and "sgd optimizers" in out.stdout
    assert "the batch that minimises" in out.stdout
    for name in ("advice.md", "advice.json", "advice.png"):
        assert os.path.getsize(os.path.join(run, name)) > 0
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    bad = subprocess.run([sys.executable, "-m", "experiments.advise", f"--workdir={empty}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "config.json" in bad.stderr
