"""Exact per-example gradient norms in one forward and one backward pass ("ghost norms").

For a loss `L = (1/B) Σ_i ℓ_i` (the mean loss of the DESIGN contract) the per-example gradient
of a dense layer's kernel is `∂ℓ_i/∂W = B Σ_t x_it g_itᵀ`, where `x_it` is the layer input at
position t and `g_it = ∂L/∂y_it` the output cotangent the ordinary backward pass already has.
Its squared norm needs no [B, D, O] tensor (Goodfellow 2015; Li et al. 2022, "ghost clipping"):

    |∂ℓ_i/∂W|² = B² |x_i|² |g_i|²                            (no position axis, T = 1)
               = B² Σ_{t,s} (x_it·x_is)(g_it·g_is)          (Gram form, cost T²(D+O))
               = B² |Σ_t x_it g_itᵀ|²                         (direct form, cost T·D·O)
    |∂ℓ_i/∂b|² = B² |Σ_t g_it|²

whichever of the two T > 1 forms is cheaper. A convolution is the dense rule on the input
patches (strided slices; the native convolution keeps the forward pass and the ordinary
gradients, and the norm does not depend on the order of the patch features). An embedding row
gathers `Σ_{t: id_t = v} g_t`, so `|∂ℓ_i/∂E|² = B² Σ_{t,s} [id_t = id_s] g_t·g_s` (or one-hot
when the vocabulary V is smaller than T). Norm scales and shifts act per channel: their
[B, O] per-example gradients are small and are formed directly.

Mechanism: a trace-time tap. Each `cbs.models.layers` layer routes its parameters through `tap`,
which outside a tap context just calls the layer's plain function. Inside one it calls a
`jax.custom_vjp` primitive with one extra input, a zero array `tap` [B, n] whose cotangent
the backward rule sets to the n per-example squared norms of that call's parameters; so
`jax.grad` w.r.t. (params, taps) returns ḡ and all norms from ONE backward pass, and under
`jit` the only extra work is the per-layer reductions above. Two shape-only traces (never
run) come first: one lists the layer calls and which params leaf (by identity of the traced
leaf) each uses, the next taps every call with the taps as jaxpr inputs. A leaf is covered
when exactly one call uses it, the call's input has the batch as leading axis, and in that
jaxpr the call's own top-level custom_vjp equation is the only consumer of the leaf and of
the tap. Other leaves (raw `nnx.Param`s, foreign layers, tied weights, leaves transformed
before use, layers inside `scan`, `cond`, `remat` or a nested `jit`) fall back to `vmap(grad)`
restricted to them. Why this design: it needs nothing from the model beyond the layers and
nothing from `loss_fn` (any pytree of params, NNX or not), the norms come out of the backward
pass XLA already schedules (no activation or cotangent is kept alive past its layer, as
capturing intermediates or perturbations would need), and the jaxpr check makes a wrong
answer from an unforeseen use of a leaf a slow answer instead.

Per-example loss `ℓ_i` is `loss_fn` on the one-example batch i, as in the vmap reference; the
fast path equals it when `loss_fn(batch) = mean_i loss_fn(batch_i)` (true for means over B
and, with equal lengths, over B×T). Layers that couple examples (BatchNorm in training mode)
make per-example gradients ill-defined; neither path detects them.

The per-layer rules above are in `cbs.stats.ghost_rules`; this module holds the taps, the
discovery of covered leaves and the passes.

Letters: B batch, T positions (sequence or spatial, flattened), D input features, O output
features, V vocabulary, n parameter leaves of one layer call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs.stats.examples import map_examples, one_example
from cbs.stats.ghost_rules import CONV, DENSE, EMBED, RULE_FNS, SCALE_SHIFT

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

_RULES = (DENSE, CONV, EMBED, SCALE_SHIFT)
_METHODS = ("auto", "fast", "vmap")


# ----------------------------------------------------------------------------- taps


@dataclasses.dataclass(eq=False)
class _Call:
    """One tapped layer call as seen by the recording trace."""

    rule: str
    leaves: tuple[int | None, ...]  # params leaf index per layer parameter; -1 unknown
    batch_ok: bool
    dtype: jnp.dtype  # dtype of the norms (and of the tap)


@dataclasses.dataclass(eq=False)
class _Context:
    batch_size: int
    leaf_index: dict[int, int]
    active: list[tuple[bool, ...]] | None  # apply mode: per call, which norms to compute
    taps: Sequence[jax.Array] | None
    calls: list[_Call] = dataclasses.field(default_factory=list)


_CONTEXT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("cbs_ghost_tap",
                                                                          default=None)


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    rule: str
    fn: Callable[..., jax.Array]
    active: tuple[bool, ...]
    options: tuple
    tap_spec: Any = None  # the tap's PartitionSpec (explicit sharding types must match)


def tap(rule: str, fn: Callable[..., jax.Array], x: jax.Array,
        params: tuple[jax.Array | None, ...], options: tuple = ()) -> jax.Array:
    """Returns `fn(x, *params)`, tapping the per-example norms of `params` inside a context.

    rule: one of "dense" (params kernel [D, O], bias [O]), "conv" (kernel [kh, kw, D, O], bias;
    options (strides, padding)), "embed" (x int ids, params (table [V, O],)), "scale_shift"
    (params scale, bias broadcast over trailing axes of x). None params are absent.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        return fn(x, *params)
    if rule not in _RULES:
        raise ValueError(f"unknown tap rule {rule!r}; known: {_RULES}")
    i = len(ctx.calls)
    leaves = tuple(None if p is None else ctx.leaf_index.get(id(p), -1) for p in params)
    min_ndim = 1 if rule == EMBED else 2
    batch_ok = jnp.ndim(x) >= min_ndim and jnp.shape(x)[0] == ctx.batch_size
    ctx.calls.append(_Call(rule, leaves, bool(batch_ok), _acc_dtype(params)))
    if ctx.active is None:  # counting pass
        return fn(x, *params)
    if i >= len(ctx.active):
        raise RuntimeError("loss_fn made more layer calls than when it was first traced")
    active = ctx.active[i]
    if not any(active):
        return fn(x, *params)
    tap_Bxn = ctx.taps[i]
    spec = _Spec(rule, fn, active, options, jax.typeof(tap_Bxn).sharding.spec)
    return _tapped(spec, x, params, tap_Bxn)


