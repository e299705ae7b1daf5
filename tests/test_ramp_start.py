"""A ramp against the fixed run at its first batch size (`cbs.analysis.studies.ramp_start`): the
paired power calculation against closed forms and published values, and the comparison on
synthetic seeds with a known saving."""

import math
import os

import numpy as np
import pytest
from scipy import stats

from cbs.analysis.studies import payoff, ramp_start
from cbs.configs import base


def test_power_matches_the_published_paired_t_value():
    """Cohen's d = 1, n = 10 pairs, α = 0.05 two-sided: power 0.8031 (G*Power)."""
    effect = 1 - math.exp(-1.0)  # −log(1 − effect) = 1 = σ
    assert ramp_start.paired_power(10, 1.0, effect) == pytest.approx(0.8031, abs=5e-4)
    assert ramp_start.seeds_needed(1.0, effect) == 10


def test_seeds_needed_approaches_the_normal_formula_for_small_effects():
    """n ≈ ((z_{1−α/2} + z_{power})·σ/δ)² (+ about 2 for the t distribution)."""
    sd = 0.5
    delta = -math.log(0.85)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    normal = (z * sd / delta) ** 2
    n = ramp_start.seeds_needed(sd)
    assert normal < n <= normal + 3
    assert ramp_start.paired_power(n, sd) >= 0.8 > ramp_start.paired_power(n - 1, sd)


def test_detectable_effect_inverts_the_power():
    for n, sd in ((3, 0.1), (10, 0.2)):
        e = ramp_start.detectable_effect(n, sd)
        assert ramp_start.paired_power(n, sd, e) == pytest.approx(0.8, abs=1e-6)
    assert math.isnan(ramp_start.detectable_effect(1, 0.1))


def _record(name, seed, schedule, steps, examples):
    return {"label": f"{name} · seed {seed}", "status": "done", "learning_rate": 1e-3,
            "spec": {"name": name, "seed": seed, "schedule": schedule},
            "steps_to_target": {"1": steps}, "examples_to_target": {"1": examples}}


def test_a_ramp_with_a_known_saving_against_its_first_batch():
    """Fixed B = 16 takes S_s steps on seed s; the ramp takes 0.7·S_s·w_s steps (w_s the seed
    noise, product 1) and the same examples: steps saved exp-mean is exactly 30 %."""
    ramp_sched = {"kind": "step", "steps": [[0, 16], [800, 64]]}
    assert ramp_start.start_batch_size({"schedule": ramp_sched}) == 16
    w = np.exp([-0.1, 0.0, 0.1])
    fixed = [_record("fixed B=16", s, {"kind": "constant", "batch_size": 16}, 100.0 * (s + 1),
                     1600.0 * (s + 1)) for s in range(3)]
    ramp = [_record("ramp", s, ramp_sched, 70.0 * (s + 1) * w[s], 1600.0 * (s + 1))
            for s in range(3)]
    row = ramp_start.compare(ramp, fixed, "1", bootstrap=500)
    assert row["step_saving"] == pytest.approx(0.3, abs=1e-12)
    assert row["example_ratio"] == pytest.approx(0.0, abs=1e-12)
    assert row["sd_log_steps"] == pytest.approx(0.1, rel=1e-12)
    lo, hi = row["step_saving_t_ci"]
    half = stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3)
    assert (lo, hi) == pytest.approx((1 - 0.7 * math.exp(half), 1 - 0.7 * math.exp(-half)))
    assert row["seeds_needed"] == ramp_start.seeds_needed(0.1)
    assert ramp_start.verdict(row | {"fixed_run": "fixed B=16"}).startswith(
        "fewer steps than the fixed run, no more examples")


def test_payoff_tunes_each_fixed_baseline_per_target_and_pairs_each_ramp():
    """Two rates at B = 16: the faster one stands for B = 16 (in the frontier and as the
    ramp's baseline); the slower one is shown, not fitted."""
    const = lambda b: {"kind": "constant", "batch_size": b}
    recs = []
    for s in range(3):
        for b in (16, 32, 64, 128):
            st = 50.0 * (1 + 64 / b) * (1 + 0.01 * s)
            recs.append(_record(f"fixed B={b}", s, const(b), st, b * st))
        st = 50.0 * (1 + 64 / 16) * 0.9 * (1 + 0.01 * s)  # a faster rate at B = 16
        recs.append(_record("fixed B=16 · η=2e-3", s, const(16), st, 16 * st))
        recs.append(_record("ramp", s, {"kind": "linear", "start": 16, "end": 64, "over": 999},
                            0.5 * st, 16 * st))
    t = payoff.analyze(recs, [1.0], bootstrap=50)["targets"][0]
    assert t["tuned_fixed"]["16"] == "fixed B=16 · η=2e-3"
    slow = next(r for r in t["rows"] if r["run"] == "fixed B=16")
    assert slow["tuned"] is False and "slower rate" in payoff.table(t)
    start = t["start"][0]
    assert start["fixed_run"] == "fixed B=16 · η=2e-3"
    assert start["step_saving"] == pytest.approx(0.5, abs=1e-12)


def test_a_ramp_that_never_left_its_first_batch_is_said_to_be_the_fixed_run():
    sched = {"kind": "adaptive", "initial": 16, "min_batch": 16}
    fixed = [_record("fixed", s, {"kind": "constant", "batch_size": 16}, 100.0 + s, 1600.0 + s)
             for s in range(3)]
    ramp = [_record("ramp", s, sched, (100.0 + s) * (1 + 1e-9), 1600.0 + s) for s in range(3)]
    row = ramp_start.compare(ramp, fixed, "1", bootstrap=50) | {"fixed_run": "fixed"}
    assert ramp_start.verdict(row) == "the fixed run's steps (the ramp had not left B_0)"
    t = {"target": 1.0, "start": [row | {"run": "ramp", "start_batch_size": 16}]}
    assert "1 seeds" not in "\n".join(ramp_start.summary_lines([t]))


def test_the_start_study_pairs_every_ramp_with_fixed_runs_at_its_first_batch():
    """`digits_payoff.py:start`: every ramp's first batch size has fixed runs at every rate
    that is the sweep's best there for some target, every run on every seed, seed-major."""
    from cbs.configs import digits_payoff

    runs = list(digits_payoff.get_config("start").ramps)
    seeds = digits_payoff.START_SEEDS
    names = list(dict.fromkeys(r["name"] for r in runs))
    assert [r["seed"] for r in runs] == sorted(r["seed"] for r in runs)
    assert len(runs) == len(names) * len(seeds)
    ramps = [r for r in runs[:len(names)] if not r["name"].startswith("fixed")]
    assert len(ramps) == 4
    for ramp in ramps:
        b0 = ramp_start.start_batch_size(ramp)
        at_b0 = [r for r in runs[:len(names)] if r["schedule"] == {"kind": "constant",
                                                                   "batch_size": b0}]
        rates = set(digits_payoff.target_rates(
            os.path.join(base.repo_root(), digits_payoff.SWEEP_DIR), b0).values())
        assert len(at_b0) == len(rates) >= 1, (ramp["name"], b0)
