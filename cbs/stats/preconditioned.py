"""The noise scale of a preconditioned update (Adam, AdamW, any diagonal preconditioner).

Letters as in `cbs.stats.noise`, with P a positive diagonal preconditioner (a pytree shaped
like the parameters) and the update u = P·g. McCandlish et al. (2018, App. A) expand the loss
after one step θ − εu: ΔL = −εGᵀPG + ½ε²(GᵀPHPG + tr(PHPΣ)/B), so the step size that is best
at batch size B is ε_max/(1 + B_noise^P/B) with

    B_noise^P = tr(PHPΣ) / (GᵀPHPG),      B_simple^P = tr(PΣ) / (GᵀPG),

B_simple^P being B_noise^P where PH is a multiple of the identity (the preconditioner that
Adam approximates). For plain SGD (P = I) they are B_noise and B_simple.

Both come from the ordinary statistics in rescaled coordinates φ = θ/√P: the loss
φ ↦ loss(√P·φ) has per-example gradients √P·g_i and Hessian √P·H·√P, so its trace_sigma is
tr(PΣ), its grad_sq_norm GᵀPG, its trace_h_sigma tr(PHPΣ) and its g_h_g GᵀPHPG, with the
unbiased estimators of `cbs.stats.noise.exact`. P is the optimizer's state at that step,
held fixed over the measured batch.

Adam's P (`adam_preconditioner`): 1/(√v̂ + ε) with v̂ = ν/(1 − β₂^t) the bias-corrected second
moment of optax's `scale_by_adam` state (the learning rate cancels in both ratios; momentum
and decoupled weight decay are not part of P).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from cbs.stats import noise

__all__ = ["adam_preconditioner", "exact_preconditioned", "rescaled"]

PyTree = Any


def rescaled(loss_fn: Callable[[PyTree, PyTree], jax.Array], precond: PyTree
             ) -> Callable[[PyTree, PyTree], jax.Array]:
    """φ ↦ loss_fn(√P·φ, batch): the loss in the coordinates where P is the identity."""
    root = jax.tree.map(jnp.sqrt, precond)
    return lambda phi, batch: loss_fn(jax.tree.map(jnp.multiply, phi, root), batch)


def exact_preconditioned(loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
                         batch: PyTree, precond: PyTree, **kw: Any) -> noise.NoiseStats:
    """`cbs.stats.noise.exact` of the update P·g (module docstring): trace_sigma = tr(PΣ),
    grad_sq_norm = GᵀPG, and with curvature=True trace_h_sigma = tr(PHPΣ), g_h_g = GᵀPHPG.
    precond: positive, shaped like params; **kw: `exact`'s options."""
    phi = jax.tree.map(lambda p, s: p / jnp.sqrt(s), params, precond)
    return noise.exact(rescaled(loss_fn, precond), phi, batch, **kw)


def adam_preconditioner(opt_state: PyTree, *, eps: float = 1e-8, b2: float = 0.999,
                        eps_root: float = 0.0) -> PyTree:
    """Adam's diagonal preconditioner 1/(√v̂ + ε) from the first `optax.ScaleByAdamState` in
    `opt_state`; eps, b2, eps_root: the optimizer's own. Before the first update every
    coordinate is 1/ε: use a state after at least one step."""
    found = [s for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]
    if not found:
        raise ValueError("opt_state holds no optax.ScaleByAdamState: pass the state of an "
                         "optax.adam / adamw chain, or build P yourself")
    state = found[0]
    correction = 1.0 - b2 ** jnp.asarray(state.count, jnp.float32)
    return jax.tree.map(lambda nu: 1.0 / (jnp.sqrt(nu / correction + eps_root) + eps),
                        state.nu)
