"""Tests of cbs.sweeps.groups (vmapped trial groups, a driver of the engine's loop) and
cbs.engine.measure (their noise measurement): unbiased B_noise by Monte Carlo, the shared
divergence rule, records, a group trial equal to the same trial on the engine, stopping and
resume.

Monte Carlo tolerance: the mean of R independent draws of the sweep's measurement must lie
within 3 standard errors (std/√R) of `noise.exact(curvature=True)` on the whole training set
(the population the draws come from), a test that fails for a biased estimator whose bias
exceeds a few standard errors (the same-batch Hessian estimator does: checked below).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from cbs import data, models
from cbs.engine import measure
from cbs.engine.noise_spec import NoiseSpec
from cbs.results import files, records, store
from cbs.runtime import mesh as mesh_lib
from cbs.stats import noise, sampled
from cbs.sweeps import grid
from cbs.sweeps.groups import TrialGroup
from cbs.sweeps.trials import run_trial_engine
from experiments.configs import digits_sweep

DRAWS = 300


def _restrict(ds: data.Dataset, n: int) -> data.Dataset:
    split = dataclasses.replace(ds.split("train"), num_examples=n)
    return dataclasses.replace(ds, splits={**ds.splits, "train": split})


def _problem(kind: str):
    """(dataset, loss_fn, params after a few full-batch SGD steps (where ḡᵀHḡ is still
    clearly positive), device arrays, full training batch)."""
    if kind == "mlp":
        ds = _restrict(data.get_dataset("digits"), 384)
        cfg = models.default_model_config("mlp")
        cfg.hidden_sizes = (16,)
        model = models.build_model(cfg, input_shape=ds.input_shape,
                                   num_classes=ds.num_classes, rngs=nnx.Rngs(0), verbose=False)
    else:
        ds = _restrict(data.get_dataset("shakespeare_char", seq_len=8), 192)
        cfg = models.default_model_config("transformer")
        cfg.update(dict(d_model=16, num_layers=1, num_heads=2, d_ff=32))
        model = models.build_model(cfg, input_shape=ds.input_shape, vocab_size=ds.vocab_size,
                                   rngs=nnx.Rngs(0), verbose=False)
    graphdef, params, rest = models.split_model(model)
    loss_fn = models.make_loss_fn(graphdef, rest, ds.task)
    arrays = ds.device_arrays("train")
    full = ds.take(arrays, jnp.arange(ds.num_train))
    opt = optax.sgd(0.2)

    @jax.jit
    def update(p, s):
        u, s = opt.update(jax.grad(loss_fn)(p, full), s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for _ in range(3 if kind == "mlp" else 10):
        params, state = update(params, state)
    return ds, loss_fn, params, arrays, full


def _spec() -> NoiseSpec:
    return NoiseSpec(examples="stream", batch_size=64, curvature=True, deviations=16,
                     hessian_batch_size=32, chunk_size=16)


def _z(draws, truth) -> float:
    v = np.asarray(draws, np.float64)
    return (v.mean() - float(truth)) / (v.std(ddof=1) / np.sqrt(v.size))


@pytest.mark.parametrize("kind", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_sweep_measurement_is_unbiased(kind):
    ds, loss_fn, params, arrays, full = _problem(kind)
    truth = noise.exact(loss_fn, params, full, curvature=True, chunk_size=64)
    assert float(truth.g_h_g) > 0 and float(truth.trace_h_sigma) > 0
    s = _spec()
    draws = jax.device_get(jax.jit(lambda p, a: jax.lax.map(
        lambda i: measure.at_evaluation(s, loss_fn, p, ds, a, i, seed=3), jnp.arange(DRAWS)))(
        params, arrays))
    for k in ("trace_sigma", "grad_sq_norm", "trace_h_sigma", "g_h_g"):
        z = _z(draws[k], getattr(truth, k))
        assert abs(z) < 3, f"{kind} {k}: {z:.2f} standard errors from the full-data value"
    if kind == "mlp":  # the estimator it replaces (Hessian of the deviation examples) fails
        def same_batch(i):
            grad_batch, _ = measure.measurement_batches(ds, arrays, i, seed=3, batch_size=64)
            m = jax.tree.map(lambda x: x[:16], grad_batch)
            return noise.exact(loss_fn, params, m, curvature=True).trace_h_sigma

        old = jax.device_get(jax.jit(lambda: jax.lax.map(same_batch, jnp.arange(DRAWS)))())
        assert _z(old, truth.trace_h_sigma) > 3


def test_measure_noise_equals_its_definition_in_float64(x64):
    """Every term against a direct float64 computation from per-example gradients and the
    dense Hessian of the Hessian batch (a tiny linear-softmax model)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))
    y = rng.integers(0, 3, size=12)
    w = rng.normal(size=(3, 3)) * 0.3

    def loss_fn(p, b):
        logits = b["x"] @ p
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, b["y"][:, None], -1)[:, 0])

    grad_b = {"x": jnp.asarray(x[:8]), "y": jnp.asarray(y[:8])}
    hess_b = {"x": jnp.asarray(x[8:]), "y": jnp.asarray(y[8:])}
    # compiled, as inside the sweep's evaluation (op by op it takes several times longer)
    got = jax.jit(functools.partial(sampled.measure_noise, loss_fn, deviations=5,
                                    chunk_size=2))(jnp.asarray(w), grad_b, hess_b)
    g_i = np.stack([np.asarray(jax.grad(loss_fn)(w, {"x": x[i:i + 1], "y": y[i:i + 1]})).ravel()
                    for i in range(8)])
    h = np.asarray(jax.jit(jax.hessian(loss_fn))(jnp.asarray(w), hess_b)).reshape(9, 9)
    d = g_i[:5] - g_i[:5].mean(0)
    trace_h_sigma = np.einsum("ip,pq,iq->", d, h, d) / 4
    g = g_i.mean(0)
    want = {"trace_h_sigma": trace_h_sigma, "mean_g_h_g": g @ h @ g,
            "g_h_g": g @ h @ g - trace_h_sigma / 8}
    want["b_noise"] = want["trace_h_sigma"] / want["g_h_g"]
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, err_msg=k)


