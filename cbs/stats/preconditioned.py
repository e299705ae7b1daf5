"""The noise scale of a preconditioned update (Adam, AdamW, any diagonal preconditioner).

Letters as in `cbs.stats.noise`, with P a positive diagonal preconditioner (a pytree shaped like
the parameters) and the update u = P·g. McCandlish et al. (2018, App. A) expand the loss after one
step θ − εu: ΔL = −εGᵀPG + ½ε²(GᵀPHPG + tr(PHPΣ)/B), so the best step size at batch size B is
ε_max/(1 + B_noise^P/B) with

    B_noise^P = tr(PHPΣ) / (GᵀPHPG),      B_simple^P = tr(PΣ) / (GᵀPG),

B_simple^P being B_noise^P where PH is a multiple of the identity (the preconditioner that Adam
approximates); for plain SGD (P = I) they are B_noise and B_simple. Both are the ordinary
statistics in the coordinates φ = θ/√P: the loss φ ↦ loss(√P·φ) has per-example gradients √P·g_i
and Hessian √P·H·√P. P, the optimizer's state at that step, is held fixed over the batch.

Adam's P (`adam_preconditioner`): 1/(√v̂ + ε) with v̂ = ν/(1 − β₂^t) the bias-corrected second
moment of optax's `scale_by_adam` state (the learning rate cancels in both ratios; momentum and
decoupled weight decay are not part of P).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from cbs.stats import noise
from cbs.stats.examples import LossFn, PyTree

__all__ = ["adam_preconditioner", "exact_preconditioned", "rescaled"]


def rescaled(loss_fn: LossFn, precond: PyTree) -> LossFn:
    """φ ↦ loss_fn(√P·φ, batch): the loss in the coordinates where P is the identity."""
    root = jax.tree.map(jnp.sqrt, precond)
    return lambda phi, batch: loss_fn(jax.tree.map(jnp.multiply, phi, root), batch)


def exact_preconditioned(loss_fn: LossFn, params: PyTree, batch: PyTree, precond: PyTree,
                         **kw: Any) -> noise.NoiseStats:
    """`cbs.stats.noise.exact` of the update P·g (`precond`): trace_sigma = tr(PΣ),
    grad_sq_norm = GᵀPG, and with curvature=True trace_h_sigma = tr(PHPΣ), g_h_g = GᵀPHPG."""
    phi = jax.tree.map(lambda p, s: p / jnp.sqrt(s), params, precond)
    return noise.exact(rescaled(loss_fn, precond), phi, batch, **kw)


def adam_preconditioner(opt_state: PyTree, *, eps: float = 1e-8, b2: float = 0.999,
                        eps_root: float = 0.0) -> PyTree:
    """Adam's diagonal preconditioner from the first `optax.ScaleByAdamState` in `opt_state`;
    eps, b2, eps_root: the optimizer's own. Before the first update every coordinate is 1/ε."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    if not found:
        raise ValueError("opt_state holds no optax.ScaleByAdamState: pass the state of an "
                         "optax.adam / adamw chain, or build P yourself")
    correction = 1.0 - b2 ** jnp.asarray(found[0].count, jnp.float32)
    return jax.tree.map(lambda nu: 1.0 / (jnp.sqrt(nu / correction + eps_root) + eps), found[0].nu)
