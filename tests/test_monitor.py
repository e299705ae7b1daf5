"""Tests of cbs.stats.monitor.NoiseMonitor: the EMA arithmetic, logging, and the smoothed
B_simple of a real loop against the closed form of Gaussian linear regression."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs import data, noise
from cbs.stats.noise import NoiseStats


def _stats(grad_sq_norm, trace_sigma, **curvature):
    f = lambda v: jnp.asarray(v, jnp.float32)
    return NoiseStats(batch_size=8, mean_grad_sq_norm=f(grad_sq_norm),
                      grad_sq_norm=f(grad_sq_norm), trace_sigma=f(trace_sigma),
                      b_simple=f(trace_sigma / grad_sq_norm),
                      **{k: f(v) for k, v in curvature.items()})


def test_ratio_of_bias_corrected_emas_and_logging():
    """|G|² alternates 0.2, 0.8 with tr(Σ) = 50: the monitor divides the bias-corrected EMAs
    (decay 0.5), not an EMA of the per-batch ratios (which would average 250 and 62.5)."""
    logged = []
    m = noise.NoiseMonitor(decay=0.5, every=3, log=lambda step, v: logged.append((step, v)))
    assert math.isnan(m.b_simple)
    g = [0.2, 0.8, 0.2, 0.8, 0.2, 0.8]
    for x in g:
        m.update(_stats(x, 50.0))
    avg = 0.0
    for x in g:
        avg = 0.5 * avg + 0.5 * x
    assert m.b_simple == pytest.approx(50.0 / (avg / (1 - 0.5 ** 6)), rel=1e-5)
    assert [s for s, _ in logged] == [3, 6] and m.history == logged
    assert logged[-1][1]["noise/ema_b_simple"] == pytest.approx(m.b_simple, rel=1e-6)
    assert math.isnan(logged[-1][1]["noise/ema_b_noise"])  # never fed curvature
    m.update(_stats(0.5, 50.0, g_h_g=2.0, trace_h_sigma=30.0, mean_g_h_g=2.0, b_noise=15.0))
    assert m.b_noise == pytest.approx(15.0, rel=1e-6)
    with pytest.raises(ValueError, match="every"):
        noise.NoiseMonitor(every=-1)


def test_monitor_in_a_loop_matches_the_closed_form_of_linear_regression():
    """At fixed weights w on x ~ N(0, C), y = x·w* + σε, the population tr(Σ) and |G|² are
    known (`cbs.data.linreg_noise_stats`). 400 batches of 32 i.i.d. examples through
    jit(value_grad_and_stats) and the monitor (decay 0.995: about 200 batches averaged) give
    B_simple within 10 % of it (the Monte Carlo spread of the two EMAs is about 3 %)."""
    ds = data.get_dataset("linreg", dim=8, num_train=100_000, num_eval=8, noise_std=0.5,
                          cov_decay=1.0, data_seed=0)
    split = ds.splits["train"]
    x_all, y_all = split.arrays["x"], split.arrays["y"]
    w = jnp.asarray(ds.metadata["w_star"] + 0.3, jnp.float32)
    truth = ds.metadata["noise_stats"](np.asarray(w, np.float64))["b_simple"]

    def loss_fn(params, batch):
        return 0.5 * jnp.mean((batch["x"] @ params - batch["y"]) ** 2)

    step_fn = jax.jit(noise.value_grad_and_stats(loss_fn))
    monitor = noise.NoiseMonitor(decay=0.995, every=0)
    rng = np.random.default_rng(1)
    for _ in range(400):
        idx = rng.integers(0, x_all.shape[0], size=32)
        _, _, stats = step_fn(w, {"x": x_all[idx], "y": y_all[idx]})
        monitor.update(stats)
    assert monitor.b_simple == pytest.approx(truth, rel=0.1)
    assert monitor.history == []
