"""Tests for cbs.stats.noise: closed forms, float64 references, sharding, bias, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import mlp_loss, reference_stats, tiny_mlp
from jax.sharding import AxisType, NamedSharding

from cbs.stats import noise, smoothing

FIELDS = ["mean_grad_sq_norm", "grad_sq_norm", "trace_sigma", "b_simple", "mean_g_h_g", "g_h_g",
          "trace_h_sigma", "b_noise"]
GROUPS = ["dense1", "dense1", "dense2", "dense2", "out", "out"]  # "auto" on tiny_mlp's leaves


def _assert_fields(stats, ref, rtol, fields=FIELDS, conditioned=False):
    for name in fields:
        # conditioned: a field whose float64 condition number (the same sum with absolute
        # values over |value|) exceeds 100 may lose that much more of float32's precision.
        tol = rtol * max(1.0, ref["cond"][name] / 100) if conditioned else rtol
        np.testing.assert_allclose(np.asarray(getattr(stats, name)), ref[name], rtol=tol,
                                   atol=0, err_msg=name)


# --- 1. closed form: linear regression with Gaussian inputs -------------------------------

def _regression(rng, batch_size, dim=4, sigma=0.7):
    a = rng.normal(size=(dim, dim))
    cov = a @ a.T / dim + 0.3 * np.eye(dim)
    w_star, w = rng.normal(size=dim), rng.normal(size=dim)
    x = rng.normal(size=(batch_size, dim)) @ np.linalg.cholesky(cov).T
    y = x @ w_star + sigma * rng.normal(size=batch_size)
    delta = w - w_star
    c_delta, quad = cov @ delta, delta @ cov @ delta
    truth = dict(grad_sq_norm=c_delta @ c_delta,
                 trace_sigma=(quad + sigma**2) * np.trace(cov) + c_delta @ c_delta,
                 trace_h_sigma=(quad + sigma**2) * np.trace(cov @ cov) + c_delta @ cov @ c_delta,
                 g_h_g=c_delta @ cov @ c_delta)
    return {"w": jnp.asarray(w)}, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, truth


def _sq_loss(p, b):
    return jnp.mean(0.5 * (b["x"] @ p["w"] - b["y"]) ** 2)


def test_linear_regression_closed_form(x64):
    # G = Cδ, trΣ = (δᵀCδ+σ²)trC + |Cδ|², tr(CΣ) = (δᵀCδ+σ²)trC² + δᵀC³δ, GᵀCG = δᵀC³δ.
    # trace_sigma and grad_sq_norm are exactly unbiased. The curvature fields use the batch
    # Hessian Ĥ = XᵀX/B, not C; Ĥ and the centred gradients are correlated, which biases
    # trace_h_sigma and g_h_g by O(1/B) relatively, against a standard error of O(1/√B):
    # at B = 8192 the bias is about a hundredth of a standard error.
    num_sub, sub = 16, 512
    params, batch, truth = _regression(np.random.default_rng(0), num_sub * sub)
    stats = jax.jit(lambda p, b: noise.exact(_sq_loss, p, b, curvature=True, chunk_size=512,
                                              method="vmap"))(params, batch)
    # Standard error of the full-batch estimate from 16 independent sub-batches: each
    # estimate averages over examples, so Var(full) = Var(sub) / 16 to leading order.
    sub_batches = jax.tree.map(lambda x: x.reshape(num_sub, sub, *x.shape[1:]), batch)
    subs = jax.jit(jax.vmap(lambda b: noise.exact(_sq_loss, params, b, curvature=True,
                                                  method="vmap")))(sub_batches)
    for name, value in truth.items():
        se = np.std(np.asarray(getattr(subs, name)), ddof=1) / np.sqrt(num_sub)
        assert abs(float(getattr(stats, name)) - value) < 4 * se, (name, stats, value, se)
        assert se < 0.1 * abs(value), (name, se, value)  # the check has teeth
    # The raw |ḡ|² overestimates |G|² by trΣ/B; the unbiased one does not.
    assert np.isclose(float(stats.mean_grad_sq_norm),
                      float(stats.grad_sq_norm) + float(stats.trace_sigma) / (num_sub * sub))


# --- 2. float64 reference: per-example loop + dense Hessian -------------------------------

@pytest.fixture(scope="module")
def mlp_reference():
    """Float64 reference for tiny_mlp (its values are float32 numbers in either dtype)."""
    return reference_stats(*tiny_mlp(jnp.float32), GROUPS)


def test_matches_float64_reference(x64, mlp_reference):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    ref = mlp_reference
    stats = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap")
    _assert_fields(stats, ref, 1e-10)
    assert list(stats.groups) == ["dense1", "dense2", "out"]
    for name, group in stats.groups.items():
        _assert_fields(group, ref["groups"][name], 1e-10)
    assert stats.trace_sigma.dtype == jnp.float64
    sq = noise.per_example_sq_norms(loss_fn, params, batch, method="vmap", chunk_size=5)
    np.testing.assert_allclose(np.asarray(sq), ref["sq_norms"], rtol=1e-10)


def test_matches_float64_reference_in_float32(mlp_reference):
    loss_fn, params, batch = tiny_mlp(jnp.float32)
    ref = mlp_reference
    stats = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap")
    assert stats.trace_sigma.dtype == jnp.float32
    # Every field has condition number < 100 except the first layer's block curvature: its
    # H_kk is indefinite and Σ d_kᵀH_kk d_k cancels (condition ≈ 2600 at this seed).
    _assert_fields(stats, ref, 1e-4, conditioned=True)
    assert all(c < 100 for c in ref["cond"].values())
    for name, group in stats.groups.items():
        _assert_fields(group, ref["groups"][name], 1e-4, conditioned=True)
    sq = noise.per_example_sq_norms(loss_fn, params, batch, method="vmap")
    np.testing.assert_allclose(np.asarray(sq), ref["sq_norms"], rtol=1e-5)


def test_groups_sum_to_total_and_flatten(x64):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    stats = noise.exact(loss_fn, params, batch, groups="leaf", method="vmap")
    assert len(stats.groups) == 6 and "dense1/kernel" in stats.groups
    for name in ("trace_sigma", "mean_grad_sq_norm", "grad_sq_norm"):
        total = sum(float(getattr(g, name)) for g in stats.groups.values())
        np.testing.assert_allclose(total, float(getattr(stats, name)), rtol=1e-12)
    assert stats.trace_h_sigma is None and "noise/b_noise" not in stats.to_dict()
    by_name = noise.exact(loss_fn, params, batch, groups=lambda path: path.split("/")[-1],
                          method="vmap")
    assert list(by_name.groups) == ["bias", "kernel"]
    top = noise.exact(loss_fn, params, batch, groups="top", method="vmap")
    np.testing.assert_allclose(top.groups["dense1"].trace_sigma,
                               stats.groups["dense1/bias"].trace_sigma
                               + stats.groups["dense1/kernel"].trace_sigma, rtol=1e-12)
    curv = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap")
    flat = curv.to_dict()
    assert flat["noise/b_simple"] is curv.b_simple
    assert flat["noise/dense1/trace_h_sigma"] is curv.groups["dense1"].trace_h_sigma
    assert len(flat) == 8 * 4


# --- 3. chunked == unchunked; jit; sharded on 8 devices == one device ---------------------

@pytest.mark.parametrize("chunk_size", [1, 5])
def test_chunked_equals_unchunked(x64, chunk_size):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    whole = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap")
    chunked = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap",
                          chunk_size=chunk_size)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), whole, chunked)
    sq = noise.per_example_sq_norms(loss_fn, params, batch, method="vmap")
    sq_chunked = noise.per_example_sq_norms(loss_fn, params, batch, method="vmap",
                                            chunk_size=chunk_size)
    np.testing.assert_allclose(sq, sq_chunked, rtol=1e-12)  # order of examples is kept


def test_inside_jit(x64):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    run = lambda p, b: noise.exact(loss_fn, p, b, curvature=True, groups="auto", chunk_size=5,
                                   method="vmap")
    eager, jitted = run(params, batch), jax.jit(run)(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), eager, jitted)
    assert isinstance(jitted, noise.NoiseStats) and jitted.batch_size == 12


@jax.jit
def _measure(p, b):
    stats = noise.exact(mlp_loss, p, b, curvature=True, chunk_size=8, method="vmap")
    sq = noise.per_example_sq_norms(mlp_loss, p, b, method="vmap", chunk_size=8)
    pr = noise.probe(mlp_loss, p, b, jax.random.key(3), num_probes=2, curvature=True)
    return stats, sq, pr


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sharded_equals_single_device(x64, axis_type):
    loss_fn, params, batch = tiny_mlp(jnp.float64, batch_size=16)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, jax.P("data")))
    sharded_params = jax.device_put(params, NamedSharding(mesh, jax.P()))
    assert len(sharded_batch["x"].sharding.device_set) == 8

    single = _measure(params, batch)
    sharded = _measure(sharded_params, sharded_batch)
    # Sums run in a different order across devices: float64 round-off only.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), single, sharded)


# --- 4. probe is unbiased ------------------------------------------------------------------

def _tiny_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2)


def _tiny_problem():
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4))), "v": jnp.asarray(rng.normal(size=4))}
    batch = {"x": jnp.asarray(rng.normal(size=(6, 3))), "y": jnp.asarray(rng.normal(size=6))}
    return _tiny_loss, params, batch


@pytest.mark.parametrize("distribution, num_probes", [("rademacher", 1), ("gaussian", 3)])
def test_probe_is_unbiased(x64, distribution, num_probes):
    loss_fn, params, batch = _tiny_problem()
    ref = noise.exact(loss_fn, params, batch, curvature=True, method="vmap")
    n = 20_000
    keys = jax.random.split(jax.random.key(0), n)
    probes = jax.jit(jax.vmap(lambda k: noise.probe(loss_fn, params, batch, k, curvature=True,
                                                    num_probes=num_probes,
                                                    distribution=distribution)))(keys)
    for name in ("trace_sigma", "trace_h_sigma", "grad_sq_norm", "g_h_g"):
        samples = np.asarray(getattr(probes, name))
        se = samples.std(ddof=1) / np.sqrt(n)
        target = float(getattr(ref, name))
        assert abs(samples.mean() - target) < 4 * se, (name, samples.mean(), target, se)
        assert se < 0.05 * abs(target), (name, se, target)  # the check has teeth
    # |ḡ|² and ḡᵀHḡ are exact, not estimated.
    np.testing.assert_allclose(probes.mean_grad_sq_norm, ref.mean_grad_sq_norm, rtol=1e-12)
    np.testing.assert_allclose(probes.mean_g_h_g, ref.mean_g_h_g, rtol=1e-12)


# --- 5. two_batch and NoiseScaleEMA --------------------------------------------------------

def test_two_batch_is_unbiased(x64):
    # Per-example gradients g = G + non-Gaussian noise with covariance Σ; the small batch is
    # the first b_small examples of the big one, as for one replica of a data-parallel batch.
    rng = np.random.default_rng(2)
    dim, b_small, b_big, trials = 5, 4, 32, 40_000
    grad = rng.normal(size=dim) * 0.3
    mix = rng.normal(size=(dim, dim))
    trace_sigma = np.trace(mix @ mix.T)
    noise_TxBxD = rng.exponential(size=(trials, b_big, dim)) - 1.0  # unit variance, skewed
    g_TxBxD = grad + noise_TxBxD @ mix.T
    sq_small = np.sum(g_TxBxD[:, :b_small].mean(1) ** 2, -1)
    sq_big = np.sum(g_TxBxD.mean(1) ** 2, -1)
    est_g, est_t = smoothing.two_batch(sq_small, sq_big, b_small, b_big)
    for est, target in ((np.asarray(est_g), grad @ grad), (np.asarray(est_t), trace_sigma)):
        se = est.std(ddof=1) / np.sqrt(trials)
        assert abs(est.mean() - target) < 4 * se, (est.mean(), target, se)
        assert se < 0.05 * target
    # Noise-free inputs E|ḡ_b|² = |G|² + trΣ/b are inverted exactly.
    g2, t2 = smoothing.two_batch(2.0 + 6.0 / 8, 2.0 + 6.0 / 64, 8, 64)
    np.testing.assert_allclose([g2, t2], [2.0, 6.0], rtol=1e-12)


def test_noise_scale_ema_matches_hand_computation():
    ema = smoothing.NoiseScaleEMA.init(decay=0.5)
    assert np.isnan(ema.b_simple) and np.isnan(ema.b_noise)
    update = jax.jit(lambda e, *a, **k: e.update(*a, **k))
    ema = update(ema, 1.0, 10.0)
    ema = update(ema, 3.0, 20.0, trace_h_sigma=4.0, g_h_g=2.0)
    ema = update(ema, 2.0, 40.0, trace_h_sigma=8.0, g_h_g=1.0)
    # Three updates: weights (1-d)·d², (1-d)·d, (1-d) = 1/8, 1/4, 1/2; correction 1 - d³ = 7/8.
    g = (1 / 8 * 1 + 1 / 4 * 3 + 1 / 2 * 2) / (7 / 8)
    t = (1 / 8 * 10 + 1 / 4 * 20 + 1 / 2 * 40) / (7 / 8)
    # Curvature fed twice: weights 1/4, 1/2; correction 1 - d² = 3/4.
    ghg = (1 / 4 * 2 + 1 / 2 * 1) / (3 / 4)
    ths = (1 / 4 * 4 + 1 / 2 * 8) / (3 / 4)
    np.testing.assert_allclose([ema.grad_sq_norm, ema.trace_sigma, ema.b_simple],
                               [g, t, t / g], rtol=1e-6)
    np.testing.assert_allclose([ema.g_h_g, ema.trace_h_sigma, ema.b_noise],
                               [ghg, ths, ths / ghg], rtol=1e-6)
    assert int(ema.count) == 3 and int(ema.count_curvature) == 2
    assert set(ema.to_dict()) == {"noise/ema_b_simple", "noise/ema_grad_sq_norm",
                                  "noise/ema_trace_sigma", "noise/ema_b_noise",
                                  "noise/ema_g_h_g", "noise/ema_trace_h_sigma"}
    with pytest.raises(ValueError, match="together"):
        ema.update(1.0, 1.0, g_h_g=1.0)


# --- 7. bad input --------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    loss_fn, params, batch = tiny_mlp(jnp.float32)
    one = jax.tree.map(lambda x: x[:1], batch)
    for fn in (noise.exact, lambda *a: noise.probe(*a, jax.random.key(0))):
        with pytest.raises(ValueError, match=r"B=1.*1/\(B-1\)"):
            fn(loss_fn, params, one)
    assert noise.per_example_sq_norms(loss_fn, params, one, method="vmap").shape == (1,)
    ragged = dict(batch, y=batch["y"][:5])
    with pytest.raises(ValueError, match="same leading.*'x': \\(12, 6\\).*'y': \\(5,\\)"):
        noise.exact(loss_fn, params, ragged)
    per_example = lambda p, b: loss_fn(p, b) * jnp.ones(b["x"].shape[0])
    with pytest.raises(ValueError, match=r"must return a scalar.*\(12,\)"):
        noise.exact(per_example, params, batch)
    int_params = dict(params, step=jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="floating-point.*'step'"):
        noise.exact(lambda p, b: loss_fn({k: v for k, v in p.items() if k != "step"}, b),
                    int_params, batch)
    with pytest.raises(ValueError, match="method"):
        noise.exact(loss_fn, params, batch, method="ghost")
    with pytest.raises(ValueError, match="groups"):
        noise.exact(loss_fn, params, batch, groups="layers")
    with pytest.raises(ValueError, match="b_small < b_big"):
        smoothing.two_batch(1.0, 2.0, 64, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        noise.exact(loss_fn, params, batch, chunk_size=0, method="vmap")


# --- fast path (ghost norms), when present -------------------------------------------------

def test_auto_method_matches_vmap():
    pytest.importorskip("cbs.stats.ghost")
    loss_fn, params, batch = tiny_mlp(jnp.float32)
    vmap = noise.exact(loss_fn, params, batch, groups="auto", method="vmap")
    auto = noise.exact(loss_fn, params, batch, groups="auto", method="auto")
    # Σ|g_i|² − B|ḡ|² loses about ε·(1 + B/b_simple) relatively; b_simple is ~10 here.
    for name in ("mean_grad_sq_norm", "grad_sq_norm", "trace_sigma", "b_simple"):
        np.testing.assert_allclose(getattr(auto, name), getattr(vmap, name), rtol=1e-4)
    np.testing.assert_allclose(noise.per_example_sq_norms(loss_fn, params, batch),
                               noise.per_example_sq_norms(loss_fn, params, batch, method="vmap"),
                               rtol=1e-5)


def test_stats_are_a_pytree():
    loss_fn, params, batch = tiny_mlp(jnp.float32)
    stats = noise.exact(loss_fn, params, batch, curvature=True, groups="auto", method="vmap")
    leaves, treedef = jax.tree.flatten(stats)
    assert len(leaves) == 8 * 4
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.batch_size == 12 and rebuilt.groups.keys() == stats.groups.keys()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.trace_sigma = 0.0


def test_unhashable_loss_callable_works():
    loss_fn, params, batch = tiny_mlp(jnp.float32)

    class Loss:
        __hash__ = None  # like a dataclass with eq=True holding arrays

        def __call__(self, p, b):
            return loss_fn(p, b)

    np.testing.assert_allclose(noise.exact(Loss(), params, batch, method="vmap").trace_sigma,
                               noise.exact(loss_fn, params, batch, method="vmap").trace_sigma,
                               rtol=1e-6)


def test_independent_hessian_batch_in_exact_and_probe(x64):
    """With hessian_batch, H is the Hessian of those examples: exact equals the float64
    definition (per-example deviations of `batch`, dense H of `hessian_batch`), and probe's
    mean over probes equals exact within 4 standard errors."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(14, 3)), rng.integers(0, 3, size=14)
    w = jnp.asarray(rng.normal(size=(3, 3)) * 0.4)

    def loss_fn(p, b):
        logits = b["x"] @ p
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, b["y"][:, None], -1)[:, 0])

    batch = {"x": jnp.asarray(x[:8]), "y": jnp.asarray(y[:8])}
    hess = {"x": jnp.asarray(x[8:]), "y": jnp.asarray(y[8:])}
    got = noise.exact(loss_fn, w, batch, curvature=True, hessian_batch=hess, chunk_size=3)
    g_i = np.stack([np.asarray(jax.grad(loss_fn)(w, {"x": x[i:i + 1], "y": y[i:i + 1]})).ravel()
                    for i in range(8)])
    h = np.asarray(jax.hessian(loss_fn)(w, hess)).reshape(9, 9)
    g, d = g_i.mean(0), g_i - g_i.mean(0)
    trace_h_sigma = np.einsum("ip,pq,iq->", d, h, d) / 7
    np.testing.assert_allclose(float(got.trace_h_sigma), trace_h_sigma, rtol=1e-10)
    np.testing.assert_allclose(float(got.mean_g_h_g), g @ h @ g, rtol=1e-10)
    np.testing.assert_allclose(float(got.g_h_g), g @ h @ g - trace_h_sigma / 8, rtol=1e-10)
    same = noise.exact(loss_fn, w, batch, curvature=True)
    assert abs(float(same.trace_h_sigma) / trace_h_sigma - 1) > 1e-3  # H really changed
    draws = jax.vmap(lambda k: noise.probe(loss_fn, w, batch, k, curvature=True,
                                           hessian_batch=hess).trace_h_sigma)(
        jax.random.split(jax.random.key(0), 2000))
    draws = np.asarray(draws)
    assert abs(draws.mean() - trace_h_sigma) < 4 * draws.std(ddof=1) / np.sqrt(draws.size)