def _acc_dtype(params) -> jnp.dtype:
    dtypes = [p.dtype for p in params if p is not None]
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tapped(spec: _Spec, x, params, tap_Bxn):
    del tap_Bxn
    return spec.fn(x, *params)


def _tapped_fwd(spec, x, params, tap_Bxn):
    del tap_Bxn
    return spec.fn(x, *params), (x, params)


def _tapped_bwd(spec, res, gy):
    x, params = res
    dtype = _acc_dtype(params)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        _, vjp = jax.vjp(spec.fn, x, *params)
        dx, *dparams = vjp(gy)
    else:
        _, vjp = jax.vjp(lambda *p: spec.fn(x, *p), *params)
        dparams = vjp(gy)
        dx = np.zeros(x.shape, jax.dtypes.float0)
    x_acc = x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x
    norms = RULE_FNS[spec.rule](spec, x_acc, gy.astype(dtype), params)
    norms_Bxn = jnp.stack([n for n, a in zip(norms, spec.active, strict=True) if a], axis=1)
    if jax.typeof(norms_Bxn).sharding.spec != spec.tap_spec:  # explicit mesh axes only
        norms_Bxn = jax.sharding.reshard(norms_Bxn, spec.tap_spec)
    return dx, tuple(dparams), norms_Bxn.astype(dtype)


_tapped.defvjp(_tapped_fwd, _tapped_bwd)


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class _Plan:
    call_leaves: list[tuple[int | None, ...]]
    active: list[tuple[bool, ...]]  # per call: which parameters get a norm column
    dtypes: list[jnp.dtype]  # per call: tap dtype
    columns: dict[int, tuple[int, int]]  # covered leaf -> (call, column)
    unused: tuple[int, ...]  # leaves the loss does not read: zero gradient
    uncovered: dict[int, str]  # leaf -> why it needs vmap


def _batch_size(batch: PyTree) -> int:
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree.leaves(batch)}
    if not sizes:
        raise ValueError("batch has no arrays")
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch leaves must share a leading batch axis; got sizes {sizes}")
    return sizes.pop()


def _leaf_paths(params: PyTree) -> list[str]:
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [p.removesuffix("/value") for p in paths]


