"""The noise scale at a target: the full-training-set measurement (cbs.engine.measure) against
float64 definitions and by Monte Carlo, the per-batch-size spread and the reference-trajectory
protocol (cbs.analysis.fits.noise_at_target, cbs.sweeps.reference), and their place in the report.

Monte Carlo tolerance: the mean of R draws of the subset tr(HΣ) lies within 4 standard errors
(std/√R) of the all-examples value; a same-batch Hessian (biased by each example's own
Hessian) is checked to fail that test, so it can fail.
"""

from __future__ import annotations

import math
import os
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from cbs.analysis.fits import noise_at_target
from cbs.analysis.reports import report
from cbs.engine import noise_spec
from cbs.engine.noise_spec import NoiseSpec
from cbs.results import files, records, store
from cbs.stats import curvature, sampled
from cbs.sweeps import grid, reference, trials

N, DIM, CLASSES = 24, 3, 3


def _softmax_problem():
    """A linear-softmax model on N random examples (float64 under x64)."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(N, DIM))),
             "y": jnp.asarray(rng.integers(0, CLASSES, size=N))}
    w = jnp.asarray(rng.normal(size=(DIM, CLASSES)) * 0.5)

    def loss_fn(p, b):
        logits = b["x"] @ p
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, b["y"][:, None], -1)[:, 0])

    return loss_fn, w, batch


def _reference64(loss_fn, w, batch):
    """Per-example gradients [N, P], G, dense full-data Hessian [P, P] and the per-example
    forms d_iᵀHd_i, from their definitions in float64."""
    one = lambda i: {k: v[i:i + 1] for k, v in batch.items()}
    grad = jax.jit(jax.grad(loss_fn))  # one compilation for the N one-example gradients
    g_i = np.stack([np.asarray(grad(w, one(i))).ravel() for i in range(N)])
    p = g_i.shape[1]
    h = np.asarray(jax.jit(jax.hessian(loss_fn))(w, batch)).reshape(p, p)
    g = g_i.mean(0)
    d = g_i - g
    return g_i, g, h, np.einsum("ip,pq,iq->i", d, h, d)


def test_full_data_measurement_equals_its_float64_definition(x64):
    loss_fn, w, batch = _softmax_problem()
    g_i, g, h, forms = _reference64(loss_fn, w, batch)
    got = sampled.measure_full_data(loss_fn, w, batch, deviations=N, chunk_size=5)
    trace_sigma = np.sum((g_i - g) ** 2) / (N - 1)
    want = {"trace_sigma": trace_sigma, "grad_sq_norm": g @ g, "mean_grad_sq_norm": g @ g,
            "b_simple": trace_sigma / (g @ g), "trace_h_sigma": forms.sum() / (N - 1),
            "g_h_g": g @ h @ g, "mean_g_h_g": g @ h @ g}
    want["b_noise"] = want["trace_h_sigma"] / want["g_h_g"]
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, err_msg=k)
    # a subset of m examples: N/(N−1) times the mean of its forms, exactly
    key = jax.random.key(5)
    sub = sampled.measure_full_data(loss_fn, w, batch, key, deviations=6)
    idx = np.asarray(jax.random.choice(jax.random.split(key)[0], N, (6,), replace=False))
    np.testing.assert_allclose(float(sub["trace_h_sigma"]), forms[idx].mean() * N / (N - 1),
                               rtol=2e-5)
    assert float(sub["g_h_g"]) == pytest.approx(want["g_h_g"], rel=2e-5)
    with pytest.raises(ValueError, match="a key is needed"):
        sampled.measure_full_data(loss_fn, w, batch, deviations=6)


def test_a_training_set_larger_than_a_chunk_is_summed_over_chunks_to_the_same_numbers(
        x64, monkeypatch):
    """G and Hv over chunks of 7 of the N = 24 examples (three whole chunks and 3 more, each
    weighted by its share) equal one pass over all N; so does the whole measurement, its
    tr(Σ) and |G|² from the chunks' mean gradients and mean squared norms."""
    loss_fn, w, batch = _softmax_problem()
    g_one, hvp_one = curvature.hvp_fn(loss_fn, w, batch)
    g_sum, hvp_sum = sampled.population_hvp(loss_fn, w, batch, one_pass=16, chunk=7)
    v = jnp.asarray(np.random.default_rng(1).normal(size=w.shape))
    np.testing.assert_allclose(g_sum, g_one, rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(hvp_sum)(jnp.stack([v, w])),
                               jax.vmap(hvp_one)(jnp.stack([v, w])), rtol=1e-12)
    key = jax.random.key(3)
    measure = lambda h: jax.jit(lambda k: sampled.measure_full_data(
        loss_fn, w, batch, k, deviations=6, hessian_examples=h, chunk_size=3))(key)
    one_pass = measure(0)
    monkeypatch.setattr(sampled, "FULL_DATA_ONE_PASS", 16)
    monkeypatch.setattr(sampled, "FULL_DATA_CHUNK", 7)
    for h in (0, 12):  # the Hessian of all N, or of 12 examples (also over chunks of 7)
        summed = measure(h)
        if h == 0:
            for k, value in one_pass.items():
                np.testing.assert_allclose(summed[k], value, rtol=1e-6, err_msg=k)  # float32 out
        else:
            assert math.isfinite(float(summed["trace_h_sigma"]))