def test_unresolved_b_noise_says_why():
    assert sampled.resolve_b_noise(2.0, 0.5) == (4.0, "")
    value, why = sampled.resolve_b_noise(2.0, -0.01)
    assert value is None and "g_h_g" in why and "<= 0" in why
    value, why = sampled.resolve_b_noise(float("nan"), 1.0)
    assert value is None and "finite" in why


# ---------------------------------------------------------------------- groups end to end


def _tiny(**sweep):
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes = (16,)
    c.sweep.lr_factors = (1.0, 2.0)
    c.sweep.update(sweep)
    return c


def test_group_records_measurements_at_every_evaluation_and_equals_the_engine(tmp_path):
    c = _tiny(targets=(0.01,), max_steps=20, evals_per_trial=4)  # never reached: full budget
    trials = grid.make_trials(c.sweep)
    st = store.SweepStore(str(tmp_path))
    out = TrialGroup(c, trials, st).run()
    assert [r.learning_rate for r in out] == [t.learning_rate for t in trials]
    for r in out:
        assert r.status == "budget" and r.final_steps == 20
        assert r.curve["step"] == r.curve["noise/step"] == [0, 1, 3, 7, 20]
        assert all(v is not None and v > 0 for v in r.curve["noise/trace_sigma"])
        assert all(v is not None for v in r.curve["noise/g_h_g"])

    # The second trial again, alone on the engine back end.
    one = mesh_lib.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    engine = run_trial_engine(c, trials[1], st, mesh=one)
    v, e = out[1].curve, engine.curve
    assert v["step"][-1] == e["step"][-1] == 20
    np.testing.assert_allclose(v["full_train/loss"][-1], e["full_train/loss"][-1], rtol=2e-5)
    assert out[0].curve["full_train/loss"][-1] != pytest.approx(v["full_train/loss"][-1])
    # One evaluation grid (the log-spaced `trials.eval_steps`) and one noise measurement
    # (cbs.engine.measure, draws from (seed, evaluation index)): the two back ends
    # evaluate at the same steps, on the same examples, and record the same values.
    assert v["step"] == e["step"] == v["noise/step"] == e["noise/step"] == [0, 1, 3, 7, 20]
    for key in ("full_train/loss", "noise/trace_sigma", "noise/grad_sq_norm",
                "noise/trace_h_sigma", "noise/g_h_g"):
        np.testing.assert_allclose(e[key], v[key], rtol=2e-5, err_msg=key)


