"""The payoff of a ramp: seeded runs against the fixed-batch frontier
(`cbs.analysis.studies.payoff`), and seeded ramp studies written beside a sweep
(`cbs.sweeps.ramps`, `out_dir`)."""

import math
import os

import jax
import numpy as np
import pytest
from scipy import stats

from cbs.analysis.reports import branch_report
from cbs.analysis.studies import payoff
from cbs.results import files, records
from cbs.runtime import mesh
from cbs.sweeps import ramps
from experiments.configs import base
from tests.test_ramps import _config, _fake_sweep

S_MIN, B_CRIT = 50.0, 64.0  # the true frontier of the synthetic studies
SIZES = (8, 16, 32, 64, 128, 256)


def _record(name, seed, schedule, steps, examples):
    return {"label": f"{name} · seed {seed}", "status": "done",
            "spec": {"name": name, "seed": seed, "schedule": schedule},
            "steps_to_target": {"1": steps}, "examples_to_target": {"1": examples}}


def _study(rng, ramp_steps_factor, *, seeds=3, noise=0.05):
    """Fixed batches on the frontier S = S_min(1 + B_crit/B) and one ramp whose steps are
    `ramp_steps_factor` × the frontier's at its examples, each with log-normal seed noise
    (rng None: seed offsets −noise, 0, +noise in log S, so every geometric mean is exact)."""
    def wiggle():
        return [math.exp(noise * (rng.standard_normal() if rng else k - 1))
                for k in range(seeds)]

    out = []
    for b in SIZES:
        for seed, w in enumerate(wiggle()):
            s = S_MIN * (1 + B_CRIT / b) * w
            out.append(_record(f"fixed B={b}", seed, {"kind": "constant", "batch_size": b},
                               s, b * s))
    e_ramp = 4 * S_MIN * B_CRIT  # four times E_min
    s_front = S_MIN * e_ramp / (e_ramp - S_MIN * B_CRIT)
    for seed, w in enumerate(wiggle()):
        out.append(_record("ramp", seed, {"kind": "step", "steps": [[0, 16], [1000, 64]]},
                           ramp_steps_factor * s_front * w, e_ramp * w))
    return out


def test_frontier_maps_are_the_hyperbola_and_its_inverse():
    e_min = S_MIN * B_CRIT
    for b in (4.0, 64.0, 1000.0):
        s, e = S_MIN * (1 + B_CRIT / b), e_min * (1 + b / B_CRIT)
        assert payoff.frontier_steps(S_MIN, e_min, e) == pytest.approx(s, rel=1e-12)
        assert payoff.frontier_examples(S_MIN, e_min, s) == pytest.approx(e, rel=1e-12)
    assert payoff.frontier_steps(S_MIN, e_min, e_min) == math.inf


def test_t_interval_is_the_log_space_student_interval():
    x = np.array([10.0, 12.0, 15.0])
    lo, hi = payoff.t_interval(x)
    logs = np.log(x)
    half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    assert payoff.geometric_mean(x) == pytest.approx(1800 ** (1 / 3))
    assert all(math.isnan(v) for v in payoff.t_interval([3.0]))


def test_a_ramp_on_the_frontier_is_judged_on_it_and_a_faster_one_beats_it():
    on = payoff.analyze(_study(None, 1.0), [1.0], bootstrap=400)["targets"][0]
    fast = payoff.analyze(_study(np.random.default_rng(0), 0.6), [1.0],
                          bootstrap=400)["targets"][0]
    f = on["frontier"]
    assert (f["s_min"], f["e_min"]) == pytest.approx((S_MIN, S_MIN * B_CRIT), rel=1e-6)
    ramp_on = next(r for r in on["rows"] if r["run"] == "ramp")
    ramp_fast = next(r for r in fast["rows"] if r["run"] == "ramp")
    lo, hi = ramp_on["step_saving_ci"]
    assert ramp_on["step_saving"] == pytest.approx(0, abs=1e-6) and lo < 0 < hi
    assert payoff.verdict(ramp_on).startswith("on the frontier")
    assert ramp_fast["step_saving"] == pytest.approx(0.4, abs=0.08)
    assert ramp_fast["step_saving_ci"][0] > 0.2
    assert payoff.verdict(ramp_fast) == "beats the frontier"
    assert ramp_fast["example_cost_ci"][1] < 0  # the same point, seen at equal steps


def test_saving_interval_covers_the_truth_at_the_nominal_rate():
    """Coverage of the bootstrap interval of the step saving over 60 synthetic studies (3
    seeds per run): a percentile bootstrap over 3 seeds is known to be narrow, so the bar is
    ≥ 75 %, with the true saving 0.3."""
    hits = 0
    for i in range(60):
        rng = np.random.default_rng(100 + i)
        t = payoff.analyze(_study(rng, 0.7), [1.0], bootstrap=200)["targets"][0]
        lo, hi = next(r for r in t["rows"] if r["run"] == "ramp")["step_saving_ci"]
        hits += lo <= 0.3 <= hi
    assert hits >= 45


