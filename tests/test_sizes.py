"""B_crit against the loss across model sizes (`cbs.analysis.studies.sizes`): the pooled GLS fits
and the test of "B_crit depends on L alone", on synthetic studies with known answers."""

import math

import numpy as np
import pytest

from cbs.analysis.studies import sizes

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
    assert lines[0].startswith("- B_crit depends on L alone") and "rejected, p = " in lines[0]
    assert "(χ² reading)" in lines[0]  # no calibration without each study's noise
    assert "not rejected" not in lines[0]
    assert any(line.startswith("- Joint power law over all sizes: α_B = ") for line in lines)
    assert "| D = 32 |" in sizes.table(studies)


def test_studies_of_different_experiments_are_refused_in_one_line(tmp_path):
    """--sizes pools model sizes of one experiment: another dataset, model family or target
    metric, or no target in common, is refused before anything is fitted or written."""
    import json
    import pathlib

    import _warm

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
    proc = _warm.python(["-m", "experiments.compare", "--sizes", kaplan[1],
                         str(root / "results" / "digits"), f"--out={out}"], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --sizes compares model sizes of one experiment")
    assert not out.exists()


# Calibrated pooled tests: synthetic studies with their trials' structure (tables and fits),
# the one-seed noise of `tests/test_misfit.py`: log-normal step noise shared by the targets at
# a batch size (the same trials give them all) plus each target's own.
BATCH = np.array([2.0**k for k in range(2, 11)])  # 4 … 1024


def _trial_study(label, factor, rng, *, shared=0.1, own=0.05, kink=None):
    """B_crit = factor·B*·L^(−1/α) at TARGETS; `kink` = (target index, factor) moves one
    target off the law."""
    from cbs.analysis.fits import fit, misfit
    from cbs.analysis.fits.selection import BestPerBatchSize

    a = shared * rng.normal(size=BATCH.size)
    tables, points = [], []
    for i, loss in enumerate(TARGETS):
        b_crit = factor * B_STAR * loss ** (-1 / ALPHA) * (kink[1] if kink and kink[0] == i
                                                           else 1.0)
        s = 20 / loss * (1 + b_crit / BATCH) * np.exp(a + own * rng.normal(size=BATCH.size))
        tables.append(BestPerBatchSize(BATCH, s, BATCH * s, np.zeros_like(BATCH),
                                       np.ones_like(BATCH), [], [], [],
                                       seed_steps=[[v] for v in s]))
        points.append(fit.fit_tradeoff(BATCH, s, bootstrap=0))
    noise = misfit.study_noise(tables, TARGETS, points, n=300, seed=int(rng.integers(1 << 30)))
    b = [float(np.exp(v)) for v in noise.log_b_crit]
    return {"label": label, "targets": list(noise.losses), "b_crit": b,
            "b_crit_ci": [(x * 0.9, x * 1.1) for x in b], "cov": noise.cov.tolist(),
            "alpha_b": ALPHA, "alpha_b_ci": (0.1, 0.3), "b_star": B_STAR, "power_law_p": 0.5,
            "sweep_dir": label, "_noise": noise}


def test_calibrated_pooled_p_values_under_true_laws_are_roughly_uniform():
    # 30 pairs of one-seed studies on one law with one B*: the calibrated p of "depends on L
    # alone" and of the joint law have mean ≈ 1/2 (± 0.053 = 1 s.e. of 30 uniform draws;
    # ± 0.15 allowed) and few reject at 5 % (P(≥ 6 of 30) = 0.008 at the nominal rate)
    rng = np.random.default_rng(7)
    p_alone, p_joint = [], []
    for i in range(30):
        studies = [_trial_study("a", 1.0, rng), _trial_study("b", 1.0, rng)]
        r = sizes.analyze(studies, calibrate=200, seed=i)
        p_alone.append(r["loss_alone"]["p_calibrated"])
        p_joint.append(r["joint"]["p_calibrated"])
    for p in (p_alone, p_joint):
        assert 0.35 < np.mean(p) < 0.65, p
        assert np.sum(np.asarray(p) < 0.05) <= 5, p


def test_calibrated_pooled_tests_detect_sizes_and_name_the_target_that_breaks_the_law():
    rng = np.random.default_rng(8)
    # less noise than above (log B* of one such study is uncertain by ~0.1), a true factor 2
    studies = [_trial_study("a", 1.0, rng, shared=0.03, own=0.02, kink=(0, 2.0)),
               _trial_study("b", 2.0, rng, shared=0.03, own=0.02, kink=(0, 2.0))]
    r = sizes.analyze(studies, calibrate=400, seed=0)
    assert r["loss_alone"]["p_calibrated"] < 0.01
    assert r["per_size_b_star"]["p_sizes_differ_calibrated"] < 0.01
    assert r["per_size_b_star"]["p_calibrated"] < 0.01  # the kinked first target
    wb = r["without_breaking"]
    assert wb["target"] == TARGETS[0] and wb["per_size_b_star"]["p_calibrated"] >= 0.05
    assert wb["per_size_b_star"]["alpha_b"] == pytest.approx(ALPHA, rel=0.15)
    ratio = wb["per_size_b_star"]["b_star"][1] / wb["per_size_b_star"]["b_star"][0]
    assert ratio == pytest.approx(2.0, rel=0.15)
    lines = sizes.summary(r)
    assert any(line.startswith(f"- The points at L = {TARGETS[0]} break the law with one B* "
                               "per size") for line in lines)


@pytest.mark.slow
def test_calibrated_loss_alone_test_has_its_nominal_size():
    """300 pairs of one-seed studies under one law: rejections at 5 % within 5 % ± 2.5 %."""
    rng = np.random.default_rng(9)
    p = [sizes.analyze([_trial_study("a", 1.0, rng), _trial_study("b", 1.0, rng)],
                       calibrate=400, seed=i)["loss_alone"]["p_calibrated"] for i in range(300)]
    rate = float(np.mean(np.asarray(p) < 0.05))
    assert 0.025 <= rate <= 0.075, rate
