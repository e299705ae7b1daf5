"""Held-out seeds (`cbs.analysis.fits.held_out`): rates selected on one seed, steps measured on the
others, on synthetic sweeps whose answer is known."""

import pytest

from cbs.analysis.fits import held_out
from cbs.analysis.reports import report_tables

S_MIN, B_CRIT = 40.0, 64.0
SIZES = (8, 16, 32, 64, 128, 256)
RATES = (1e-3, 2e-3, 4e-3)


def _trial(b, lr, seed, steps, status="done"):
    return {"batch_size": b, "learning_rate": lr, "seed": seed, "status": status,
            "steps_to_target": {"1": steps}}


def _sweep(seed_factor, *, dominated=False):
    """S(B, η, seed) = S_min(1 + B_crit/B)·f(η, seed): the best rate is 2e-3 on every seed
    except where seed_factor(seed, b) makes another rate the winner on that seed alone."""
    out = []
    for b in SIZES:
        front = S_MIN * (1 + B_CRIT / b)
        for seed in (0, 1, 2):
            for lr in RATES:
                f = seed_factor(seed, b, lr)
                out.append(_trial(b, lr, seed, front * f))
    if dominated:  # the sweep stopped every rate but each seed's winner at the lowest target
        best = {}
        for r in out:
            k = (r["batch_size"], r["seed"])
            if k not in best or r["steps_to_target"]["1"] < best[k]["steps_to_target"]["1"]:
                best[k] = r
        for r in out:
            if r is not best[(r["batch_size"], r["seed"])]:
                r["steps_to_target"]["1"], r["status"] = None, held_out.DOMINATED
    return out


def _flat(seed, b, lr):  # 2e-3 is best everywhere by 20 %
    return 1.0 if lr == 2e-3 else 1.2


def test_a_rate_that_wins_on_every_seed_gives_the_in_sample_answer():
    t = held_out.held_out_target(_sweep(_flat), 1.0, 0, bootstrap=0)
    assert t["measured_on_seeds"] == [1, 2]
    assert t["fit"]["b_crit"] == pytest.approx(B_CRIT, rel=1e-6)
    assert t["fit_in_sample"]["b_crit"] == pytest.approx(B_CRIT, rel=1e-6)
    assert t["median_ratio"] == pytest.approx(1.0)
    assert all(r["learning_rate"] == 2e-3 for r in t["rows"])


def test_a_rate_lucky_on_the_selecting_seed_costs_its_held_out_steps():
    """On seed 0, at B ≤ 32, 1e-3 is 10 % faster than 2e-3 (luck); on seeds 1 and 2 it is
    30 % slower. Held out, S at those B is 1.3 × the in-sample S, exactly."""
    def lucky(seed, b, lr):
        if lr == 1e-3 and b <= 32:
            return 0.9 if seed == 0 else 1.3
        return _flat(seed, b, lr)

    t = held_out.held_out_target(_sweep(lucky), 1.0, 0, bootstrap=0)
    for r in t["rows"]:
        want = 1.3 if r["batch_size"] <= 32 else 1.0
        assert r["ratio"] == pytest.approx(want, rel=1e-12)
        assert r["learning_rate"] == (1e-3 if r["batch_size"] <= 32 else 2e-3)
    # slower small batches: S_min + E_min/B no longer exact, and B_crit held out is larger
    assert t["fit"]["b_crit"] > 1.1 * t["fit_in_sample"]["b_crit"]
    assert t["fit_in_sample"]["b_crit"] == pytest.approx(B_CRIT, rel=1e-6)


def test_censored_held_out_trials_leave_their_batch_size_out_and_say_why():
    def lucky(seed, b, lr):
        return 0.9 if (lr == 1e-3 and b == 8 and seed == 0) else _flat(seed, b, lr)

    t = held_out.held_out_target(_sweep(lucky, dominated=True), 1.0, 0, bootstrap=0)
    row = next(r for r in t["rows"] if r["batch_size"] == 8)
    assert "censored" in row["left_out"] and "steps" not in row
    assert t["fit"]["n_batch_sizes"] == len(SIZES) - 1
    text = report_tables.held_out_table({"held_out": [t]})
    assert "8 (2 held-out trial(s) stopped by a faster rate (censored))" in text


