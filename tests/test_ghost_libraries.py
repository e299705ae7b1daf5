"""cbs.stats.ghost on models written with other JAX libraries, which cbs never names:
equinox (a per-example model vmapped inside the loss, NCHW convolutions) and haiku (NHWC,
`hk.transform`). A convolution, a LayerNorm over channels, a strided convolution and a
linear head: every parameter on the fast path, and the per-example squared norms and the
gradient equal to the vmap reference at 1e-10 in float64. B = 4 equals the second
convolution's channels and output width: equinox's LayerNorm, vmapped over the positions,
broadcasts a constant over an axis of size B that is not the example axis (before the
trace let a constant's guessed axis yield to the data's, its leaves and the head's were
refused)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs.stats import dropin, ghost, noise

B = 4


def _xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[:, None], -1))


def _batch():
    rng = np.random.default_rng(0)
    return {"x": jnp.asarray(rng.normal(size=(B, 8, 8, 2))),
            "y": jnp.asarray(rng.integers(0, 5, B), jnp.int32)}


def _equinox():
    eqx = pytest.importorskip("equinox")
    k = jax.random.split(jax.random.key(0), 3)
    layers = (eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0]),
              eqx.nn.Conv2d(3, 4, 3, stride=2, padding=(0, 1), key=k[1]),
              eqx.nn.LayerNorm(4), eqx.nn.Linear(3 * 4 * 4, 5, key=k[2]))
    params, static = eqx.partition(layers, eqx.is_inexact_array)

    def forward(p, x_CxHxW):
        c1, c2, ln, head = eqx.combine(p, static)
        h = jnp.tanh(c2(jnp.tanh(c1(x_CxHxW))))  # [4, 3, 4]
        h = jax.vmap(jax.vmap(ln, 1, 1), 2, 2)(h)
        return head(h.reshape(-1))

    def loss_fn(p, b):
        return _xent(jax.vmap(forward, (None, 0))(p, jnp.transpose(b["x"], (0, 3, 1, 2))),
                     b["y"])

    return loss_fn, params


def _haiku():
    hk = pytest.importorskip("haiku")

    def forward(x):
        h = jnp.tanh(hk.Conv2D(3, 3)(x))
        h = hk.LayerNorm(-1, True, True)(jnp.tanh(hk.Conv2D(4, 3, stride=2)(h)))
        return hk.Linear(5)(h.reshape(h.shape[0], -1))

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 2)))
    return (lambda p, b: _xent(model.apply(p, b["x"]), b["y"])), params


@pytest.mark.parametrize("build", [_equinox, _haiku], ids=["equinox", "haiku"])
def test_foreign_library_cnn_is_exact_on_the_fast_path(build, x64):
    loss_fn, params = build()
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    batch = _batch()
    assert ghost.uncovered_leaves(loss_fn, params, batch) == {}
    info = lambda method: jax.jit(lambda p, b: ghost.per_example_grads_info(
        loss_fn, p, b, method=method))(params, batch)
    (loss, grad, sq), (ref_loss, ref_grad, ref_sq) = info("fast"), info("vmap")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    plain = jax.grad(loss_fn)(params, batch)
    for a, b, c in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), jax.tree.leaves(plain),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-13)
    for a, b in zip(jax.tree.leaves(sq), jax.tree.leaves(ref_sq), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10)
        assert float(jnp.min(a)) > 0
    # and the public entry point gives the same statistics as the vmap reference
    stats = jax.jit(dropin.value_grad_and_stats(loss_fn))(params, batch)[2]
    ref = noise.exact(loss_fn, params, batch, method="vmap")
    np.testing.assert_allclose(stats.trace_sigma, ref.trace_sigma, rtol=1e-10)
    np.testing.assert_allclose(stats.grad_sq_norm, ref.grad_sq_norm, rtol=1e-8)
