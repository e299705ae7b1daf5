"""The anchor study (`experiments/configs/linreg_sweep.py`): on Gaussian linear regression
the sweep's full-data noise measurement equals a float64 reference on the same examples, and
the population closed form (`cbs.data.linreg_noise_stats`) within its Monte-Carlo error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cbs.data as data
from cbs.stats import sampled
from experiments.configs import linreg_sweep


def _loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean(0.5 * (pred - batch["y"]) ** 2)


def _sample_reference(x, y, w, b):
    """float64 statistics over the N examples themselves (the measurement's population)."""
    xt = np.c_[x, np.ones(len(y))]  # the bias is a weight on a constant feature
    g = xt * (xt @ np.r_[w, b] - y)[:, None]  # per-example gradients [N, D + 1]
    grad, n = g.mean(0), len(y)
    d = g - grad
    hess = xt.T @ xt / n
    trace_sigma = np.sum(d * d) / (n - 1)
    trace_h_sigma = np.einsum("bi,ij,bj->", d, hess, d) / (n - 1)
    return {"trace_sigma": trace_sigma, "grad_sq_norm": grad @ grad,
            "trace_h_sigma": trace_h_sigma, "g_h_g": grad @ hess @ grad}


def _data(num_train):
    ds = data.get_dataset("linreg", dim=6, num_train=num_train, num_eval=8, noise_std=0.5,
                          cov_decay=2.0, rotate=True, data_seed=3)
    x, y = np.asarray(ds.train["x"], np.float32), np.asarray(ds.train["y"], np.float32)
    w = ds.metadata["w_star"] + 0.3 * np.array([1.0, -2.0, 0.5, 1.0, -1.0, 3.0])
    params = {"w": jnp.asarray(w, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return ds.metadata, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, params


def test_full_data_measurement_matches_a_float64_reference():
    # Every deviation and the whole-set Hessian: the measurement is exact on these N.
    _, batch, params = _data(4000)
    got = sampled.measure_full_data(_loss, params, batch, jax.random.key(0),
                                    deviations=4000, chunk_size=1000)
    ref = _sample_reference(np.asarray(batch["x"], np.float64),
                            np.asarray(batch["y"], np.float64),
                            np.asarray(params["w"], np.float64), 0.0)
    for k, v in ref.items():  # float32 sums over 4,000 examples: 1e-4 relative
        assert float(got[k]) == pytest.approx(v, rel=1e-4), k
    assert float(got["b_noise"]) == pytest.approx(ref["trace_h_sigma"] / ref["g_h_g"], rel=2e-4)


def test_full_data_measurement_matches_the_closed_form():
    # Population closed form with the bias as a weight on a constant feature: covariance
    # diag(C, 1), teacher (w*, 0). The sample statistics of N examples scatter around it by
    # O(N^-½): at N = 100,000 by about 0.5 % here, so 3 % (tr(HΣ), a mean of quartic forms,
    # is checked exactly above and against Monte Carlo in test_data_synthetic).
    meta, batch, params = _data(100_000)
    got = sampled.measure_full_data(_loss, params, batch, jax.random.key(0), deviations=1,
                                    chunk_size=10_000)
    cov = np.zeros((7, 7))
    cov[:6, :6], cov[6, 6] = meta["cov"], 1.0
    truth = data.linreg_noise_stats(np.r_[np.asarray(params["w"], np.float64), 0.0], cov=cov,
                                    w_star=np.r_[meta["w_star"], 0.0],
                                    noise_std=meta["noise_std"])
    for k in ("trace_sigma", "grad_sq_norm", "g_h_g", "b_simple"):
        assert float(got[k]) == pytest.approx(truth[k], rel=0.03), k
    # B_noise differs from B_simple on this anisotropic C by far more than the tolerance.
    assert abs(truth["b_noise"] / truth["b_simple"] - 1) > 0.1


def test_anchor_config_targets_sit_above_the_training_minimum():
    # The targets are full training-set losses; each must be reachable (above the least-
    # squares minimum of the training set, with the bias) and below the initial loss.
    c = linreg_sweep.get_config()
    ds = data.get_dataset("linreg", **c.data.options)
    x = np.c_[np.asarray(ds.train["x"], np.float64), np.ones(ds.train["y"].shape[0])]
    y = np.asarray(ds.train["y"], np.float64)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    minimum = 0.5 * np.mean((x @ coef - y) ** 2)
    assert minimum == pytest.approx(0.1254, abs=5e-5)  # the value the config's comment states
    assert min(c.sweep.targets) > minimum + 2e-4
    assert max(c.sweep.targets) < 0.5 * np.mean(y**2)  # the loss at w = 0
