"""B_crit against the loss across model sizes (`cbs.analysis.sizes`): the pooled GLS fits
and the test of "B_crit depends on L alone", on synthetic studies with known answers."""

import math

import numpy as np
import pytest

from cbs.analysis import sizes

TARGETS = [2.5, 2.4, 2.3, 2.2, 2.1]
ALPHA, B_STAR = 0.2, 2000.0


def _study(label, factor, rng, sd=0.05, targets=TARGETS, rho=0.5):
    """B_crit = factor·B*·L^(−1/α) with correlated log-normal errors across targets."""
    n = len(targets)
    cov = sd ** 2 * (rho + (1 - rho) * np.eye(n))
    err = rng.multivariate_normal(np.zeros(n), cov) if rng is not None else np.zeros(n)
    b = [factor * B_STAR * t ** (-1 / ALPHA) * math.exp(e) for t, e in zip(targets, err,
                                                                          strict=True)]
    half = 1.96 * sd
    return {"label": label, "targets": list(targets), "b_crit": b,
            "b_crit_ci": [(x * math.exp(-half), x * math.exp(half)) for x in b],
            "cov": cov.tolist(), "alpha_b": ALPHA, "alpha_b_ci": (0.1, 0.3), "b_star": B_STAR,
            "power_law_p": 0.5, "sweep_dir": label}


def test_exact_studies_give_the_power_law_and_no_size_effect():
    studies = [_study("a", 1.0, None), _study("b", 1.0, None, targets=TARGETS[1:4])]
    r = sizes.analyze(studies)
    assert r["common_targets"] == TARGETS[1:4]
    assert r["joint"]["alpha_b"] == pytest.approx(ALPHA, rel=1e-9)
    assert r["joint"]["b_star"] == pytest.approx(B_STAR, rel=1e-9)
    assert r["loss_alone"]["chi2"] == pytest.approx(0, abs=1e-9) and r["loss_alone"]["dof"] == 3
    assert r["per_size_b_star"]["b_star"] == pytest.approx([B_STAR, B_STAR], rel=1e-9)


def test_gls_with_equal_independent_errors_is_ordinary_least_squares():
    rng = np.random.default_rng(1)
    studies = [_study(k, 1.0, rng, rho=0.0) for k in "abc"]
    r = sizes.analyze(studies)
    x = np.log(TARGETS * 3)
    y = np.log(np.concatenate([s["b_crit"] for s in studies]))
    slope, intercept = np.polyfit(x, y, 1)
    assert r["joint"]["slope"] == pytest.approx(slope, rel=1e-9)
    assert r["joint"]["b_star"] == pytest.approx(math.exp(intercept), rel=1e-9)


def test_the_loss_alone_test_holds_its_size_and_detects_a_factor_two():
    same = different = 0
    for i in range(200):
        rng = np.random.default_rng(100 + i)
        r = sizes.analyze([_study("a", 1.0, rng), _study("b", 1.0, rng)])
        same += r["loss_alone"]["p"] < 0.05
        r = sizes.analyze([_study("a", 1.0, rng), _study("b", 2.0, rng)])
        different += r["loss_alone"]["p"] < 0.05
        if i == 0:
            ratio = r["per_size_b_star"]["b_star"][1] / r["per_size_b_star"]["b_star"][0]
            assert ratio == pytest.approx(2.0, rel=0.15)
    assert 3 <= same <= 20  # 5 % of 200 is 10; a binomial 99 % range
    assert different >= 190


def test_report_lines_name_the_verdicts():
    rng = np.random.default_rng(5)
    studies = [_study("D = 32", 1.0, rng), _study("D = 64", 3.0, rng)]
    lines = sizes.summary(sizes.analyze(studies))
    assert lines[0].startswith("- B_crit depends on L alone") and "rejected, χ²" in lines[0]
    assert "not rejected" not in lines[0]
    assert any(line.startswith("- Joint power law over all sizes: α_B = ") for line in lines)
    assert "| D = 32 |" in sizes.table(studies)


def test_studies_of_different_experiments_are_refused_in_one_line(tmp_path):
    """--sizes pools model sizes of one experiment: another dataset, model family or target
    metric, or no target in common, is refused before anything is fitted or written."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    kaplan = [str(root / "results" / d) for d in
              ("shakespeare_kaplan_d32", "shakespeare_kaplan", "shakespeare_kaplan_d128")]
    sizes.check_comparable(kaplan)  # the committed study passes
    with pytest.raises(ValueError, match=r"has data \{'name': 'digits'"):
        sizes.check_comparable([kaplan[0], str(root / "results" / "digits")])
    other = tmp_path / "other_targets"
    other.mkdir()
    definition = json.loads((root / "results" / "shakespeare_kaplan" / "sweep.json").read_text())
    definition["config"]["sweep"]["targets"] = [1.9, 1.8]
    (other / "sweep.json").write_text(json.dumps(definition))
    with pytest.raises(ValueError, match="needs a target every study swept"):
        sizes.check_comparable([kaplan[0], str(other)])

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--sizes", kaplan[1],
         str(root / "results" / "digits"), f"--out={out}"], cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --sizes compares model sizes of one experiment")
    assert not out.exists()
