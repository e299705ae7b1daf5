"""Hessian-vector products, and the pytree helpers the noise statistics are built from.

Letters: P number of parameters, B batch size, C chunk of examples, L loss (the MEAN loss over
the batch, docs/design.md), H = ∇²L at `params` (the Hessian of the mean batch loss), v a pytree
shaped like `params`.

`hvp` is forward-over-reverse: Hv = d/dε ∇L(θ + εv) at ε = 0, i.e. `jax.jvp` of `jax.grad`
(Pearlmutter 1994). It costs about two gradient evaluations and never forms the P×P Hessian.
`hvp_fn` linearises ∇L once so that many HVPs at the same point (vmapped over the centred
per-example gradients in `cbs.stats.noise.exact`) reuse the forward residuals.

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cbs.stats.trees import tree_cast_like, tree_dot

__all__ = ["block_quadratic_forms", "hvp", "hvp_fn", "vhv"]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def hvp(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> PyTree:
    """Hessian-vector product H v of `loss_fn(·, batch)` at `params` (forward-over-reverse).

    Args:
        loss_fn: loss_fn(params, batch) -> scalar mean loss.
        params: point at which H is taken.
        batch: pytree of arrays with a shared leading axis.
        v: pytree shaped like `params` (cast to the parameters' dtypes).
    Returns:
        H v, a pytree shaped like `params`.
    """
    grad_fn = lambda p: jax.grad(loss_fn)(p, batch)
    return jax.jvp(grad_fn, (params,), (tree_cast_like(v, params),))[1]


def vhv(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> jax.Array:
    """The quadratic form vᵀ H v (one HVP), accumulated in float32 at least."""
    return tree_dot(v, hvp(loss_fn, params, batch, v))


def hvp_fn(loss_fn: LossFn, params: PyTree, batch: PyTree) -> tuple[PyTree, Callable]:
    """Linearises ∇L at `params`: returns (ḡ, v ↦ H v) for many HVPs at one point.

    The returned function is linear, vmappable, and casts its input to the parameter dtypes.
    """
    grad, lin = jax.linearize(lambda p: jax.grad(loss_fn)(p, batch), params)
    return grad, lambda v: lin(tree_cast_like(v, params))


def block_quadratic_forms(hvp_lin: Callable, v: PyTree, blocks: list[list[bool]] | None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """vᵀHv and, per block k, the block-diagonal form v_kᵀ H_kk v_k (one HVP per block).

    `blocks[k]` flags the leaves of block k. v_kᵀH_kk v_k is computed as ṽᵀHṽ with ṽ equal to
    v on block k and zero elsewhere. The K + 1 HVPs run one after another (lax.map), so
    memory stays that of one HVP and the HVP is compiled once. Returns (total, [K] or None).
    """
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