def test_the_full_data_curvature_needs_the_memory_of_a_chunk_not_of_all_examples(
        monkeypatch):
    """The compiled measurement's temporaries (tr(Σ), |G|², GᵀHG and tr(HΣ) of 8 deviations)
    are the same at N = 2, 16 and 64 chunks of an MLP's examples, up to a copy of the
    examples themselves; in one pass over all N they grow with N (~8x from 2 to 16 chunks:
    the reference run of results/shakespeare_kaplan_d32's LM, N = 140,257, asked for 2.7 TB;
    in chunks of 4,096 it compiles to ~5 GB)."""
    rng = np.random.default_rng(0)
    w = {"a": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
         "b": jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)}

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["a"]) @ p["b"] - b["y"]) ** 2)

    def temp_bytes(num, deviations):  # of the compiled program, from XLA's memory analysis
        batch = {"x": jax.ShapeDtypeStruct((num, 16), jnp.float32),
                 "y": jax.ShapeDtypeStruct((num, 4), jnp.float32)}
        fn = jax.jit(lambda p, b, k: sampled.measure_full_data(
            loss_fn, p, b, k, deviations=deviations, chunk_size=8))
        return fn.lower(w, batch, jax.random.key(0)).compile().memory_analysis(
        ).temp_size_in_bytes

    monkeypatch.setattr(sampled, "FULL_DATA_ONE_PASS", 256)
    monkeypatch.setattr(sampled, "FULL_DATA_CHUNK", 256)
    two = temp_bytes(2 * 256, 8)
    data_bytes = lambda num: num * (16 + 4) * 4  # a copy of the examples, if XLA makes one
    for num in (16 * 256, 64 * 256):  # (this XLA makes none: the same bytes at every N)
        assert temp_bytes(num, 8) < 1.1 * two + data_bytes(num)
    monkeypatch.setattr(sampled, "FULL_DATA_ONE_PASS", 10**9)  # one pass: the test can fail
    assert temp_bytes(16 * 256, 8) > 4 * temp_bytes(2 * 256, 8)