@contextlib.contextmanager
def _active(ctx: _Context):
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def _trace_calls(loss_fn: LossFn, params: PyTree, batch: PyTree, batch_size: int):
    """Traces (never runs) the loss twice: (layer calls, jaxpr with leaves and taps as inputs).

    The first trace lists the layer calls; the second taps all of them, with the taps as
    jaxpr inputs, so the jaxpr shows which equations consume each leaf and each tap.
    """
    leaves, treedef = jax.tree.flatten(params)

    def traced(leaves, active=None, taps=None):
        index = {id(leaf): i for i, leaf in enumerate(leaves)}
        with _active(_Context(batch_size, index, active, taps)) as ctx:
            loss = loss_fn(jax.tree.unflatten(treedef, leaves), batch)
        return loss, ctx.calls

    calls = []
    jax.eval_shape(lambda leaves: calls.extend(traced(leaves)[1]) or 0.0, leaves)
    full = [tuple(leaf is not None and c.batch_ok for leaf in c.leaves) for c in calls]
    taps = [jax.ShapeDtypeStruct((batch_size, sum(m)), c.dtype)
            for m, c in zip(full, calls, strict=True)]
    traced_loss = lambda leaves, taps: traced(leaves, full, taps)[0]
    return calls, jax.make_jaxpr(traced_loss)(leaves, taps).jaxpr


def _why_uncovered(calls: list[_Call], jaxpr, n_leaves: int) -> dict[int, str | None]:
    """Per leaf: None when the fast path covers it, "" when the loss never reads it, else why
    it needs vmap."""
    consumers: dict[int, list[int]] = {}  # id(var) -> top-level equations (-1: the output)
    for e, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            consumers.setdefault(id(v), []).append(e)
    for v in jaxpr.outvars:
        consumers.setdefault(id(v), []).append(-1)
    own_eqn = []  # per call: its own custom_vjp equation, when consumed at top level only
    for v in jaxpr.invars[n_leaves:]:
        found = consumers.get(id(v), [])
        eqn = jaxpr.eqns[found[0]] if len(found) == 1 and found[0] >= 0 else None
        top = eqn is not None and eqn.primitive.name == "custom_vjp_call" and eqn.invars[-1] is v
        own_eqn.append(found[0] if top else None)
    refs: list[list[int]] = [[] for _ in range(n_leaves)]
    for c, call in enumerate(calls):
        for leaf in call.leaves:
            if leaf is not None and leaf >= 0:
                refs[leaf].append(c)
    why = {}
    for leaf, (v, cs) in enumerate(zip(jaxpr.invars[:n_leaves], refs, strict=True)):
        found = consumers.get(id(v), [])
        if not cs:  # "" marks a leaf the loss never reads: zero gradient, nothing to do
            why[leaf] = ("not used through a cbs.models.layers layer (or transformed first)"
                         * bool(found))
        elif len(cs) > 1:
            why[leaf] = f"shared by {len(cs)} layer calls"
        elif not calls[cs[0]].batch_ok:
            why[leaf] = "its layer input does not have the batch as leading axis"
        elif own_eqn[cs[0]] is None:
            why[leaf] = "its layer runs inside a nested transformation (scan, cond, remat, jit)"
        elif found != [own_eqn[cs[0]]]:
            why[leaf] = "also used outside its layer"
        else:
            why[leaf] = None
    return why


def _discover(loss_fn: LossFn, params: PyTree, batch: PyTree, batch_size: int) -> _Plan:
    """Maps layer calls to params leaves and decides which leaves the taps cover."""
    n_leaves = len(jax.tree.leaves(params))
    calls, jaxpr = _trace_calls(loss_fn, params, batch, batch_size)
    why = _why_uncovered(calls, jaxpr, n_leaves)
    active, columns = [], {}
    for c, call in enumerate(calls):
        mask = tuple(leaf is not None and leaf >= 0 and why[leaf] is None for leaf in call.leaves)
        active.append(mask)
        for col, leaf in enumerate(l for l, m in zip(call.leaves, mask, strict=True) if m):
            columns[leaf] = (c, col)
    return _Plan([c.leaves for c in calls], active, [c.dtype for c in calls], columns,
                 tuple(leaf for leaf, w in why.items() if w == ""),
                 {leaf: w for leaf, w in why.items() if w})


def uncovered_leaves(loss_fn: LossFn, params: PyTree, batch: PyTree) -> dict[str, str]:
    """Params leaf paths the fast path cannot cover, with the reason (traces, never runs)."""
    plan = _discover(loss_fn, params, batch, _batch_size(batch))
    paths = _leaf_paths(params)
    return {paths[leaf]: why for leaf, why in plan.uncovered.items()}


# ----------------------------------------------------------------------------- passes


