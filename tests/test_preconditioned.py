"""The preconditioned noise scale (`cbs.stats.preconditioned`) against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cbs.stats import preconditioned


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean(0.5 * (h @ params["w2"] - batch["y"]) ** 2)


def _problem(key, n=12):
    k = jax.random.split(key, 6)
    params = {"w1": jax.random.normal(k[0], (3, 4)), "b1": 0.1 * jax.random.normal(k[1], (4,)),
              "w2": jax.random.normal(k[2], (4,))}
    batch = {"x": jax.random.normal(k[3], (n, 3)), "y": jax.random.normal(k[4], (n,))}
    precond = jax.tree.map(lambda p: jnp.exp(jax.random.normal(k[5], p.shape)), params)
    return params, batch, precond


def _reference(params, batch, precond, hessian_batch):
    """float64: per-example gradients g_i, P, H of the Hessian batch's mean loss, dense."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    p = jax.flatten_util.ravel_pytree(precond)[0]
    one = lambda f, x: _loss(unravel(f), jax.tree.map(lambda a: a[None], x))
    g = jax.vmap(jax.grad(one), in_axes=(None, 0))(flat, batch)  # [B, P]
    h = jax.hessian(lambda f: _loss(unravel(f), hessian_batch))(flat)
    n = g.shape[0]
    gbar = g.mean(0)
    d = g - gbar
    php = p[:, None] * h * p[None, :]
    tr_p_sigma = jnp.einsum("bi,i,bi->", d, p, d) / (n - 1)
    tr_php_sigma = jnp.einsum("bi,ij,bj->", d, php, d) / (n - 1)
    gpg = gbar @ (p * gbar) - tr_p_sigma / n
    gphpg = gbar @ php @ gbar - tr_php_sigma / n
    return {"trace_sigma": tr_p_sigma, "grad_sq_norm": gpg, "b_simple": tr_p_sigma / gpg,
            "trace_h_sigma": tr_php_sigma, "g_h_g": gphpg, "b_noise": tr_php_sigma / gphpg}


def test_the_update_noise_scale_equals_a_float64_reference():
    with jax.enable_x64(True):
        params, batch, precond = _problem(jax.random.key(0))
        params, batch, precond = jax.tree.map(lambda a: a.astype(jnp.float64),
                                              (params, batch, precond))
        _, hess_batch, _ = _problem(jax.random.key(1), n=10)
        hess_batch = jax.tree.map(lambda a: a.astype(jnp.float64), hess_batch)
        got = preconditioned.exact_preconditioned(_loss, params, batch, precond,
                                                  curvature=True, hessian_batch=hess_batch)
        want = _reference(params, batch, precond, hess_batch)
    for k, v in want.items():
        assert float(getattr(got, k)) == pytest.approx(float(v), rel=1e-9), k


def test_identity_preconditioner_gives_the_plain_statistics():
    from cbs.stats import noise

    params, batch, _ = _problem(jax.random.key(2))
    ones = jax.tree.map(jnp.ones_like, params)
    got = preconditioned.exact_preconditioned(_loss, params, batch, ones, curvature=True)
    plain = noise.exact(_loss, params, batch, curvature=True)
    for k in ("trace_sigma", "grad_sq_norm", "trace_h_sigma", "g_h_g"):
        assert float(getattr(got, k)) == pytest.approx(float(getattr(plain, k)), rel=1e-5)


def test_a_rescaled_preconditioner_leaves_both_noise_scales_unchanged():
    # the learning rate multiplies P by a constant: B^P is a ratio and does not move
    params, batch, precond = _problem(jax.random.key(3))
    a = preconditioned.exact_preconditioned(_loss, params, batch, precond, curvature=True)
    b = preconditioned.exact_preconditioned(
        _loss, params, batch, jax.tree.map(lambda p: 7.0 * p, precond), curvature=True)
    assert float(b.b_simple) == pytest.approx(float(a.b_simple), rel=1e-4)
    assert float(b.b_noise) == pytest.approx(float(a.b_noise), rel=1e-4)


def test_adam_preconditioner_is_optax_adams_scaling():
    # Adam's first step from zero moments is u = P·g exactly (m̂ = g); with eps_root = 0.
    params, batch, _ = _problem(jax.random.key(4))
    tx = optax.chain(optax.clip_by_global_norm(1e3), optax.adam(1.0, b2=0.99, eps=1e-6))
    state = tx.init(params)
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    p = preconditioned.adam_preconditioner(state, eps=1e-6, b2=0.99)
    want = jax.tree.map(lambda pp, g: -pp * g, p, grads)
    for u, w in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        preconditioned.adam_preconditioner(optax.sgd(0.1).init(params))
