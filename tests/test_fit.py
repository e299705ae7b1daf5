"""Tests for cbs.analysis.fits.fit: hyperbola and power-law fits (recovery, coverage), crossings."""

import json
import math

import numpy as np
import pytest

from cbs.analysis.fits import fit, selection

S_MIN, E_MIN = 200.0, 12800.0  # B_crit = 64
BATCH_SIZES = 2.0 ** np.arange(2, 12)  # 4 .. 2048, B_crit in the middle


def _noisy_steps(seed, sigma=0.1, batch_sizes=BATCH_SIZES):
    rng = np.random.default_rng(seed)
    return (S_MIN + E_MIN / batch_sizes) * np.exp(sigma * rng.standard_normal(batch_sizes.size))


def test_exact_data_gives_exact_parameters():
    steps = S_MIN + E_MIN / BATCH_SIZES
    for method in ("lsq", "robust"):
        f = fit.fit_tradeoff(BATCH_SIZES, steps, bootstrap=50, method=method)
        assert f.status == "ok" and f.n_points == 10 and f.n_batch_sizes == 10
        np.testing.assert_allclose([f.s_min, f.e_min, f.b_crit], [S_MIN, E_MIN, 64.0],
                                   rtol=1e-9)
        np.testing.assert_allclose(f.b_crit_ci, (64.0, 64.0), rtol=1e-9)
        assert f.residual_std < 1e-9 and f.warnings == ()
    np.testing.assert_allclose(f.steps(64.0), 2 * S_MIN)
    np.testing.assert_allclose(f.examples(64.0), 2 * E_MIN)


def test_exact_data_far_from_initial_guess():
    # Only three points, all well below B_crit but one: the fit must still be exact.
    b = np.array([1.0, 3.0, 5000.0])
    s_min, e_min = 7.0, 3.0e5
    f = fit.fit_tradeoff(b, s_min + e_min / b, bootstrap=0)
    np.testing.assert_allclose([f.s_min, f.e_min], [s_min, e_min], rtol=1e-9)


def test_recovers_parameters_within_own_interval_in_90_percent_of_seeds():
    # 10 batch sizes, 10 % log-normal noise, 95 % intervals. Over 1000 seeds this scheme
    # covers S_min, E_min, B_crit in 94.8 %, 93.2 %, 92.9 % (bootstrap-t on residuals).
    hits = np.zeros(3)
    for seed in range(100):
        f = fit.fit_tradeoff(BATCH_SIZES, _noisy_steps(seed), bootstrap=200, seed=seed)
        for i, (true, ci) in enumerate([(S_MIN, f.s_min_ci), (E_MIN, f.e_min_ci),
                                        (64.0, f.b_crit_ci)]):
            hits[i] += ci[0] <= true <= ci[1]
        assert f.s_min_ci[0] < f.s_min < f.s_min_ci[1]
    assert np.all(hits >= 90), hits


def test_interval_width_shrinks_with_repeats():
    one = fit.fit_tradeoff(BATCH_SIZES, _noisy_steps(1), bootstrap=200)
    b4 = np.repeat(BATCH_SIZES, 4)
    four = fit.fit_tradeoff(b4, _noisy_steps(1, batch_sizes=b4), bootstrap=200)
    ratio = lambda ci: ci[1] / ci[0]
    assert ratio(four.b_crit_ci) < ratio(one.b_crit_ci)
    assert four.n_points == 40 and four.n_batch_sizes == 10


def test_pairs_resampling_also_covers():
    f = fit.fit_tradeoff(BATCH_SIZES, _noisy_steps(3), bootstrap=300, resample="pairs")
    assert f.b_crit_ci[0] < 64.0 < f.b_crit_ci[1]


def test_insufficient_data_never_crashes():
    for b, s in [([], []), ([64], [10]), ([32, 64, 64], [20, 10, 11]),
                 ([16, 32, 64, 128], [None, float("nan"), 10, 9])]:
        f = fit.fit_tradeoff(b, s)
        assert f.status == "insufficient data" and not f.ok
        assert math.isnan(f.b_crit) and math.isnan(f.s_min_ci[0])
    f = fit.fit_tradeoff([16, 32, 64, 128], [None, 30, 20, -1])
    assert f.n_dropped == 2 and f.n_batch_sizes == 2
    blob = json.dumps(f.to_dict())  # NaN becomes null: valid JSON
    assert json.loads(blob)["b_crit"] is None


@pytest.mark.parametrize("steps", [[10, 20, 40, 80], [10, 10, 10, 10],
                                   [1e-300, 1e-301, 1e-302, 1e-303],
                                   [1e300, 1e299, 1e298, 1e297]])