def test_one_seed_or_an_unknown_seed_is_refused():
    one = [r for r in _sweep(_flat) if r["seed"] == 0]
    with pytest.raises(ValueError, match="select_on_seed=0.*seeds \\[0\\]"):
        held_out.held_out(one, [1.0], 0)
    with pytest.raises(ValueError, match="select_on_seed=5"):
        held_out.held_out(_sweep(_flat), [1.0], 5)


def test_seed_table_puts_the_seed_range_beside_the_bootstrap_interval():
    analysis = {"targets": [{"target": 1.0, "fit": {"status": "ok", "b_crit": 64.0,
                                                    "b_crit_ci": (50.0, 80.0)}}],
                "seeds": [{"target": 1.0, "b_crit_per_seed": {"0": 40.0, "1": 100.0},
                           "steps_spread_median": 0.1, "steps_spread_max": 0.3}]}
    row = report_tables.seed_table(analysis).splitlines()[-1]
    assert row == "| 1 | 64 | 50–80 | 40 | 100 | 40–100 (2.50×) | 10% (30%) |"


@pytest.mark.parametrize("module, study", [("digits_sweep", "digits"),
                                           ("digits_sgd_sweep", "digits_sgd")])
def test_seeds3_presets_repeat_every_trial_and_leave_the_committed_grids_alone(module, study):
    """`:seeds3` runs every (B, η) of the committed study on seeds 0, 1, 2 with no early stop;
    the default preset's trials keep the committed sweep.json's ids and definition."""
    import importlib
    import json
    import pathlib

    from cbs.results.store import SweepStore
    from cbs.sweeps import grid, launch

    config = importlib.import_module(f"cbs.configs.{module}")
    root = pathlib.Path(__file__).resolve().parent.parent / "results" / study
    committed = json.loads((root / "sweep.json").read_text())
    one = config.get_config()
    assert [t["trial_id"] for t in grid.trial_table(grid.make_trials(one.sweep))] == [
        t["trial_id"] for t in committed["trials"]]
    SweepStore(str(root)).check_definition(  # the committed sweep resumes as itself
        launch.sweep_definition(one, grid.make_trials(one.sweep)), "config")
    three = config.get_config("seeds3")
    assert tuple(three.sweep.seeds) == (0, 1, 2) and not three.sweep.stop_when_dominated
    ids = {t.trial_id for t in grid.make_trials(three.sweep)}
    base = {t["trial_id"] for t in committed["trials"]}
    assert base <= ids and len(ids) == 3 * len(base)
    assert {i.replace("_s0", "_s1") for i in base} <= ids
    with pytest.raises(ValueError, match="sweep.seeds"):  # a different study, its own directory
        SweepStore(str(root)).check_definition(
            launch.sweep_definition(three, grid.make_trials(three.sweep)), "config")


@pytest.mark.slow  # 18 tiny trials: about 3 CPU-minutes (22 min on 2 heavily shared cores)
def test_a_tiny_three_seed_sweep_reports_its_held_out_fit(tmp_path):
    from cbs.analysis.reports import report
    from cbs.configs import digits_sweep
    from cbs.sweeps import launch

    d = str(tmp_path)
    launch.run_sweep(digits_sweep.get_config("tiny,seeds3"), d, log=lambda _: None)
    text = open(report.write_report(d, bootstrap=20, select_on_seed=0)).read()
    assert "## Held-out seeds" in text and "range over seeds (max/min)" in text
    rows = report.load_analysis(d)["held_out"]
    assert [r["measured_on_seeds"] for r in rows] == [[1, 2]] * len(rows)
    assert all("censored" not in r.get("left_out", "") for t in rows for r in t["rows"])