@pytest.mark.parametrize("hessian_examples", [0, 8])
def test_subset_trace_h_sigma_is_unbiased(x64, hessian_examples):
    """E over subsets (and independent Hessian draws) = Σ_i d_iᵀHd_i/(N − 1)."""
    loss_fn, w, batch = _softmax_problem()
    _, _, _, forms = _reference64(loss_fn, w, batch)
    truth = forms.sum() / (N - 1)
    draw = jax.jit(jax.vmap(lambda k: sampled.measure_full_data(
        loss_fn, w, batch, k, deviations=4, hessian_examples=hessian_examples)["trace_h_sigma"]))
    values = np.asarray(draw(jax.random.split(jax.random.key(1), 4000)), np.float64)
    assert values.std() > 0.05 * abs(truth)  # the draws do vary: the test can fail
    z = (values.mean() - truth) / (values.std(ddof=1) / np.sqrt(values.size))
    assert abs(z) < 4, f"{z:.2f} standard errors from the full-data value"

    def same_batch(k):  # H of the deviation examples themselves: biased
        idx = jax.random.choice(k, N, (4,), replace=False)
        sub = jax.tree.map(lambda x: x[idx], batch)
        _, hvp = curvature.hvp_fn(loss_fn, w, sub)
        full_g = jax.grad(loss_fn)(w, batch)
        one = lambda i: jax.tree.map(lambda x: x[i:i + 1], sub)
        d = [jax.grad(loss_fn)(w, one(i)) - full_g for i in range(4)]
        return sum(jnp.vdot(v, hvp(v)) for v in d) / 4 * N / (N - 1)

    old = np.asarray(jax.jit(jax.vmap(same_batch))(jax.random.split(jax.random.key(1), 4000)))
    assert (old.mean() - truth) / (old.std(ddof=1) / np.sqrt(old.size)) > 4


def test_examples_auto_is_the_full_data_up_to_its_limit():
    auto = NoiseSpec(examples="auto")
    assert NoiseSpec(examples="all").examples_for(10**6) == "all"
    assert NoiseSpec(examples="stream").examples_for(10) == "stream"
    assert auto.examples_for(noise_spec.FULL_DATA_MAX) == "all"
    assert auto.examples_for(noise_spec.FULL_DATA_MAX + 1) == "stream"
    with pytest.raises(ValueError, match="noise.examples"):
        NoiseSpec(examples="most")


# ---------------------------------------------------------------------- analysis


def _best(b, b_simple, b_noise=None):
    noise = {"b_simple": b_simple} | ({} if b_noise is None else {"b_noise": b_noise})
    return {"batch_size": b, "noise_at_target": {"0.1": noise}}


def test_spread_is_min_median_max_over_batch_sizes():
    rows = [_best(8, 10.0, 5.0), _best(16, 30.0), _best(32, 20.0, 50.0), _best(64, 90.0, 8.0)]
    s = noise_at_target.spread(rows, "0.1")
    assert (s["measured_b_simple_min"], s["measured_b_simple"], s["measured_b_simple_max"]) == (
        10.0, 25.0, 90.0)
    assert (s["measured_b_noise_min"], s["measured_b_noise"], s["measured_b_noise_max"]) == (
        5.0, 8.0, 50.0)
    assert math.isnan(s["measured_by_batch_size"]["16"]["b_noise"])
    empty = noise_at_target.spread([], "0.1")
    assert math.isnan(empty["measured_b_noise"]) and math.isnan(empty["measured_b_noise_max"])
    assert noise_at_target.spread_cell(s, "b_simple") == "25 (10–90)"


def test_protocol_names_examples_window_and_aggregation():
    s = grid.default_sweep_config()
    n = grid.default_sweep_noise(ml_collections.ConfigDict())
    n.examples, n.deviations, n.hessian_batch_size = "all", 32, 0
    definition = {"sweep": s.to_dict(), "num_train": 1438, "config": {"noise": n.to_dict()}}
    text = noise_at_target.protocol(definition)
    assert text.startswith("full training set (N=1438); tr(HΣ) from 32 random deviations and "
                           "the full-data Hessian; ratio of means over the 5 evaluations")
    n.examples = "stream"
    definition["config"]["noise"] = n.to_dict()
    assert noise_at_target.protocol(definition).startswith("sampled: 256 examples")
    # a sweep.json written before the measurement settings moved to config.noise
    old = s.to_dict() | {"noise_examples": "all", "noise_curvature_batch_size": 32,
                         "noise_hessian_batch_size": 0, "noise_batch_size": 256}
    assert noise_at_target.protocol({"sweep": old, "num_train": 1438}) == text