def test_pathological_tables_do_not_crash(steps):
    with np.errstate(all="raise"):  # no floating-point error escapes either
        f = fit.fit_tradeoff([1, 2, 4, 8], steps, bootstrap=50, method="robust")
    # B_crit outside [1, 8] is flagged: a warning, or (S falling at least as fast as 1/B
    # everywhere) no B_crit at all but its lower bound.
    assert (f.status == "ok" and f.warnings) or f.status == (
        "unbounded: S falls as 1/B up to the largest batch size, so B_crit > 8")


def test_drops_unreached_and_reports_it():
    steps = list(S_MIN + E_MIN / BATCH_SIZES)
    steps[0] = None  # the smallest batch never reached the target
    f = fit.fit_tradeoff(BATCH_SIZES, steps, bootstrap=0)
    assert f.n_dropped == 1 and f.n_points == 9
    np.testing.assert_allclose(f.b_crit, 64.0, rtol=1e-9)


def test_warns_when_b_crit_is_extrapolated():
    b = np.array([256.0, 512.0, 1024.0, 2048.0])
    f = fit.fit_tradeoff(b, S_MIN + E_MIN / b, bootstrap=0)
    assert any("outside the sampled" in w for w in f.warnings)


def test_robust_variant_handles_floor_points():
    # The two largest batch sizes are stuck at 2·S_min (e.g. the run cannot finish before its
    # warmup ends). Least squares is pulled far off; the robust fit is not.
    err = {"lsq": [], "robust": []}
    for seed in range(20):
        steps = _noisy_steps(seed, sigma=0.05)
        steps[-2:] = 2 * S_MIN
        for m in err:
            f = fit.fit_tradeoff(BATCH_SIZES, steps, bootstrap=0, method=m)
            err[m].append(abs(f.b_crit / 64.0 - 1))
    assert np.median(err["lsq"]) > 0.25
    assert np.median(err["robust"]) < 0.08 and max(err["robust"]) < 0.2
    # On clean data the robust fit costs little.
    clean = [abs(fit.fit_tradeoff(BATCH_SIZES, _noisy_steps(s, 0.05), bootstrap=0,
                                  method="robust").b_crit / 64 - 1) for s in range(20)]
    assert np.median(clean) < 0.06


def test_robust_interval_covers():
    f = fit.fit_tradeoff(BATCH_SIZES, _noisy_steps(5), bootstrap=200, method="robust")
    assert f.status == "ok" and f.b_crit_ci[0] < 64.0 < f.b_crit_ci[1]


def test_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        fit.fit_tradeoff(BATCH_SIZES, BATCH_SIZES, method="magic")


# ---------------------------------------------------------------- power law

B_STAR, ALPHA = 2.0e8, 0.21  # Kaplan et al. 2020 (tokens, nats)
LOSSES = np.linspace(2.5, 5.0, 8)


def test_power_law_exact_and_noisy_recovery():
    f = fit.fit_power_law(LOSSES, B_STAR / LOSSES ** (1 / ALPHA), bootstrap=100)
    np.testing.assert_allclose([f.b_star, f.alpha_b], [B_STAR, ALPHA], rtol=1e-9)
    np.testing.assert_allclose(f.b_crit(3.0), B_STAR / 3.0 ** (1 / ALPHA), rtol=1e-9)
    hits = np.zeros(2)
    for seed in range(50):
        rng = np.random.default_rng(seed)
        b = B_STAR / LOSSES ** (1 / ALPHA) * np.exp(0.15 * rng.standard_normal(LOSSES.size))
        f = fit.fit_power_law(LOSSES, b, bootstrap=300, seed=seed)
        hits += [f.b_star_ci[0] <= B_STAR <= f.b_star_ci[1],
                 f.alpha_b_ci[0] <= ALPHA <= f.alpha_b_ci[1]]
        assert abs(f.alpha_b / ALPHA - 1) < 0.3
    assert np.all(hits >= 45), hits


def test_power_law_insufficient_and_flat():
    f = fit.fit_power_law([3.0, 2.0], [10.0, 20.0])
    assert f.status == "insufficient data" and math.isnan(f.alpha_b)
    f = fit.fit_power_law([3.0, 2.0, 1.0, 0.5], [10.0, None, float("nan"), 40.0])
    assert f.status == "insufficient data" and f.n_points == 2
    # No trend: the alpha interval is open-ended, not a crash.
    rng = np.random.default_rng(0)
    f = fit.fit_power_law(LOSSES, 100 * np.exp(0.3 * rng.standard_normal(LOSSES.size)))
    assert f.ok and f.slope_ci[0] < 0 < f.slope_ci[1] and f.alpha_b_ci[1] == math.inf
    json.dumps(f.to_dict())