def test_group_divergence_needs_patience(tmp_path, monkeypatch):
    """A progress curve that spikes above factor × its start for fewer than `patience`
    evaluations and recovers is not diverged; one that stays above is, and its curve ends
    where the divergence began."""
    c = _tiny(targets=(0.01,), max_steps=20, evals_per_trial=4, divergence_factor=2.0,
              divergence_patience=2, stop_when_dominated=False)
    group = TrialGroup(c, grid.make_trials(c.sweep), store.SweepStore(str(tmp_path)))
    metric = np.array([[2.0, 2.0], [5.0, 5.0], [1.0, 5.0], [0.5, 6.0], [0.4, 7.0]])
    history = {"evals": [{"full_train/loss": row, "train/loss_ema": row} for row in metric],
               "seconds": 0.0}
    for e in history["evals"]:
        e |= {f"noise/{k}": np.zeros(2) for k in ("ema_b_simple", "trace_sigma", "grad_sq_norm",
                                                  "b_simple")}
    recovered, diverged = (group._result(i, t, history) for i, t in enumerate(group.trials))
    assert recovered.status == "budget" and len(recovered.curve["step"]) == 5
    assert diverged.status == "diverged" and diverged.curve["step"] == [0]
    assert not group._finished({"evals": history["evals"][:2], "seconds": 0})
    assert not group._finished(history)  # the recovered one has not reached the target


def test_group_records_resume_and_rebuild_the_same_results(tmp_path):
    """The group writes one eval record per trial and evaluation through the loop; a second
    run of the finished group restores its last checkpoint, replays those records and
    returns the same results."""
    c = _tiny(targets=(0.01,), max_steps=20, evals_per_trial=4, checkpoint_every_evals=2,
              target_metric="train/loss_ema")
    trials = grid.make_trials(c.sweep)
    st = store.SweepStore(str(tmp_path))
    first = TrialGroup(c, trials, st)
    out = first.run()
    recs = records.read_records(os.path.join(first.workdir, files.METRICS_FILE))
    assert [(r["step"], r["trial"]) for r in recs] == [(s, t.index) for s in (0, 1, 3, 7, 20)
                                                       for t in trials]
    assert math.isnan(recs[0]["train/loss_ema"]) and recs[-1]["train/loss_ema"] > 0
    assert out[0].curve["train/loss_ema"] == [r["train/loss_ema"] for r in recs[2::2]]
    again = first.run()  # the same programs: no compilation
    for a, b in zip(out, again, strict=True):
        assert dataclasses.replace(a, seconds=0) == dataclasses.replace(b, seconds=0)


def test_group_stops_once_every_trial_reached_the_lowest_target(tmp_path):
    c = _tiny(targets=(50.0,), max_steps=20, evals_per_trial=4)  # reached at step 0
    out = TrialGroup(c, grid.make_trials(c.sweep), store.SweepStore(str(tmp_path))).run()
    for r in out:
        assert r.status == "done" and r.curve["step"] == [0] and r.steps_to_target["50"] == 0