def _reference_run():
    """A reference record: loss 1/(1 + step/10), crossing L = 0.5 at step 10 exactly;
    tr(Σ) = step, |G|² = 1 and tr(HΣ) = 2·step, GᵀHG = 2 at every evaluation."""
    steps = [0, 4, 8, 10, 12, 14, 16, 20, 25]
    return {"batch_size": 64, "learning_rate": 0.01, "seed": 0, "protocol": "one run",
            "target_metric": "full_train/loss",
            "curve": {"step": steps, "full_train/loss": [1 / (1 + s / 10) for s in steps],
                      "noise/step": steps, "noise/trace_sigma": [float(s) for s in steps],
                      "noise/grad_sq_norm": [1.0] * len(steps),
                      "noise/trace_h_sigma": [2.0 * s for s in steps],
                      "noise/g_h_g": [2.0] * len(steps)}}


def test_reference_values_after_and_around_the_crossing():
    rows = noise_at_target.reference_values(_reference_run(), [0.5, 0.01], window=3)
    first, never = rows
    assert first["crossing_step"] == pytest.approx(10.0, rel=1e-9)
    assert first["b_simple"] == pytest.approx((10 + 12 + 14) / 3)  # first 3 at/after step 10
    assert first["b_noise"] == pytest.approx((10 + 12 + 14) / 3)  # (2·mean)/(2)
    assert first["b_simple_steps"] == [10.0, 12.0, 14.0]
    assert first["b_simple_centred"] == pytest.approx((8 + 10 + 12) / 3)  # 3 nearest
    assert never["crossing_step"] is None and math.isnan(never["b_noise"])


def test_reference_trial_is_the_best_rate_at_b_ref_for_the_lowest_target_reached():
    s = grid.default_sweep_config()
    s.batch_sizes, s.targets, s.noise_reference_batch_size = (32, 64), (0.5, 0.1), 64
    rec = lambda i, b, lr, steps: {"index": i, "batch_size": b, "learning_rate": lr, "seed": 0,
                                   "steps_to_target": steps}
    records = [rec(0, 64, 0.01, {"0.5": 50, "0.1": None}),
               rec(1, 64, 0.02, {"0.5": 40, "0.1": 300}),
               rec(2, 64, 0.04, {"0.5": 30, "0.1": 400}),
               rec(3, 32, 0.01, {"0.5": 20, "0.1": 100})]
    t = reference.reference_trial(s, records)
    assert (t.batch_size, t.learning_rate, t.index) == (64, 0.02, 1)
    records = [dict(r, steps_to_target={"0.5": None, "0.1": None}) for r in records]
    assert reference.reference_trial(s, records) is None


def test_report_shows_spread_protocol_and_reference(tmp_path):
    from tests.test_report import _records

    d = str(tmp_path)
    os.makedirs(d, exist_ok=True)
    st = store.SweepStore(d)
    records.append_records(st.path, _records([8, 16, 32, 64, 128, 256, 512]))
    run = _reference_run()
    run["target_metric"] = "full_train/loss"
    records.append_records(os.path.join(d, files.REFERENCE_NOISE_FILE), [run])
    text = open(report.write_report(d, bootstrap=0)).read()
    analysis = report.load_analysis(d)
    t = analysis["targets"][0]
    assert (t["measured_b_simple_min"], t["measured_b_simple"], t["measured_b_simple_max"]) == (
        8.0, 64.0, 512.0)
    assert "ratio of means" in analysis["noise_protocol"]
    ref = analysis["reference_noise"]["targets"][0]
    assert ref["b_simple"] == pytest.approx((10 + 12 + 14 + 16 + 20) / 5)  # window 5
    assert "| 64 (8–512) | – | 14.4 / 14.4 |" in text
    assert "Noise scale per trial:" in text and "Reference run: one run." in text


