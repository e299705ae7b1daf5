"""Hessian-vector products of the mean batch loss.

Letters: P number of parameters, L the MEAN loss over the batch (docs/design.md), H = ∇²L at
`params`, v a pytree shaped like `params`.

`hvp` is forward-over-reverse: Hv = d/dε ∇L(θ + εv) at ε = 0, `jax.jvp` of `jax.grad`
(Pearlmutter 1994): about two gradient evaluations, never the P×P Hessian.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from cbs.stats.examples import LossFn, PyTree
from cbs.stats.trees import tree_cast_like, tree_dot

__all__ = ["block_quadratic_forms", "hvp", "hvp_fn", "vhv"]


def hvp(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> PyTree:
    """H v of the mean loss `loss_fn(·, batch)` at `params` (v cast to the params' dtypes)."""
    grad_fn = lambda p: jax.grad(loss_fn)(p, batch)
    return jax.jvp(grad_fn, (params,), (tree_cast_like(v, params),))[1]


def vhv(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> jax.Array:
    """The quadratic form vᵀ H v (one HVP), accumulated in float32 at least."""
    return tree_dot(v, hvp(loss_fn, params, batch, v))


def hvp_fn(loss_fn: LossFn, params: PyTree, batch: PyTree) -> tuple[PyTree, Callable]:
    """(ḡ, v ↦ H v) from one linearisation of ∇L at `params` (many HVPs at one point reuse its
    forward residuals); the function is linear, vmappable, and casts v to the params' dtypes."""
    grad, lin = jax.linearize(lambda p: jax.grad(loss_fn)(p, batch), params)
    return grad, lambda v: lin(tree_cast_like(v, params))


def block_quadratic_forms(hvp_lin: Callable, v: PyTree, blocks: list[list[bool]] | None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """(vᵀHv, [K] v_kᵀ H_kk v_k or None): v_kᵀH_kk v_k = ṽᵀHṽ with ṽ = v on the leaves
    `blocks[k]` flags, zero elsewhere; the K + 1 HVPs one after another (memory of one HVP)."""
    if blocks is None:
        return tree_dot(v, hvp_lin(v)), None
    masks_KxL = jnp.asarray([[True] * len(blocks[0])] + blocks)
    leaves, treedef = jax.tree.flatten(v)

    def form(mask_L):
        vk = jax.tree.unflatten(treedef, [jnp.where(m, x, jnp.zeros_like(x))
                                for m, x in zip(mask_L, leaves, strict=True)])
        return tree_dot(vk, hvp_lin(vk))

    forms = jax.lax.map(form, masks_KxL)
    return forms[0], forms[1:]
