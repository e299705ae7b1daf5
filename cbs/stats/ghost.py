"""Exact per-example gradient norms in one forward and one backward pass ("ghost norms"), for
any JAX model, from the operations that read each parameter in the jaxpr of `loss_fn`.

Letters: B batch, T positions (sequence or spatial, flattened), D input features, O output
features, L scan length, P parameters.

For the mean loss `L = (1/B) Σ_i ℓ_i` the per-example gradient of a dense kernel is
`∂ℓ_i/∂W = B Σ_t x_it g_itᵀ`, with `x_it` the operation's data operand at position t and
`g_it = ∂L/∂y_it` the output cotangent of the ordinary backward pass. Its squared norm needs
no [B, D, O] tensor (Goodfellow 2015; Li et al. 2022, "ghost clipping"):

    |∂ℓ_i/∂W|² = B² |x_i|² |g_i|²                            (no position axis, T = 1)
               = B² Σ_{t,s} (x_it·x_is)(g_it·g_is)          (Gram form, cost T²(D+O))
               = B² |Σ_t x_it g_itᵀ|²                         (direct form, cost T·D·O)

whichever is cheaper; the direct form's per-example gradients, summed, also give the weight
gradient ("fused"). Convolutions, embeddings and elementwise scales and shifts: `ghost_rules`.

Mechanism (docs/design.md, "Per-example gradient norms"): `ghost_trace` finds each params leaf's
*uses*; the jaxpr is evaluated again under one `jax.value_and_grad`, a use *tapped* (its rule's
[B] norms returned as the cotangent of a zero *slot* input), *fused* (also its gradient) or
*captured* (a zero *perturbation* on its output returns g, for `ghost_tied` or the *materialised*
rule). Leaves read in any other way fall back to `vmap(grad)` (`uncovered_leaves` says which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from cbs.stats import ghost_rules, ghost_tied, ghost_trace, loss_checks, nested
from cbs.stats.examples import map_and_sum, map_examples, one_example, run_auto_axes
from cbs.stats.ghost_rules import FUSED_RULES, SQ_NORM_RULES, per_example_grad
from cbs.stats.trees import leaf_paths

__all__ = [
    "MEMORY_BUDGET_BYTES", "LossFn", "PyTree", "coverage", "leaf_rules", "per_example_grads_info",
    "uncovered_leaves", "vmap_chunk_size",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

_METHODS = ("auto", "fast", "vmap")
MEMORY_BUDGET_BYTES = 256 * 2**20  # per-example work of a chunk, when chunk_size is None


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    jaxpr: Any  # ClosedJaxpr of loss_fn(params leaves, batch leaves)
    batch_size: int
    uses: dict[int, list[ghost_trace.Use]]  # covered leaf -> its uses
    active: dict[int, ghost_trace.Use]  # eqn id -> use of a covered leaf
    inside: dict[int, frozenset[int]]  # nested eqn id -> uids of active uses inside it
    uncovered: dict[int, str]  # leaf -> why it needs vmap
    unused: tuple[int, ...]  # leaves the loss does not read: zero gradient
    tapped: dict[int, Any]  # uid -> accumulation dtype: norm by its rule inside the backward
    fused: frozenset[int]  # tapped uids whose weight gradient is their per-example sum
    tied: dict[int, ghost_tied.Tied]  # leaf read by several dot/gather uses -> its rule
    ordinary: frozenset[int]  # captured uids whose leaf's gradient is the ordinary one (Gram)


def _batch_size(batch: PyTree) -> int:
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch leaves must share a leading batch axis; got sizes {sizes}")
    return cast(int, sizes.pop())  # None was refused above


def _plan(loss_fn: LossFn, params: PyTree, batch: PyTree) -> _Plan:
    """Traces the loss once (shapes only) and decides which leaves the fast path covers."""
    leaves, treedef = jax.tree.flatten(params)
    b_leaves, b_treedef = jax.tree.flatten(batch)
    flat = lambda ls, bs: loss_fn(jax.tree.unflatten(treedef, ls),
                                  jax.tree.unflatten(b_treedef, bs))
    closed = jax.make_jaxpr(flat)(leaves, b_leaves)
    batch_size = _batch_size(batch)
    disc = ghost_trace.discover(closed.jaxpr, len(leaves), batch_size)
    reads: dict[int, list] = {}
    for (_, leaf), read in disc.reads.items():
        reads.setdefault(leaf, []).append(read)
    uses, uncovered = {}, {}
    for leaf, rs in reads.items():
        why = [r for r in rs if isinstance(r, str)]
        if why:
            uncovered[leaf] = why[0]
        elif len({u.ctx for u in rs}) > 1:
            uncovered[leaf] = "read in several scans, or inside and outside one"
        else:
            uses[leaf] = sorted(rs, key=lambda u: u.uid)
    active = {id(u.eqn): u for us in uses.values() for u in us}
    uids = {u.uid for u in active.values()}
    inside = {e: frozenset(s & uids) for e, s in disc.inner_uses.items()}
    unused = tuple(i for i in range(len(leaves)) if i not in reads)
    tapped, fused, tied = {}, set(), {}
    ordinary: set[int] = set()
    for leaf, us in uses.items():
        dtype = jnp.promote_types(leaves[leaf].dtype, jnp.float32)
        if len(us) == 1 and _has_rule(us[0], dtype):
            tapped[us[0].uid] = dtype
            if _has_rule(us[0], dtype, fused=True):
                fused.add(us[0].uid)
        elif len(us) > 1 and (rule := ghost_tied.plan(us)) is not None:
            tied[leaf] = rule
            if rule.form == "gram":
                ordinary.update(u.uid for u in us)
    return _Plan(closed, batch_size, uses, active, inside, uncovered, unused, tapped,
                 frozenset(fused), tied, frozenset(ordinary))


def _has_rule(use: ghost_trace.Use, dtype, fused: bool = False) -> bool:
    """Whether a ghost rule (`fused`: one that also gives the gradient, on the operands in their
    own dtypes) reads this use's layout, on shapes only."""
    rules: dict[str, Callable[..., Any]] = FUSED_RULES if fused else SQ_NORM_RULES
    rule = rules.get(use.eqn.primitive.name)
    x_aval, g_aval = use.eqn.invars[1 - use.pos].aval, use.eqn.outvars[0].aval
    inexact = jnp.issubdtype(x_aval.dtype, jnp.inexact)
    if rule is None or not use.keeps_norm or (fused and not inexact):
        return False
    x = jax.ShapeDtypeStruct(x_aval.shape, dtype if inexact and not fused else x_aval.dtype)
    g = jax.ShapeDtypeStruct(g_aval.shape, g_aval.dtype if fused else dtype)
    extra = (dtype,) if fused else ()
    return jax.eval_shape(lambda x, g: rule(use, x, g, *extra), x, g) is not None