def test_the_reference_run_measures_densely_on_all_examples(tmp_path):
    """The reference run is a trial group with typed overrides (its measurement, evaluation
    count and checkpoint interval); the sweep config is read, never edited."""
    from experiments.configs import digits_sweep

    c = digits_sweep.get_config()
    c.noise.examples, c.noise.hessian_batch_size = "stream", 64
    base = c.to_dict()
    n = reference.reference_noise(c)
    assert (n.examples, n.hessian_batch_size, n.resolved_method()) == ("all", 0, "full_data")
    assert n.batch_size == c.noise.batch_size
    assert n.deviations == c.sweep.reference_noise.deviations > 0 and n.curvature
    trial = grid.Trial(0, int(c.sweep.noise_reference_batch_size), 1e-3, 0)
    run = reference.ReferenceRun(c, trial, types.SimpleNamespace(sweep_dir=str(tmp_path)))
    evals = int(c.sweep.noise_reference_evals)
    assert evals != c.sweep.evals_per_trial
    assert run.steps == trials.eval_steps(c.sweep, trial.batch_size, evals)
    assert len(run.steps) > c.sweep.evals_per_trial + 1
    assert run.noise == n and run.checkpoint_every_evals == evals
    assert c.to_dict() == base
    c.sweep.reference_noise.deviations = None  # None: the sweep's own number of deviations
    assert reference.reference_noise(c).deviations == 32
    grid.validate_sweep(c.sweep)
    c.sweep.noise_reference_batch_size = 48
    with pytest.raises(ValueError, match="noise_reference_batch_size: 48 is not one of"):
        grid.validate_sweep(c.sweep)


def test_reference_run_after_a_sweep(tmp_path, monkeypatch):
    """A tiny sweep with the reference protocol: the best trial at B_ref is rerun on the same
    trajectory (its progress equals the sweep's at common steps), measured at every evaluation
    until `noise_window` evaluations past the lowest target, and the report quotes it. Its
    progress bar counts to that stop, not to the step budget (an ETA of hours for a run of
    seconds)."""
    from cbs.runtime import writer
    from cbs.sweeps import launch
    from experiments.configs import digits_sweep

    bars = []

    def recorded(total, *, unit, **kwargs):
        bar = writer.LogLines(total, unit=unit, file=open(os.devnull, "w"), interval=1e9)
        bars.append((unit, bar))
        return bar

    monkeypatch.setattr(writer, "progress_bar", recorded)
    c = digits_sweep.get_config("tiny")
    c.train.progress_bar = True
    c.sweep.update(dict(batch_sizes=(32,), targets=(1.5,), max_steps=60, evals_per_trial=6,
                        noise_protocol="reference", noise_reference_batch_size=32,
                        noise_reference_evals=10, noise_window=2))
    c.sweep.reference_noise.deviations = 8
    d = str(tmp_path / "s")
    launch.run_sweep(c, d, log=lambda *_: None)
    run = records.read_records(os.path.join(d, files.REFERENCE_NOISE_FILE))[-1]
    (unit, bar) = bars[-1]  # the reference run's, after the sweep's own
    budget = trials.step_budget(c.sweep, 32)
    assert unit == "step" and run["curve"]["step"][-1] < budget
    assert bar.total == bar.n == run["curve"]["step"][-1]
    sweep_rec = next(r for r in store.SweepStore(d).records()
                     if r["learning_rate"] == run["learning_rate"])
    curve, mine = run["curve"], sweep_rec["curve"]
    common = set(curve["step"]) & set(mine["step"])
    assert common
    for s in common:
        assert curve["full_train/loss"][curve["step"].index(s)] == pytest.approx(
            mine["full_train/loss"][mine["step"].index(s)], rel=1e-5)
    crossing = noise_at_target.reference_values(run, [1.5], 2)[0]
    assert crossing["crossing_step"] is not None
    assert len([s for s in curve["noise/step"] if s >= crossing["crossing_step"]]) >= 2
    assert all(v is not None for v in curve["noise/trace_h_sigma"])
    assert "8 random deviations" in run["protocol"]
    report.write_report(d, bootstrap=0, partial=True)
    assert report.load_analysis(d)["reference_noise"]["batch_size"] == 32
