"""experiments.preconditioned_check: the calibration's model on B_simple against B_simple^P
of Adam's update, left one task out; the committed result regenerates from the committed
studies, and the switch rule on synthetic points."""

from __future__ import annotations

import json
import math
import os

import pytest

from experiments import preconditioned_check as pc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_committed_check_regenerates():
    got = json.loads(json.dumps(pc.check(pc.points(ROOT)), default=float))
    with open(os.path.join(ROOT, "results", "preconditioned_check", "check.json")) as f:
        want = json.load(f)
    assert got == want
    with open(os.path.join(ROOT, "results", "preconditioned_check", "report.md")) as f:
        assert f.read() == pc.markdown(want) + "\n"


def _rows(task: str, optimizer: str, ratio: float, ratio_p: float, n: int = 4):
    """n points of one task: B_crit = 100, B_simple = 100/ratio, B_simple^P = 100/ratio_p,
    spread ±20 % so the model has a within-task variance."""
    out = []
    for k in range(n):
        wiggle = 1.2 if k % 2 else 1 / 1.2
        out.append({"study": task, "task": task, "optimizer": optimizer, "target": 1.0,
                    "seed": k, "b_crit": 100.0, "b_simple": 100.0 / ratio * wiggle,
                    "b_simple_p": 100.0 / ratio_p * wiggle})
    return out


def test_the_switch_needs_the_adaptive_points_covered_better():
    # the update's ratio is the same on every adaptive task, the gradient's is not: with
    # B_simple^P every adaptive task is predicted from the others, with B_simple one is off
    rows = (_rows("a", "adam", 1.0, 2.0) + _rows("b", "adam", 1.1, 2.0)
            + _rows("c", "adam", 12.0, 2.0) + _rows("s", "sgd", 0.5, 0.5)
            + _rows("t", "sgd", 0.6, 0.6))
    result = pc.check(rows)
    plain, update = result["b_simple"], result["b_simple_p"]
    assert update["coverage_by_family"]["adaptive"] == 1.0
    assert plain["coverage_by_family"]["adaptive"] < 1.0
    assert result["switch"]
    assert update["ratio"]["adaptive"] == pytest.approx(2.0, rel=0.05)
    # swapped: the gradient's ratio is the steady one, no switch
    for r in rows:
        r["b_simple"], r["b_simple_p"] = r["b_simple_p"], r["b_simple"]
    assert not pc.check(rows)["switch"]
    assert "stays on B_simple" in pc.markdown(pc.check(rows))
    assert math.isfinite(pc.check(rows)["b_simple"]["log_sd"])
