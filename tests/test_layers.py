"""cbs.models.layers: equal to their nnx counterparts and plain formulas, with or without taps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbs.models import layers
from cbs.stats import ghost

KEY = jax.random.key(0)


def normal(shape, seed=0):
    return jax.random.normal(jax.random.fold_in(KEY, seed), shape)


def test_linear_matches_nnx_and_formula():
    ours = layers.Linear(5, 3, rngs=nnx.Rngs(0))
    ours.bias[...] = normal((3,), 1)
    theirs = nnx.Linear(5, 3, rngs=nnx.Rngs(1))
    theirs.kernel[...], theirs.bias[...] = ours.kernel[...], ours.bias[...]
    x = normal((2, 4, 5), 2)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours(x), x @ ours.kernel[...] + ours.bias[...], rtol=1e-6)
    no_bias = layers.Linear(5, 3, use_bias=False, rngs=nnx.Rngs(0))
    assert no_bias.bias is None
    np.testing.assert_allclose(no_bias(x), x @ no_bias.kernel[...], rtol=1e-6)


@pytest.mark.parametrize("strides,padding", [(1, "SAME"), (2, "VALID"), ((2, 1), "SAME"),
                                             (2, ((1, 0), (2, 1)))])
def test_conv_matches_nnx(strides, padding):
    ours = layers.Conv(3, 4, (3, 2), strides=strides, padding=padding, rngs=nnx.Rngs(0))
    ours.bias[...] = normal((4,), 1)
    theirs = nnx.Conv(3, 4, (3, 2), strides=strides, padding=padding, rngs=nnx.Rngs(1))
    theirs.kernel[...], theirs.bias[...] = ours.kernel[...], ours.bias[...]
    x = normal((2, 7, 6, 3), 2)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_embed_matches_nnx():
    ours = layers.Embed(10, 4, rngs=nnx.Rngs(0))
    theirs = nnx.Embed(10, 4, rngs=nnx.Rngs(1))
    theirs.embedding[...] = ours.embedding[...]
    ids = jnp.array([[1, 9, 1], [0, 3, 3]])
    np.testing.assert_array_equal(ours(ids), theirs(ids))


@pytest.mark.parametrize("use_scale,use_bias", [(True, True), (False, True), (True, False)])
def test_layernorm_matches_nnx(use_scale, use_bias):
    ours = layers.LayerNorm(6, use_scale=use_scale, use_bias=use_bias)
    theirs = nnx.LayerNorm(6, use_scale=use_scale, use_bias=use_bias, rngs=nnx.Rngs(0))
    for seed, name in enumerate(("scale", "bias")):
        if getattr(ours, name) is not None:
            getattr(ours, name)[...] = normal((6,), seed)
            getattr(theirs, name)[...] = getattr(ours, name)[...]
    x = 3.0 + normal((2, 3, 6), 2)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_groupnorm_matches_nnx():
    ours = layers.GroupNorm(6, num_groups=3)
    theirs = nnx.GroupNorm(6, num_groups=3, rngs=nnx.Rngs(0))
    ours.scale[...], ours.bias[...] = normal((6,), 1), normal((6,), 2)
    theirs.scale[...], theirs.bias[...] = ours.scale[...], ours.bias[...]
    x = 1.0 + normal((2, 4, 5, 6), 3)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    by_size = layers.GroupNorm(6, num_groups=None, group_size=2)
    np.testing.assert_allclose(by_size(x), layers.GroupNorm(6, num_groups=3)(x), rtol=1e-6)
    with pytest.raises(ValueError, match="divisible"):
        layers.GroupNorm(6, num_groups=4)


class Stack(nnx.Module):
    """Every layer behind a Linear, so the tapped backward also has to pass dx on correctly."""

    def __init__(self, rngs):
        self.embed = layers.Embed(7, 6, rngs=rngs)
        self.first = layers.Linear(6, 6, rngs=rngs)
        self.ln = layers.LayerNorm(6)
        self.conv = layers.Conv(6, 6, (2, 2), strides=2, padding=((1, 0), (0, 1)), rngs=rngs)
        self.gn = layers.GroupNorm(6, num_groups=2)
        self.last = layers.Linear(6, 2, use_bias=False, rngs=rngs)

    def __call__(self, ids_BxT):
        h = self.ln(jnp.tanh(self.first(self.embed(ids_BxT))))  # [B, 16, 6]
        h = h.reshape(h.shape[0], 4, 4, 6)
        h = self.gn(jnp.tanh(self.conv(h)))  # [B, 2, 2, 6]
        return self.last(h.mean((1, 2)))


def test_taps_change_neither_forward_nor_gradient():
    """Loss and ḡ from the jaxpr ghost pass equal plain autodiff; the norms equal the vmap ones."""
    graphdef, params = nnx.split(Stack(nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(lambda p: p + 0.1 * normal(p.shape, p.size), params)

    def loss_fn(params, batch):
        out = nnx.merge(graphdef, params)(batch["ids"])
        return jnp.mean(jnp.sum(out * batch["w"], -1))

    ids = jax.random.randint(KEY, (3, 16), 0, 7)
    batch = {"ids": ids, "w": normal((3, 2), 5)}
    assert ghost.uncovered_leaves(loss_fn, params, batch) == {}
    run = lambda p, b: (ghost.per_example_grads_info(loss_fn, p, b, method="fast"),
                        ghost.per_example_grads_info(loss_fn, p, b, method="vmap")[2],
                        jax.value_and_grad(loss_fn)(p, b))
    compiled = jax.jit(run).trace(params, batch).lower().compile(
        {"xla_backend_optimization_level": 0})  # halves the compile time; values unchanged
    (loss, grad, sq), sq_vmap, (loss_p, grad_p) = compiled(params, batch)
    for a, b in zip(jax.tree.leaves(sq), jax.tree.leaves(sq_vmap), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    np.testing.assert_allclose(loss, loss_p, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_no_tap_outside_a_pass():
    graphdef, params = nnx.split(Stack(nnx.Rngs(0)), nnx.Param)
    ids = jnp.zeros((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(ids))(params)
    assert "custom_vjp" not in str(jaxpr)