# ---------------------------------------------------------------- helpers

def test_steps_to_target_interpolation_exact_on_exponential_decay():
    # Crossings are interpolated in log loss: exact for L(s) = exp(−s/300) between any two
    # evaluations, however far apart.
    steps = np.arange(0, 1001, 40)
    loss = np.exp(-steps / 300.0)
    for target in (0.5234, 0.2, 0.05):
        assert selection.steps_to_target(steps, loss, target) == pytest.approx(
            -300.0 * math.log(target), abs=1e-9)
    assert selection.steps_to_target(steps, loss, 0.5234, interpolate=False) == 200.0
    assert selection.steps_to_target(steps, loss, 2.0) == 0.0
    assert selection.steps_to_target(steps, loss, 0.01) is None  # exp(−1000/300) ≈ 0.036


def test_steps_to_target_first_crossing_nan_and_nonpositive():
    steps = [0, 10, 20, 30, 40]
    loss = [1.0, 0.4, 0.8, 0.2, float("nan")]
    assert selection.steps_to_target(steps, loss, 0.5) == pytest.approx(
        10 * math.log(2.0) / math.log(2.5))
    assert selection.steps_to_target(steps, [1.0, float("nan"), float("nan")], 0.5) is None
    # A metric that can reach zero or below is interpolated linearly.
    assert selection.steps_to_target([0, 10], [1.0, -1.0], 0.0) == pytest.approx(5.0)


def test_best_per_batch_size():
    recs = [
        {"batch_size": 8, "learning_rate": 0.1, "steps": 100},
        {"batch_size": 8, "learning_rate": 0.2, "steps": 80},
        {"batch_size": 8, "learning_rate": 0.4, "steps": None},
        {"batch_size": 16, "learning_rate": 0.1, "steps": 60, "seed": 0},
        {"batch_size": 16, "learning_rate": 0.2, "steps": 40, "seed": 0},
        {"batch_size": 16, "learning_rate": 0.2, "steps": 50, "seed": 1},
        {"batch_size": 16, "learning_rate": 0.4, "steps": 30, "seed": 0},
        {"batch_size": 16, "learning_rate": 0.4, "steps": None, "seed": 1},
        {"batch_size": 32, "learning_rate": 0.1, "steps": None},
        {"batch_size": 32, "learning_rate": 0.2, "steps": float("nan")},
    ]
    best = selection.best_per_batch_size(recs)
    np.testing.assert_array_equal(best.batch_sizes, [8, 16])
    # B = 16: seed 0's best is 30 steps at 0.4, seed 1's 50 at 0.2; S is their mean.
    np.testing.assert_array_equal(best.steps, [80, 40])
    np.testing.assert_array_equal(best.examples, [640, 640])
    np.testing.assert_allclose(best.learning_rates, [0.2, math.sqrt(0.2 * 0.4)], rtol=1e-12)
    np.testing.assert_array_equal(best.num_seeds, [1, 2])
    assert best.seed_steps == [[80.0], [30.0, 50.0]]
    assert best.seed_learning_rates == [[0.2], [0.4, 0.2]]
    assert [[r["steps"] for r in rows] for rows in best.best_rows] == [[80], [30, 50]]
    assert best.missing_batch_sizes == [32.0]
    # Both seeds' optima at B = 16 sit at an edge of the rates each seed tried.
    assert len(best.unreached) == 4 and best.edge_batch_sizes == [16.0]
    edge = selection.best_per_batch_size(recs[:2])
    assert edge.edge_batch_sizes == [8.0]
    # A batch size where one seed never reached the target is missing, not averaged.
    one_missed = recs[3:8] + [{"batch_size": 16, "learning_rate": 0.2, "steps": None,
                               "seed": 2}]
    assert selection.best_per_batch_size(one_missed).missing_batch_sizes == [16.0]


