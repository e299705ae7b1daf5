"""Tests for cbs.curvature: HVPs against a dense float64 Hessian, tree helpers, groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

from cbs.models.layers import Linear
from cbs.stats import curvature, examples, trees


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"] + p["c"]) @ p["v"] - b["y"]) ** 2)


def _problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4))), "c": jnp.asarray(rng.normal(size=4)),
              "v": jnp.asarray(rng.normal(size=4))}
    batch = {"x": jnp.asarray(rng.normal(size=(7, 3))), "y": jnp.asarray(rng.normal(size=7))}
    vec = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    return params, batch, vec


def _dense_hessian(params, batch):
    flat, unravel = ravel_pytree(params)
    return np.asarray(jax.jit(jax.hessian(lambda f: _loss(unravel(f), batch)))(flat))


def test_hvp_matches_dense_hessian(x64):
    params, batch, vec = _problem()
    hess = _dense_hessian(params, batch)
    v_flat = np.asarray(ravel_pytree(vec)[0])
    hv = curvature.hvp(_loss, params, batch, vec)
    np.testing.assert_allclose(ravel_pytree(hv)[0], hess @ v_flat, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(curvature.vhv(_loss, params, batch, vec), v_flat @ hess @ v_flat,
                               rtol=1e-12)
    grad, hvp_lin = curvature.hvp_fn(_loss, params, batch)
    np.testing.assert_allclose(ravel_pytree(grad)[0],
                               ravel_pytree(jax.grad(_loss)(params, batch))[0], rtol=1e-14)
    stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), vec)
    hv2 = jax.vmap(hvp_lin)(stacked)  # linear and vmappable
    np.testing.assert_allclose(ravel_pytree(jax.tree.map(lambda x: x[1], hv2))[0],
                               2 * hess @ v_flat, rtol=1e-12, atol=1e-14)


def test_block_quadratic_forms_use_diagonal_blocks(x64):
    params, batch, vec = _problem()
    hess = _dense_hessian(params, batch)
    v_flat = np.asarray(ravel_pytree(vec)[0])
    _, hvp_lin = curvature.hvp_fn(_loss, params, batch)
    # Leaf order is c, v, w (sorted dict keys); blocks {c, w} and {v}.
    blocks = [[True, False, True], [False, True, False]]
    total, per_block = curvature.block_quadratic_forms(hvp_lin, vec, blocks)
    np.testing.assert_allclose(total, v_flat @ hess @ v_flat, rtol=1e-12)
    sizes = [x.size for x in jax.tree.leaves(params)]
    leaf_of = np.repeat(np.arange(3), sizes)
    for k, keep in enumerate(blocks):
        idx = np.flatnonzero(np.asarray(keep)[leaf_of])
        expected = v_flat[idx] @ hess[np.ix_(idx, idx)] @ v_flat[idx]
        np.testing.assert_allclose(per_block[k], expected, rtol=1e-12)
    assert curvature.block_quadratic_forms(hvp_lin, vec, None)[1] is None


def test_tree_dot_accumulates_in_float32():
    a = {"x": jnp.full((4096,), 1.0 + 2.0**-7, jnp.bfloat16), "y": jnp.ones((3,), jnp.bfloat16)}
    dot = trees.tree_dot(a, a)
    assert dot.dtype == jnp.float32 and trees.tree_sq_norm(a).dtype == jnp.float32
    np.testing.assert_allclose(dot, 4096 * (1 + 2.0**-7) ** 2 + 3, rtol=1e-6)


def test_tree_dot_uses_float64_under_x64(x64):
    a = {"x": jnp.ones((3,), jnp.float32)}
    assert trees.tree_dot(a, a).dtype == jnp.float64 and trees.accum_dtype() == jnp.float64


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Linear(3, 4, rngs=rngs), Linear(4, 2, rngs=rngs)])
        self.head = Linear(2, 1, use_bias=False, rngs=rngs)


def test_groups_on_nnx_params():
    _, params, _ = nnx.split(_Net(nnx.Rngs(0)), nnx.Param, ...)
    assert trees.leaf_paths(params) == ["head/kernel", "layers/0/bias", "layers/0/kernel",
                                     "layers/1/bias", "layers/1/kernel"]
    assert trees.resolve_groups(params, "auto") == ["head", "layers/0", "layers/0", "layers/1",
                                                 "layers/1"]
    assert trees.resolve_groups(params, True) == trees.resolve_groups(params, "auto")
    assert trees.resolve_groups(params, "top") == ["head"] + ["layers"] * 4
    assert trees.resolve_groups(params, "leaf") == trees.leaf_paths(params)
    assert trees.resolve_groups(params, lambda p: p.endswith("bias")) == [
        "False", "True", "False", "True", "False"]
    assert trees.resolve_groups(params, None) is None
    assert trees.resolve_groups(params, False) is None
    names, matrix, blocks = trees.group_matrix({"a": jnp.ones(2), "b": jnp.ones(3)}, "auto")
    assert names == ["a", "b"] and matrix.tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError, match="groups must be"):
        trees.resolve_groups(params, "layer")


def test_check_inputs_returns_batch_size_and_run_auto_axes_without_mesh():
    params, batch, _ = _problem()
    assert examples.check_inputs(_loss, params, batch) == 7
    assert examples.run_auto_axes(lambda a, b: a + b, 1.0, 2.0) == 3.0
