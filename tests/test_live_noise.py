"""cbs.engine.live_noise: the train step's live noise estimate.

The exact live statistics (per-example norms summed over the micro-batches and replicas of the
step) equal a float64 per-example-gradient reference on the same logical batch; a model the
ghost rules cannot read falls back to the two-batch estimator; an exact B_simple measurement
every k steps is read from the live statistics.

Tolerances: the step runs in float32. trace_sigma = (S − B|ḡ|²)/(B − 1) sums B squared norms
and subtracts B|ḡ|² (here |ḡ|² is a few % of S), so its relative error is a few float32
ulps times the sum length: rtol 2e-5. grad_sq_norm = |ḡ|² − trace_sigma/B subtracts two
terms of similar size: rtol 1e-4 (it is ~0.2 against trace_sigma/B ~ 0.2 here).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import make_train_step
from flax import nnx

from cbs import models
from cbs.engine import live_noise, optim
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import StepMetrics
from cbs.runtime import mesh as mesh_lib
from cbs.stats import noise, smoothing

RTOL_TRACE, RTOL_GRAD = 2e-5, 1e-4


def make_step(loss_fn, params, *, devices=1, micro_batch, stateful=False, lr=0.0, **kwargs):
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:devices])
    direction = optim.make_direction(ml_collections.ConfigDict({"name": "sgd"}))
    return make_train_step(loss_fn, params, direction, mesh, micro_batch=micro_batch, lr=lr,
                           stateful=stateful, **kwargs)


def reference64(loss_fn, params, batch) -> dict[str, float]:
    """Centred per-example gradients in float64 (vmap route): the exact statistics."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
        b64 = jax.tree.map(lambda x: np.asarray(x, np.float64)
                           if np.issubdtype(np.asarray(x).dtype, np.floating) else np.asarray(x),
                           batch)
        s = noise.exact(loss_fn, p64, b64, method="vmap")
        return {k: float(getattr(s, k)) for k in ("trace_sigma", "grad_sq_norm", "b_simple",
                                                  "mean_grad_sq_norm")}
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("devices, micro_batch, accum", [(1, 32, 1), (1, 8, 4), (8, 4, 1),
                                                         (8, 2, 2)])
def test_exact_live_equals_float64_reference(mlp, devices, micro_batch, accum):
    """One chunk, four accumulated micro-batches, eight replicas, and both together: the
    step's live statistics are those of the whole logical batch of 32."""
    loss_fn, params, batch = mlp
    ts, state = make_step(loss_fn, params, devices=devices, micro_batch=micro_batch)
    inputs = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    assert ts.live_kind(state, inputs, accum) == "exact"
    _, m = ts(state, inputs, accum)
    m = jax.device_get(m)
    want = reference64(loss_fn, params, batch)
    assert m["noise/live_exact"] == 1.0
    np.testing.assert_allclose(m["noise/live_trace_sigma"], want["trace_sigma"], rtol=RTOL_TRACE)
    np.testing.assert_allclose(m["noise/live_grad_sq_norm"], want["grad_sq_norm"],
                               rtol=RTOL_GRAD)
    np.testing.assert_allclose(m["noise/ema_b_simple"], want["b_simple"], rtol=RTOL_GRAD)
    np.testing.assert_allclose(m["opt/grad_norm"] ** 2, want["mean_grad_sq_norm"], rtol=1e-5)


@pytest.mark.parametrize("live", ["none", "auto"])
def test_grad_norm_off_skips_only_the_logged_norm(mlp, live):
    """grad_norm=False: with no live estimate `opt/grad_norm` is absent and the update is the
    same to the bit; a live estimate needs |ḡ|², so the norm is recorded anyway."""
    loss_fn, params, batch = mlp
    outs = []
    for grad_norm in (True, False):
        ts, state = make_step(loss_fn, params, micro_batch=16, lr=0.1, live=live,
                              grad_norm=grad_norm)
        inputs = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
        new, m = ts(state, inputs, 2)
        outs.append((jax.device_get(new.params), jax.device_get(m)))
    (p_on, m_on), (p_off, m_off) = outs
    jax.tree.map(np.testing.assert_array_equal, p_on, p_off)
    assert m_on["train/loss"] == m_off["train/loss"]
    assert "opt/grad_norm" in m_on
    assert ("opt/grad_norm" in m_off) == (live != "none")
    if live != "none":
        assert m_on["opt/grad_norm"] == m_off["opt/grad_norm"]