def _fast_pass(loss_fn: LossFn, params: PyTree, batch: PyTree, plan: _Plan, batch_size: int):
    """One forward + one backward: mean loss, ḡ and the tapped norms (scaled to ℓ_i)."""
    taps = [jnp.zeros((batch_size, sum(mask)), dtype)
            for mask, dtype in zip(plan.active, plan.dtypes, strict=True)]

    def loss_with_taps(params, taps):
        index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
        with _active(_Context(batch_size, index, plan.active, taps)) as ctx:
            loss = loss_fn(params, batch)
        if [c.leaves for c in ctx.calls] != plan.call_leaves:
            raise RuntimeError("loss_fn made different layer calls than when first traced")
        return loss

    loss, (grad, tap_grads) = jax.value_and_grad(loss_with_taps, argnums=(0, 1))(params, taps)
    scale = float(batch_size) ** 2  # cotangents of the MEAN loss carry a 1/B
    norms = {leaf: tap_grads[c][:, col] * scale for leaf, (c, col) in plan.columns.items()}
    return loss, grad, norms


def _sq_norm(g: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))


def _vmap_info(loss_fn: LossFn, params: PyTree, batch: PyTree, chunk_size: int | None):
    """The reference: per-example gradients by vmap(grad), chunked; loss and ḡ from one
    ordinary pass (summing the per-example gradients instead is much slower on CPU)."""
    def one(example):
        return jax.tree.map(_sq_norm, jax.grad(loss_fn)(params, one_example(example)))

    loss, grad = jax.value_and_grad(loss_fn)(params, batch)
    return loss, grad, map_examples(one, batch, chunk_size)


def _vmap_sq_norms(loss_fn: LossFn, params: PyTree, batch: PyTree, which: Sequence[int],
                   chunk_size: int | None) -> list[jax.Array]:
    """|∂ℓ_i/∂leaf|² by vmap(grad) w.r.t. the leaves `which` only."""
    leaves, treedef = jax.tree.flatten(params)

    def one(example):
        def loss_of(sub):
            full = list(leaves)
            for i, s in zip(which, sub, strict=True):
                full[i] = s
            return loss_fn(jax.tree.unflatten(treedef, full), one_example(example))

        return [_sq_norm(g) for g in jax.grad(loss_of)([leaves[i] for i in which])]

    return map_examples(one, batch, chunk_size)


# ----------------------------------------------------------------------------- public


def per_example_grads_info(loss_fn: LossFn, params: PyTree, batch: PyTree, *,
                           method: str = "auto", chunk_size: int | None = None
                           ) -> tuple[jax.Array, PyTree, PyTree]:
    """Mean loss, mean gradient ḡ and per-example squared gradient norms per params leaf.

    Args:
      loss_fn: loss_fn(params, batch) -> scalar MEAN loss over the leading batch axis.
      params: pytree of float arrays.
      batch: pytree of arrays sharing a leading axis B.
      method: "fast" taps cbs.models.layers layers (one forward + one backward) and raises
        ValueError naming any leaf it cannot cover; "auto" does the same but computes
        uncovered leaves by vmap(grad) restricted to them; "vmap" is the reference: every
        norm by vmap(grad), chunked, with loss and ḡ from one ordinary pass.
      chunk_size: examples per vmap chunk (None: all at once); bounds vmap memory.

    Returns:
      (loss, grad, sq_norms): scalar mean loss; grad like params; sq_norms like params with
      [B] leaves |∂ℓ_i/∂leaf|² (dtype float32, or the leaf's dtype if wider), ℓ_i being
      loss_fn on the one-example batch i. Jittable; the batch may be sharded.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    batch_size = _batch_size(batch)
    if method == "vmap":
        return _vmap_info(loss_fn, params, batch, chunk_size)
    plan = _discover(loss_fn, params, batch, batch_size)
    paths = _leaf_paths(params)
    if method == "fast" and plan.uncovered:
        lines = "; ".join(f"{paths[leaf]}: {why}" for leaf, why in plan.uncovered.items())
        raise ValueError(f"method='fast' cannot cover these params leaves ({lines}); build "
                         "them from cbs.models.layers or use method='auto'")
    loss, grad, norms = _fast_pass(loss_fn, params, batch, plan, batch_size)
    leaves, treedef = jax.tree.flatten(params)
    which = sorted(plan.uncovered)
    if which:
        fallback = _vmap_sq_norms(loss_fn, params, batch, which, chunk_size)
        norms.update(zip(which, fallback, strict=True))
    out = []
    for i, leaf in enumerate(leaves):
        dtype = jnp.promote_types(leaf.dtype, jnp.float32)
        out.append(norms[i].astype(dtype) if i in norms else jnp.zeros((batch_size,), dtype))
    return loss, grad, jax.tree.unflatten(treedef, out)