def uncovered_leaves(loss_fn: LossFn, params: PyTree, batch: PyTree) -> dict[str, str]:
    """Params leaf paths the fast path cannot cover, with the reason (traces, never runs)."""
    plan = _plan(loss_fn, params, batch)
    paths = leaf_paths(params)
    return {paths[leaf]: why for leaf, why in sorted(plan.uncovered.items())}


def leaf_rules(loss_fn: LossFn, params: PyTree, batch: PyTree) -> dict[str, str]:
    """Per params leaf path, how its norms are taken (traces, never runs): "fused", "tapped",
    "tied gram", "tied direct", "materialised", "vmap" (uncovered) or "unused"."""
    plan = _plan(loss_fn, params, batch)
    rules = {leaf: "vmap" for leaf in plan.uncovered} | {leaf: "unused" for leaf in plan.unused}
    for leaf, uses in plan.uses.items():
        uid = uses[0].uid
        rules[leaf] = ("fused" if uid in plan.fused else "tapped" if uid in plan.tapped else
                       f"tied {plan.tied[leaf].form}" if leaf in plan.tied else "materialised")
    paths = leaf_paths(params)
    return {paths[leaf]: rule for leaf, rule in sorted(rules.items())}


def coverage(loss_fn: LossFn, params: PyTree, batch: PyTree) -> float:
    """Fraction of the parameters (numbers, not leaves) whose norms take the fast path."""
    plan = _plan(loss_fn, params, batch)
    sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
    slow = sum(sizes[leaf] for leaf in plan.uncovered)
    return 1.0 - slow / max(sum(sizes), 1)