def test_analysis_depends_only_on_the_records_and_counts_missing_seeds():
    study = _study(np.random.default_rng(3), 0.8)
    a = payoff.analyze(study, [1.0], bootstrap=200)
    b = payoff.analyze(list(reversed(study)), [1.0], bootstrap=200)
    rows = lambda r: sorted(r["targets"][0]["rows"], key=lambda x: x["run"])
    assert rows(a) == rows(b)
    study[-1]["steps_to_target"]["1"] = None  # one seed of the ramp never reached L
    row = next(r for r in payoff.analyze(study, [1.0], bootstrap=50)["targets"][0]["rows"]
               if r["run"] == "ramp")
    assert row["reached"] == 2 and "steps" not in row and payoff.verdict(row) == "2/3 seeds reached"


def test_report_has_every_run_and_the_verdicts(tmp_path):
    study = _study(np.random.default_rng(4), 0.6)
    path = payoff.write_report(str(tmp_path), study, [1.0], sweep_dir="SWEEP", bootstrap=100)
    text = open(path).read()
    assert "**ramp** (examples vs the frontier at equal steps): L=1: -" in text
    assert "beats the frontier" in text
    assert sum(line.startswith("| fixed B=") for line in text.splitlines()) == len(SIZES)
    assert "| ramp | 16 | fixed B=16 | 3 |" in text  # against the fixed run at its first B
    assert (tmp_path / files.PAYOFF_FIGURE_FILE).exists()
    assert (tmp_path / files.PAYOFF_FILE).exists()


def test_local_cbs_schedule_is_the_running_maximum_of_the_committed_study():
    got = branch_report.local_cbs_schedule("results/digits_branch", multiple=8)
    points = branch_report.summarize("results/digits_branch")
    assert got["kind"] == "step" and got["steps"][0][0] == 0
    sizes = [b for _, b in got["steps"]]
    assert sizes == sorted(set(sizes)) and sizes[-1] == max(p["b_star"] for p in points)
    thresholds = {p["point_examples"] for p in points}
    assert all(e in thresholds for e, _ in got["steps"][1:])


def test_seeded_ramps_go_to_out_dir_and_leave_the_sweep_alone(tmp_path):
    sweep, out = str(tmp_path / "sweep"), str(tmp_path / "out")
    _fake_sweep(sweep)
    before = sorted(os.listdir(sweep))
    c = _config()
    c.ramps = base.seeded([c.ramps[0] | {"max_steps": 20}], (0, 1))
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    got = ramps.run_ramps(c, sweep, log=lambda _: None, mesh=one, out_dir=out)
    assert sorted(os.listdir(sweep)) == before
    assert [r["spec"]["seed"] for r in got] == [0, 1]
    assert {payoff.run_name(r) for r in got} == {"fixed"}
    curves = [r["curve"]["full_train/loss"] for r in got]
    assert curves[0] != curves[1]  # the seeds train differently
    assert len(records.read_records(os.path.join(out, files.RAMPS_FILE))) == 2


def test_a_ramp_below_the_fitted_frontier_is_compared_with_the_best_fixed_batch():
    ramp = {"steps": 10.0, "step_saving_ci": (0.1, 0.3), "example_cost_ci": (-0.3, -0.1),
            "reached": 3, "num_seeds": 3}
    assert payoff.verdict(ramp) == "beats the frontier"
    far = {"run": "fixed B=64", "example_cost": -0.2}
    near = {"run": "fixed B=32", "example_cost": -0.05}
    assert payoff.verdict(ramp, far) == ("beats the fitted frontier, not the best fixed batch "
                                         "(fixed B=64: -20 %)")
    assert payoff.verdict(ramp, near) == "beats the frontier and every fixed batch"
    t = {"rows": [{"run": "a", "batch_size": 8, "example_cost": 0.1},
                  {"run": "b", "batch_size": 16, "example_cost": -0.2},
                  {"run": "r", "batch_size": None, "example_cost": -0.5}]}
    assert payoff.best_fixed(t)["run"] == "b"


def test_an_example_cost_of_100_percent_or_more_is_printed_as_it_is():
    """'100 %*' marks a step saving of 1 (the run used at most E_min examples); a ramp that
    spends twice the frontier's examples or more must not read as that."""
    t = payoff.analyze(_study(None, 3.0), [1.0], bootstrap=50)["targets"][0]
    ramp = next(r for r in t["rows"] if r["run"] == "ramp")
    assert ramp["example_cost"] > 1
    row = next(line for line in payoff.table(t).splitlines() if line.startswith("| ramp |"))
    assert f"{100 * ramp['example_cost']:+.0f} %" in row
    assert row.count("100 %*") == 0
