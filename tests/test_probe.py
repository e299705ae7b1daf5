"""The task's own calibration (`cbs.analysis.advice.probe`, `cbs.sweeps.probe_runs`, `cbs-advise
--probe`): a tiny run probed end to end within its budget; the ratio against a brute-force
float64 recomputation; the combination against its closed form; the committed evidence."""

import itertools
import json
import math
import os
import re
import tomllib

import _warm
import ml_collections
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS
from scipy import stats

from cbs.analysis.advice import probe, probe_evidence
from cbs.analysis.reports import branch_report
from cbs.engine import live_advice
from cbs.results import calibration, files, records, shared

with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "pyproject.toml"), "rb") as _f:
    SCRIPTS = tomllib.load(_f)["project"]["scripts"]  # console script -> module:function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _brute_force(rows, noise_scale, epsilon):
    """k* by the definition, in float64, relative ε, the paper's criterion; the bootstrap over
    every resample of the seeds; log ratio and se as `probe` states them."""
    ks = sorted({r["k"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    b0 = rows[0]["reference_batch_size"]
    table = np.zeros((len(seeds), len(ks)), np.float64)
    for r in rows:
        table[seeds.index(r["seed"]), ks.index(r["k"])] = np.float64(r["full_train/loss"])

    def k_star(losses):
        best = 0
        for j in range(1, len(ks)):
            if losses[j] <= min(losses[:j]) * (1 + epsilon):
                best = j
        return best

    def log_b(j):  # geometric midpoint of the bracket; a resample at the top: k_max·b_0
        if j == len(ks) - 1:
            return math.log(b0 * ks[-1])
        return math.log(b0) + 0.5 * (math.log(ks[j]) + math.log(ks[j + 1]))

    j = k_star(table.mean(axis=0))
    if j in (0, len(ks) - 1):  # a bound
        return j, math.nan, math.nan
    boots = [log_b(k_star(table[list(idx)].mean(axis=0)))
             for idx in itertools.product(range(len(seeds)), repeat=len(seeds))]
    se = math.sqrt(np.var(boots) + (math.log(ks[j + 1] / ks[j])) ** 2 / 12)
    return j, log_b(j) - math.log(noise_scale), se


def _rows(losses_SxK, ks, b0=8):
    return [{"point_step": 100, "point_examples": 800, "k": k, "seed": s + 1,
             "reference_batch_size": b0, "batch_size": k * b0, "steps": 64 // k,
             "full_train/loss": float(losses_SxK[s, i])}
            for s in range(losses_SxK.shape[0]) for i, k in enumerate(ks)]


def test_the_ratio_is_the_brute_force_criterion_in_float64():
    """Random ladders whose losses straddle ε: the probe's ratio, its seed spread and its
    standard error equal the brute-force recomputation to 1e-12; bounds give no ratio."""
    rng = np.random.default_rng(0)
    ks = (1, 2, 4, 8, 16)
    checked = 0
    for _ in range(200):
        base = 1.0 + np.cumsum(rng.uniform(-0.02, 0.04, len(ks)))
        losses = base[None, :] * (1 + rng.normal(0, 0.01, (3, len(ks))))
        rows = _rows(losses, ks)
        got = probe.local_ratio(rows, 37.0, epsilon=0.02)
        j, want_log, want_se = _brute_force(rows, 37.0, 0.02)
        assert got["k_star"] == ks[j]
        if j in (0, len(ks) - 1):  # the ladder's ends: a bound
            assert got["bound"] and math.isnan(got["log_ratio"])
            continue
        checked += 1
        assert got["bound"] == ""
        np.testing.assert_allclose(got["log_ratio"], want_log, rtol=1e-12)
        np.testing.assert_allclose(got["se"], want_se, rtol=1e-12)
    assert checked > 50


def test_the_committed_branch_points_give_the_reports_bracket():
    """On results/digits_branch the probe's bracket starts at the report's B* (k*·B, the
    study's rule) at every point, and its ratio is the brute force's."""
    d = records.read_json(os.path.join(ROOT, "results/digits_branch", files.DEFINITION_FILE))
    report = branch_report.summarize(os.path.join(ROOT, "results/digits_branch"))
    rows = shared.read_merged(os.path.join(ROOT, "results/digits_branch",
                                            files.BRANCHES_FILE), ("point_step", "k", "seed"))
    for p in report:
        mine = [r for r in rows if r["point_step"] == p["point_step"]]
        got = probe.local_ratio(mine, p["b_simple"], epsilon=d["branch"]["epsilon"])
        assert got["b_pass"] == p["b_star"]
        if not got["bound"]:
            _, want_log, want_se = _brute_force(mine, p["b_simple"], d["branch"]["epsilon"])
            np.testing.assert_allclose([got["log_ratio"], got["se"]], [want_log, want_se],
                                       rtol=1e-12)


def test_the_combination_is_the_closed_form():
    model = {"families": {"adaptive": {"mu": 0.4, "var_mu": 0.03, "studies": 3}},
             "tau2": 0.08, "sigma2": 0.35, "dof": 4}
    probed = {"log_ratio": -0.5, "se": 0.25, "noise_scale": 50.0, "b_star": 50 * math.exp(-0.5)}
    c = probe.combine(model, "adam", probed, level=0.8)
    v0, se2 = 0.08 + 0.03, 0.25**2
    m1 = (0.4 / v0 - 0.5 / se2) / (1 / v0 + 1 / se2)
    v1 = 1 / (1 / v0 + 1 / se2)
    t = stats.t.ppf(0.9, 4)
    sd = math.sqrt(v1 + 0.35)
    assert c["probed"]["b_crit"] == pytest.approx(50 * math.exp(m1), rel=1e-12)
    assert c["probed"]["interval"] == pytest.approx(
        (50 * math.exp(m1 - t * sd), 50 * math.exp(m1 + t * sd)), rel=1e-9)
    assert c["weight"] == pytest.approx(v1 / se2, rel=1e-12)
    # the cross-task line is the calibration's own prediction
    p = calibration.predict(model, 50.0, "adam", level=0.8)
    assert c["cross_task"]["b_crit"] == pytest.approx(p["b_crit"], rel=1e-12)
    assert c["cross_task"]["interval"] == pytest.approx(p["interval"], rel=1e-12)
    z = stats.norm.ppf(0.9)
    assert c["local_now"]["interval"] == pytest.approx(
        (probed["b_star"] * math.exp(-z * 0.25), probed["b_star"] * math.exp(z * 0.25)))
    # a bound leaves the prior; the calibration written for live advice predicts the probed line
    bound = probe.combine(model, "adam", probed | {"log_ratio": math.nan, "se": math.nan})
    assert bound["probed"]["b_crit"] == pytest.approx(p["b_crit"]) and bound["weight"] == 0
    calib = {"version": 2, "level": 0.8, "models": {"b_simple": model}}
    written = probe.calibration_with(calib, "b_simple", "adam", c)
    again = calibration.predict(written["models"]["b_simple"], 50.0, "adam", level=0.8)
    assert again["b_crit"] == pytest.approx(c["probed"]["b_crit"], rel=1e-12)
    assert again["interval"] == pytest.approx(c["probed"]["interval"], rel=1e-12)
    live = live_advice.LiveAdvice.from_config(
        ml_collections.ConfigDict({"optim": {"name": "adam"}}), written)
    assert live.ratio == pytest.approx(c["probed"]["ratio"], rel=1e-12)


def test_the_plan_keeps_the_budget():
    """The longest window within the budget, whole steps for every batch: the next longer one
    would exceed it; in examples or in steps; one line when not one step fits."""
    for e0, unit in ((100_000, "examples"), (33_333, "steps"), (7_000, "examples")):
        p = probe.plan(examples_seen=e0, steps_seen=e0 // 16, base=8, ks=(1, 2, 4, 8), seeds=2,
                       budget=0.1, unit=unit)
        assert p["window"] % (8 * 8) == 0
        spent = p[unit]
        assert spent <= p["allowed"] and p["fraction"] <= 0.1
        longer = p["window"] + 64
        more = (2 * 4 * longer if unit == "examples"
                else 2 * sum(longer // (8 * k) for k in (1, 2, 4, 8)))
        assert more > p["allowed"]
    with pytest.raises(ValueError, match="below one step of the largest probe batch"):
        probe.plan(examples_seen=1000, steps_seen=10, base=8, ks=(1, 2, 4, 8), seeds=2)
    assert probe.ladder(128) == (64, (1, 2, 4, 8, 16))
    assert probe.ladder(5) == (5, (1, 2, 4, 8))
    with pytest.raises(ValueError, match="multiple of the smallest"):
        probe.ladder(128, (32, 48))


def test_the_readme_probe_runs_a_tiny_run_end_to_end_within_its_budget(tmp_path):
    """README's run (20 steps of digits_mlp:tiny) probed by README's command: both predictions
    printed, the advice JSON holds the probe, the branches trained what the plan allowed and
    no more, and the ratio is the one its records give."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    train = re.search(r"```bash\npip install -e \. && (cbs-train "
                      r"--config=digits_mlp:tiny[^&\n]*) &&", readme).group(1)
    command = re.search(r"```bash\n(cbs-advise [^\n]*--probe[^\n]*)\n```", readme).group(1)
    work = str(tmp_path / "advise")
    env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    for part in (train, command):
        script, *args = part.replace("runs/advise", work).split()  # a console script: its module
        done = _warm.python(["-m", SCRIPTS[script].split(":")[0], *args], env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"^probe: 2 seed\(s\) × batches 32, 64, 128, window \d+ examples", out, re.M)
    assert "fixed-batch B_crit near here, cross-task prior:" in out
    assert "fixed-batch B_crit near here, with the probe:" in out
    saved = json.loads(open(os.path.join(work, "advice_20.json")).read())
    found, measured = saved["probe"], saved["measured"]
    rows = records.read_records(os.path.join(work, "probe_20", files.BRANCHES_FILE))
    assert sorted((r["batch_size"], r["seed"]) for r in rows) == [
        (b, s) for b in (32, 64, 128) for s in (1, 2)]
    examples = sum(r["steps"] * r["batch_size"] for r in rows)
    assert examples == found["cost"]["examples"] == found["plan"]["examples"]
    assert examples <= 0.5 * measured["examples_seen"]
    assert all(r["steps"] * r["batch_size"] == found["plan"]["window"] for r in rows)
    again = probe.local_ratio(rows, measured["noise/b_simple"], epsilon=0.02)
    assert again["bound"] == found["ratio"]["bound"]
    np.testing.assert_allclose(again["b_star"], found["ratio"]["b_star"], rtol=1e-12)
    assert found["combined"]["cross_task"]["b_crit"] == pytest.approx(
        saved["advice"]["b_crit"], rel=1e-9)


def test_a_probe_without_a_checkpoint_says_so_in_one_line(tmp_path):
    records.write_json_atomic(os.path.join(tmp_path, files.CONFIG_FILE), {"optim": {}})
    done = _warm.python(["-m", "experiments.advise", f"--workdir={tmp_path}", "--probe"])
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "--probe branches from a checkpoint" in last and "checkpoint_every" in last


def test_the_committed_evidence_is_what_the_command_writes():
    """results/probe/probe.json is `python -m experiments.probe_evidence`'s output today."""
    committed = json.loads(open(os.path.join(ROOT, "results/probe/probe.json")).read())
    now = json.loads(json.dumps(probe_evidence.evidence(ROOT), default=float))
    for which in ("all", "nearest"):
        a, b = now["summary"][which], committed["summary"][which]
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == (pytest.approx(b[k], rel=1e-9) if isinstance(a[k], dict) else b[k])
    for a, b in zip(now["studies"], committed["studies"], strict=True):
        assert [p["error_probed"] for p in a["pairs"]] == pytest.approx(
            [p["error_probed"] for p in b["pairs"]], rel=1e-9)


def test_a_run_logs_live_advice_with_the_probed_ratio(tmp_path):
    """`config.noise.advice_calibration` = the calibration `--probe` writes: every advice/b_crit
    the run logs is the probed ratio times its live B_simple; a missing file is named."""
    from test_train import one_device_mesh, tiny_config

    from cbs.engine import trainer

    calib = calibration.shipped()
    model = calib["models"]["b_simple"]
    probed = {"log_ratio": -1.0, "se": 0.2, "noise_scale": 30.0, "b_star": 30 * math.exp(-1)}
    c = probe.combine(model, "adam", probed)
    path = os.path.join(tmp_path, "calibration_12.json")
    records.write_json_atomic(path, probe.calibration_with(calib, "b_simple", "adam", c))
    run = os.path.join(tmp_path, "run")
    trainer.run(tiny_config(**{"noise.advice_calibration": path}), run, mesh=one_device_mesh())
    recs = [r for r in records.read_records(os.path.join(run, files.METRICS_FILE))
            if r.get("kind") == "train" and math.isfinite(r.get("advice/b_crit") or math.nan)]
    assert recs
    for r in recs:
        assert r["advice/b_crit"] == pytest.approx(c["probed"]["ratio"]
                                                   * r["noise/ema_b_simple"], rel=1e-6)
    with pytest.raises(FileNotFoundError, match="config.noise.advice_calibration"):
        trainer.run(tiny_config(**{"noise.advice_calibration": path + ".missing"}),
                    os.path.join(tmp_path, "other"), mesh=one_device_mesh())


def test_the_committed_held_out_probe_report_is_what_its_records_give():
    """results/probe_heldout/report.md is the table `experiments.probe_heldout` renders from
    the committed probe_heldout.json (each row: the default budget first; the whole run's
    examples only where the default refused)."""
    from experiments import probe_heldout
    d = os.path.join(ROOT, "results", "probe_heldout")
    with open(os.path.join(d, "probe_heldout.json"), encoding="utf-8") as f:
        rows = json.load(f)
    with open(os.path.join(d, "report.md"), encoding="utf-8") as f:
        assert f.read() == probe_heldout._markdown(rows)
    assert [r["task"] for r in rows] == [t[0] for t in probe_heldout.TASKS]
    for r in rows:
        assert r["probes"][0]["budget"] == 0.1
        assert len(r["probes"]) == 1 + ("refused" in r["probes"][0])