def test_best_per_batch_size_takes_each_seeds_optimum_under_early_stopping():
    """The failure found in the character-LM Kaplan study at L = 2.1, B = 256: each (B, seed)
    group stops once one rate has crossed, so seed 0's winner (6e-3, 130.0 steps) has no
    crossing in seed 1 and seed 1's winner (3e-3, 141.5) none in seed 0. Averaging per
    (B, η) first kept only 1.5e-3, which both seeds finished (182.7 steps, +35 %)."""
    recs = [
        {"batch_size": 256, "learning_rate": 3e-3, "seed": 0, "steps": None},
        {"batch_size": 256, "learning_rate": 6e-3, "seed": 0, "steps": 129.97},
        {"batch_size": 256, "learning_rate": 1.2e-2, "seed": 0, "steps": None},
        {"batch_size": 256, "learning_rate": 3e-3, "seed": 1, "steps": 141.49},
        {"batch_size": 256, "learning_rate": 6e-3, "seed": 1, "steps": None},
        {"batch_size": 256, "learning_rate": 1.2e-2, "seed": 1, "steps": None},
        {"batch_size": 256, "learning_rate": 1.5e-3, "seed": 0, "steps": 180.07},
        {"batch_size": 256, "learning_rate": 1.5e-3, "seed": 1, "steps": 185.42},
        {"batch_size": 256, "learning_rate": 7.5e-4, "seed": 0, "steps": 284.55},
        {"batch_size": 256, "learning_rate": 7.5e-4, "seed": 1, "steps": 276.98},
    ]
    best = selection.best_per_batch_size(recs)
    np.testing.assert_allclose(best.steps, [(129.97 + 141.49) / 2], rtol=1e-12)
    assert best.seed_learning_rates == [[6e-3, 3e-3]] and best.edge_batch_sizes == []
    # Through a fit: a sweep on S = 100 + 6400/B (B_crit = 64) whose seeds alternate their
    # best rate at every B, each losing its rival's crossing to early stopping, while a slow
    # rate (1.4x the steps) finishes in both. The per-seed optimum recovers B_crit exactly.
    rows = []
    for b in (8, 16, 32, 64, 128, 256, 512):
        s = 100 + 6400 / b
        for sd, (fast, other) in enumerate(((0.01, 0.02), (0.02, 0.01))):
            rows += [{"batch_size": b, "learning_rate": fast, "seed": sd, "steps": s},
                     {"batch_size": b, "learning_rate": other, "seed": sd, "steps": None},
                     {"batch_size": b, "learning_rate": 0.005, "seed": sd, "steps": 1.4 * s}]
    best = selection.best_per_batch_size(rows)
    f = fit.fit_tradeoff(best.batch_sizes, best.steps, bootstrap=0)
    assert f.b_crit == pytest.approx(64.0, rel=1e-9)
    np.testing.assert_allclose(best.steps, 100 + 6400 / best.batch_sizes, rtol=1e-12)


def test_noise_scale_at_crossing_is_ratio_of_window_means():
    steps = np.arange(0, 1000, 5.0)
    trace_sigma = np.full(steps.size, 50.0)
    # |G|² alternates 0.2, 0.8 (true mean 0.5): single-snapshot B_simple swings 4-fold.
    grad_sq = np.where(np.arange(steps.size) % 2 == 0, 0.2, 0.8)
    snapshots = trace_sigma / grad_sq
    assert snapshots.max() / snapshots.min() == pytest.approx(4.0)
    b = selection.noise_scale_at_crossing(steps, trace_sigma, grad_sq, 500.0, window=100.0)
    # 21 points in [450, 550]: 11 of 0.2, 10 of 0.8.
    assert b == pytest.approx(50.0 / ((11 * 0.2 + 10 * 0.8) / 21), rel=1e-12)
    assert abs(b / 100.0 - 1) < 0.03
    # Relative default window, nearest points when the window is empty, NaN without a crossing.
    assert selection.noise_scale_at_crossing(steps, trace_sigma, grad_sq, 500.0) == pytest.approx(
        50.0 / np.mean(grad_sq[(steps >= 450) & (steps <= 550)]))
    sparse = selection.noise_scale_at_crossing([0, 400, 800], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0],
                                         500.0, window=10.0, min_points=2)
    assert sparse == pytest.approx((2.0 + 3.0) / 2.0)
    assert math.isnan(selection.noise_scale_at_crossing(steps, trace_sigma, grad_sq, None))


def test_steps_proportional_to_one_over_b_give_an_unbounded_status_not_infinity():
    """S = 384/B at every B tried (perfect scaling, no floor): least squares drives S_min to 0
    and B_crit to ∞; the fit says B_crit exceeds the largest batch size instead."""
    b = np.array([8.0, 32.0, 128.0])
    f = fit.fit_tradeoff(b, 384.0 / b, bootstrap=50)
    assert not f.ok and f.status.startswith("unbounded") and "B_crit > 128" in f.status
    assert math.isnan(f.b_crit)
