"""The train step's live noise estimate: exact from per-example gradient norms where
`cbs.stats.ghost` reads the model, the two-batch estimator otherwise.

Letters: B the logical batch, C chunks (micro-batches) the step runs one after another, n = B/C
examples per chunk, g_i = ∇ℓ_i the gradient of example i's loss, ḡ = (1/B) Σ_i g_i.

Exact ("exact"): each chunk's backward pass also returns its n per-example squared norms
|g_i|² (ghost norms, no per-example gradients). Their sum over all C chunks, S = Σ_{i≤B}
|g_i|², with the mean gradient ḡ gives the statistics of the whole logical batch, the same as
`cbs.stats.noise.exact` on it:

    trace_sigma  = (S − B|ḡ|²) / (B − 1)          unbiased for tr Σ
    grad_sq_norm = |ḡ|² − trace_sigma / B          unbiased for |G|²

(S − B|ḡ|² subtracts two nearly equal numbers when |ḡ|² dominates: relative error about
ε·(1 + B/b_simple) in float32, as in `cbs.stats.noise`.) The [B] norms of a batch sharded
over the data replicas are summed by the compiler across the replicas: S is global.

Two-batch ("two_batch", `cbs.stats.smoothing.two_batch`): from the squared norms of the chunks'
(or replicas') mean gradients and |ḡ|², where ghost norms are not available
(`ghost_unavailable`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cbs.stats import ghost, loss_checks, trees

__all__ = [
    "EXACT_MEASURE_METHODS", "LIVE_METHODS", "exact_stats", "ghost_unavailable",
    "log_choice", "resolve", "small_batch_ok", "value_grad_sq_sum",
]

PyTree = Any
LIVE_METHODS = ("auto", "exact", "two_batch", "none")


def small_batch_ok(b: int, replicas: int, micro_batch: int) -> bool:
    """The small batches b the two-batch estimate can form from R replicas of m examples
    (`TrainStep._plan`): R·m, m with R ≥ 2, or a multiple of R whose share b/R divides m."""
    r, m = replicas, micro_batch
    return b == r * m or (b == m and r >= 2) or (b % r == 0 and m % (b // r) == 0)
EXACT_MEASURE_METHODS = ("auto", "fast", "vmap")  # measurements the exact live path serves

_log = logging.getLogger(__name__)


def ghost_unavailable(loss_fn: Callable, params: PyTree, model_state: PyTree,
                      batch: PyTree) -> str | None:
    """Why the exact live estimate cannot run on this loss and batch, or None when it can
    (traces only: shapes and dtypes, no numbers of `params` or `batch`)."""
    leaves, treedef = jax.tree.flatten(model_state)

    def new_state(state_leaves):  # the state's outputs of its jaxpr are its inputs: unchanged
        return jax.tree.leaves(loss_fn(params, jax.tree.unflatten(treedef, state_leaves), batch)[1])

    jaxpr = jax.make_jaxpr(new_state)(leaves).jaxpr if leaves else None
    if jaxpr is not None and list(jaxpr.outvars) != list(jaxpr.invars):
        return "the loss updates its model state (e.g. BatchNorm statistics)"
    plain = lambda p, b: loss_fn(p, model_state, b)[0]
    try:
        loss_checks.check_loss_fn(plain, params, batch)
    except ValueError as err:
        return str(err)
    uncovered = ghost.uncovered_leaves(plain, params, batch)
    if uncovered:
        path, why = next(iter(uncovered.items()))
        return f"the ghost rules cannot read {len(uncovered)} params leaves ({path}: {why})"
    return None


def resolve(live: str, reason: str | None) -> str:
    """The estimator `live` ("auto" | "exact" | "two_batch" | "none") runs given `reason`
    (from `ghost_unavailable`): "exact", "two_batch" or "none"."""
    if live not in LIVE_METHODS:
        raise ValueError(f"live must be one of {LIVE_METHODS}, got {live!r}")
    if live == "exact" and reason is not None:
        raise ValueError(f"live='exact': {reason}; use live='auto' or 'two_batch'")
    if live == "auto":
        return "exact" if reason is None else "two_batch"
    return live


def log_choice(kind: str, reason: str | None) -> None:
    """One line saying which live estimator a step uses (and why not the exact one)."""
    if kind == "exact":
        _log.info("live noise estimate: exact, from per-example gradient norms (ghost norms)")
    elif kind == "two_batch":
        _log.warning("live noise estimate: two-batch%s", f" ({reason})" if reason else "")


def value_grad_sq_sum(loss_fn: Callable, params: PyTree, model_state: PyTree, batch: PyTree
                      ) -> tuple[jax.Array, PyTree, jax.Array]:
    """(mean loss, mean gradient in float32 or wider, Σ_i |g_i|² over the n examples) of one
    chunk, from one forward and one backward pass (`cbs.stats.ghost`)."""
    plain = lambda p, b: loss_fn(p, model_state, b)[0]
    loss, grads, sq_norms = ghost.per_example_grads_info(plain, params, batch, method="fast")
    dtype = trees.accum_dtype()
    # The leaves' [B] norms added first, then one reduction (on CPU each reduction is a
    # kernel of its own).
    sq_sum = jnp.sum(sum((x.astype(dtype) for x in jax.tree.leaves(sq_norms)),
                         jnp.zeros((), dtype)))
    grads = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
    return loss, grads, jnp.asarray(sq_sum, dtype)


def exact_stats(sq_sum: jax.Array, mean_grad_sq_norm: jax.Array, batch_size: int
                ) -> tuple[jax.Array, jax.Array]:
    """Unbiased (grad_sq_norm, trace_sigma) of a batch of B = `batch_size` ≥ 2 examples from
    S = Σ_i |g_i|² and |ḡ|² (module docstring)."""
    dtype = trees.accum_dtype()
    s, gsq = jnp.asarray(sq_sum, dtype), jnp.asarray(mean_grad_sq_norm, dtype)
    trace_sigma = (s - batch_size * gsq) / (batch_size - 1)
    return gsq - trace_sigma / batch_size, trace_sigma