def test_exact_stats_closed_form():
    """Two examples g_1 = (1, 0), g_2 = (3, 0): ḡ = (2, 0), tr Σ = Σ|g_i − ḡ|²/(B − 1) = 2,
    |G|² estimate = |ḡ|² − tr Σ/B = 4 − 1 = 3, from S = Σ|g_i|² = 10."""
    grad_sq_norm, trace_sigma = live_noise.exact_stats(10.0, 4.0, 2)
    assert float(trace_sigma) == 2.0 and float(grad_sq_norm) == 3.0


def _tanh_model():
    """y = x·tanh(W) + b: W is read through `tanh`, which no ghost rule reads."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros((3,))}
    x = jax.random.normal(k2, (16, 4))
    batch = {"x": x, "y": jnp.sin(x[:, :3])}

    def loss_fn(p, b):
        return jnp.mean(jnp.sum((b["x"] @ jnp.tanh(p["w"]) + p["b"] - b["y"]) ** 2, -1))

    return loss_fn, params, batch


def test_unreadable_model_falls_back_to_two_batch(caplog):
    loss_fn, params, batch = _tanh_model()
    ts, state = make_step(loss_fn, params, micro_batch=4)
    inputs = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    with caplog.at_level(logging.INFO, logger="cbs.engine.live_noise"):
        assert ts.live_kind(state, inputs, 4) == "two_batch"
        _, m = ts(state, inputs, 4)
    lines = [r.getMessage() for r in caplog.records if "live noise estimate" in r.message]
    assert len(lines) == 1 and "two-batch" in lines[0] and "w" in lines[0], lines
    assert float(m["noise/live_exact"]) == 0.0
    # the two-batch estimate from the 4 micro-batches' gradients (b = 4, B = 16)
    grads = [jax.grad(loss_fn)(params, jax.tree.map(lambda x, k=k: x[4 * k:4 * k + 4], batch))
             for k in range(4)]
    small = np.mean([sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(gr)) for gr in grads])
    big = sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(jax.grad(loss_fn)(params, batch)))
    want_g, want_t = smoothing.two_batch(small, big, 4, 16)
    np.testing.assert_allclose(m["noise/live_trace_sigma"], want_t, rtol=1e-4)
    np.testing.assert_allclose(m["noise/live_grad_sq_norm"], want_g, rtol=1e-4)
    with pytest.raises(ValueError, match="live='exact'.*tanh"):
        bad, st = make_step(loss_fn, params, micro_batch=4, live="exact")
        bad(st, inputs, 4)


def test_batchnorm_model_falls_back_to_two_batch():
    """A loss that updates its model state (BatchNorm statistics) couples the examples."""
    mc = models.default_model_config("cnn")
    mc.norm = "batchnorm"
    model = models.build_model(mc, input_shape=(8, 8, 1), num_classes=3, rngs=nnx.Rngs(0),
                               verbose=False)
    graphdef, params, rest = models.split_model(model)

    def loss_fn(p, state, b):
        return models.make_loss_fn(graphdef, state, "classification", return_state=True)(p, b)

    reason = live_noise.ghost_unavailable(
        loss_fn, params, rest, {"x": jnp.zeros((4, 8, 8, 1)), "y": jnp.zeros((4,), jnp.int32)})
    assert reason is not None and "model state" in reason


def test_exact_measurement_is_read_from_the_live_statistics(mlp):
    """NoiseSpec(every=2) with an exact live estimate: no separate call, the
    measured statistics are the whole batch's on due steps and NaN between, and the measured
    EMA moves only on due steps."""
    loss_fn, params, batch = mlp
    ts, state = make_step(loss_fn, params, micro_batch=8, lr=0.05,
                          measure=NoiseSpec(every=2))
    inputs = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    want = reference64(loss_fn, params, batch)
    hist = []
    for _ in range(3):
        state, m = ts(state, inputs, 4)
        hist.append(m)
    assert not ts.measurement._alone._cache_size()  # no measurement of its own
    assert ts.measurement.num_compilations() == 1  # one step for due steps and the others
    np.testing.assert_allclose(hist[0]["noise/b_simple"], want["b_simple"], rtol=RTOL_GRAD)
    np.testing.assert_allclose(hist[0]["noise/trace_sigma"], hist[0]["noise/live_trace_sigma"])
    assert hist[0]["noise/batch_size"] == 32
    assert "noise/b_simple" not in hist[1] and "noise/batch_size" not in hist[1]
    assert np.isfinite(hist[2]["noise/b_simple"])
    assert int(state.measure_ema.count) == 2
    # a two-batch live estimate, or curvature, leaves the measurement to its own call
    for kwargs in ({"live": "two_batch"}, {"measure": NoiseSpec(every=2, curvature=True)}):
        ts2, state2 = make_step(loss_fn, params, micro_batch=8,
                                **({"measure": NoiseSpec(every=2)} | kwargs))
        state2, m2 = ts2(state2, inputs, 4)
        assert ts2.measurement._alone._cache_size() and "noise/b_simple" in m2


def test_in_step_curvature_takes_b_simple_from_the_live_statistics(mlp):
    """Curvature in the step: b_simple is the whole batch's (the live statistics), the
    curvature terms come from the first micro-batch (deviations from its first half, H from
    its second), as `noise.exact` gives them."""
    loss_fn, params, batch = mlp
    ts, state = make_step(loss_fn, params, micro_batch=8,
                          measure=NoiseSpec(method="vmap", every=1, curvature=True,
                                            in_step=True))
    _, m = ts(state, jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh)), 4)
    np.testing.assert_allclose(m["noise/b_simple"], reference64(loss_fn, params,
                                                                batch)["b_simple"],
                               rtol=RTOL_GRAD)
    half = lambda lo, hi: jax.tree.map(lambda x: x[lo:hi], batch)
    want = noise.exact(loss_fn, params, half(0, 4), curvature=True, method="vmap",
                       hessian_batch=half(4, 8))
    for k in ("trace_h_sigma", "g_h_g", "b_noise"):
        np.testing.assert_allclose(m[f"noise/{k}"], getattr(want, k), rtol=1e-4, err_msg=k)


def test_live_none_and_unknown_name(mlp):
    loss_fn, params, batch = mlp
    ts, state = make_step(loss_fn, params, micro_batch=32, live="none")
    _, m = ts(state, jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh)), 1)
    assert np.isnan(m["noise/live_trace_sigma"]) and float(m["noise/live_exact"]) == 0.0
    with pytest.raises(ValueError, match="live must be one of"):
        make_step(loss_fn, params, micro_batch=32, live="ghostly")


def test_jitted_step_packs_the_metrics_of_apply(mlp):
    """The jitted step returns `apply`'s metrics as one vector read by name: the same names
    with the same values (both run on the same state and batch)."""
    loss_fn, params, batch = mlp
    ts, state = make_step(loss_fn, params, micro_batch=32)
    inputs = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    _, want = jax.jit(ts.apply, static_argnums=2)(state, inputs, 1)
    _, got = ts(state, inputs, 1)
    assert isinstance(got, StepMetrics) and got.array.shape == (len(want),)
    got = jax.device_get(got)  # a pytree: fetched as one array, names kept
    assert sorted(got) == sorted(want) and len(want) > 5
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
    assert (got | {"x": 1.0})["x"] == 1.0
    with pytest.raises(ValueError, match="must be scalars"):
        StepMetrics.pack({"a": jnp.zeros(()), "b": jnp.zeros(2)})