def _eval(jaxpr, consts, args, pert: dict[int, jax.Array], plan: _Plan):
    """Evaluates `jaxpr`, perturbing and capturing the active uses: (outputs, captures)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    caps = {}
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = plan.inside.get(id(eqn))
        if inner:
            outs, c = _eval_nested(eqn, invals, {u: pert[u] for u in inner}, plan)
            caps.update(c)
        else:
            use = plan.active.get(id(eqn))
            if use is not None and use.uid in plan.fused:
                outs = [ghost_rules.fused(use, plan.tapped[use.uid])(*invals, pert[use.uid])]
            elif use is not None and use.uid in plan.tapped:
                outs = [ghost_rules.tap(use, plan.tapped[use.uid])(
                    ghost_rules.bind(eqn, invals)[0], jax.lax.stop_gradient(invals[1 - use.pos]),
                    pert[use.uid])]
            elif use is not None:  # captured (module docstring; `_Plan.ordinary`)
                held = list(invals)
                if use.uid not in plan.ordinary:
                    held[use.pos] = jax.lax.stop_gradient(invals[use.pos])
                outs = [ghost_rules.bind(eqn, held)[0] + pert[use.uid]]
                caps[use.uid] = invals[1 - use.pos]
            else:
                outs = ghost_rules.bind(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars], caps


def _eval_nested(eqn, invals, pert, plan):
    name = eqn.primitive.name
    if name == "scan":
        scan = nested.scan_parts(eqn)
        n_c, n_carry, body = scan.n_consts, scan.n_carry, scan.body
        consts, init, xs = invals[:n_c], invals[n_c:n_c + n_carry], invals[n_c + n_carry:]

        def step(carry, xs_pert):
            x, pt = xs_pert
            outs, c = _eval(body.jaxpr, body.consts, [*consts, *carry, *x], pt, plan)
            return outs[:n_carry], (outs[n_carry:], c)

        carry, (ys, caps) = jax.lax.scan(step, init, (xs, pert), length=scan.length,
                                         reverse=scan.reverse, unroll=scan.unroll)
        return [*carry, *ys], caps
    body = nested.call_body(eqn)
    if name in ("remat2", "checkpoint"):
        fn = lambda args, pt: _eval(body.jaxpr, body.consts, args, pt, plan)
        return jax.checkpoint(fn, **nested.remat_options(eqn))(invals, pert)
    return _eval(body.jaxpr, body.consts, invals, pert, plan)


def _fast_pass(plan: _Plan, leaves: list, batch_leaves: list):
    """One forward + one backward: loss, ḡ leaves, captures, and per active use the cotangent
    of its [stack..., B] slot (tapped: its norms) or of its output."""
    pert = {u.uid: jnp.zeros(u.stack + (plan.batch_size,), plan.tapped[u.uid])
            if u.uid in plan.tapped else jnp.zeros(u.stack + u.eqn.outvars[0].aval.shape,
                                                  u.eqn.outvars[0].aval.dtype)
            for u in plan.active.values()}

    def run(leaves, pert):
        outs, caps = _eval(plan.jaxpr.jaxpr, plan.jaxpr.consts, [*leaves, *batch_leaves],
                           pert, plan)
        return outs[0], caps

    (loss, caps), (grads, cotangents) = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(
        leaves, pert)
    return loss, grads, caps, cotangents


def _materialized(uses, caps, cotangents, dtype, chunk_size) -> tuple[jax.Array, jax.Array]:
    """([B] |Σ_uses per-example gradient|², their sum over the examples), in chunks."""
    items = ghost_rules.examples_first(uses, caps, cotangents)
    per_example_bytes = sum(4 * np.dtype(dtype).itemsize * (
        int(np.prod(u.stack)) * int(np.prod(u.origin.shape)) + x.size // x.shape[0]
        + g.size // g.shape[0]) for u, (x, g) in zip(uses, items, strict=True))

    def one(items_i):
        total: Any = 0
        for u, (x_i, g_i) in zip(uses, items_i, strict=True):
            grad = lambda x, g, u=u: per_example_grad(u, x, g, dtype)
            for _ in u.stack:
                grad = jax.vmap(grad)
            total = total + grad(x_i, g_i)
        return jnp.sum(jnp.square(total)), total

    batch_size = items[0][0].shape[0]
    chunk = chunk_size if chunk_size is not None else auto_chunk_size(per_example_bytes, batch_size)
    return map_and_sum(one, items, chunk)


def auto_chunk_size(per_example_bytes: int, batch_size: int,
                    budget_bytes: int = MEMORY_BUDGET_BYTES) -> int:
    """Examples per chunk so that a chunk's per-example work fits `budget_bytes`."""
    return int(max(1, min(batch_size, budget_bytes // max(int(per_example_bytes), 1))))


def vmap_chunk_size(params: PyTree, batch: PyTree, chunk_size: int | None = None) -> int:
    """`chunk_size` when given (`map_examples` checks it), else the vmap(grad) chunk whose
    per-example gradients and activations fit the memory budget."""
    if chunk_size is not None:
        return chunk_size
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    act_bytes = sum(x.size * 4 for x in jax.tree.leaves(batch)) // batch_size
    return auto_chunk_size(3 * param_bytes + 64 * act_bytes, batch_size)


def _vmap_sq_norms(loss_fn: LossFn, params: PyTree, batch: PyTree, which: Sequence[int],
                   chunk_size: int | None) -> list[jax.Array]:
    """|∂ℓ_i/∂leaf|² by vmap(grad) w.r.t. the leaves `which` only."""
    leaves, treedef = jax.tree.flatten(params)
    sub = [leaves[i] for i in which]
    chunk = vmap_chunk_size(sub, batch, chunk_size)

    def one(example):
        def loss_of(sub):
            subs = dict(zip(which, sub, strict=True))
            full = [subs.get(i, x) for i, x in enumerate(leaves)]
            return loss_fn(jax.tree.unflatten(treedef, full), one_example(example))

        return [jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
                for g in jax.grad(loss_of)(sub)]

    return map_examples(one, batch, chunk)


def per_example_grads_info(loss_fn: LossFn, params: PyTree, batch: PyTree, *, method: str = "auto",
                           chunk_size: int | None = None) -> tuple[jax.Array, PyTree, PyTree]:
    """(mean loss, ḡ like params, sq_norms like params with [B] leaves |∂ℓ_i/∂leaf|²) of
    `loss_fn(params, batch)`, the MEAN loss over the batch's leading axis; sq_norms in float32,
    or the leaf's dtype if wider. Jittable; the batch may be sharded.

    method: "fast" reads the jaxpr (one forward + one backward) and raises ValueError naming any
    leaf it cannot cover; "auto" computes those by vmap(grad) instead; "vmap" is the reference:
    every norm by vmap(grad), loss and ḡ from one ordinary pass. chunk_size: examples per vmap
    chunk; None: from `MEMORY_BUDGET_BYTES`.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    loss_checks.check_loss_fn(loss_fn, params, batch)  # random, coupled or summed: refused
    return run_auto_axes(  # per-example slicing under explicitly sharded batch axes
        lambda p, b: _grads_info(loss_fn, p, b, method, chunk_size), params, batch)


def _grads_info(loss_fn, params, batch, method, chunk_size):
    batch_size = _batch_size(batch)
    leaves, treedef = jax.tree.flatten(params)
    dtypes = [jnp.promote_types(leaf.dtype, jnp.float32) for leaf in leaves]
    if method == "vmap":
        loss, grad = jax.value_and_grad(loss_fn)(params, batch)
        norms = dict(enumerate(_vmap_sq_norms(loss_fn, params, batch, range(len(leaves)),
                                              chunk_size)))
    else:
        plan = _plan(loss_fn, params, batch)
        if method == "fast" and plan.uncovered:
            paths = leaf_paths(params)
            lines = "; ".join(f"{paths[i]}: {why}" for i, why in sorted(plan.uncovered.items()))
            raise ValueError(f"method='fast' cannot cover these params leaves ({lines}); "
                             "use method='auto' to compute them by vmap")
        loss, grads, caps, cots = _fast_pass(plan, leaves, jax.tree.leaves(batch))
        norms = {}
        for leaf, uses in plan.uses.items():
            u = uses[0]
            if u.uid in plan.tapped:  # summed over the scan steps of a stacked leaf
                sq = jnp.sum(cots[u.uid], tuple(range(len(u.stack))))
            elif leaf in plan.tied:  # several dot/gather uses: Gram terms or direct
                sq, total = ghost_tied.sq_norms(plan.tied[leaf], caps, cots, dtypes[leaf],
                                                chunk_size, MEMORY_BUDGET_BYTES)
                if total is not None:  # direct: held constant, the per-example sum
                    grads[leaf] = total.astype(leaves[leaf].dtype)
            else:  # its uses held the leaf constant: its gradient is their per-example sum
                sq, total = _materialized(uses, caps, cots, dtypes[leaf], chunk_size)
                grads[leaf] = total.astype(leaves[leaf].dtype)
            norms[leaf] = sq * float(batch_size) ** 2  # cotangents of the MEAN loss carry 1/B
        grad = jax.tree.unflatten(treedef, grads)
        which = sorted(plan.uncovered)
        if which:
            norms.update(zip(which, _vmap_sq_norms(loss_fn, params, batch, which, chunk_size),
                             strict=True))
    out = [norms[i].astype(d) if i in norms else jnp.zeros((batch_size,), d)
           for i, d in enumerate(dtypes)]
    return loss, grad, jax.tree.unflatten(treedef, out)
