"""Per-operation rules of the ghost-norm pass (`cbs.stats.ghost`: the mechanism, the formulas
and the letters; V vocabulary).

Each `*_sq_norm` rule takes a `cbs.stats.ghost_trace.Use` and its data operand x and output
cotangent g for one scan step (g of the MEAN loss: `cbs.stats.ghost` rescales by B²) and returns
the [B] squared norms, or None for a layout it does not read. `per_example_grad` is exact for
any use: the operation's transpose applied to one example's cotangent, in the leaf's layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from cbs.stats.examples import scan_chunks, sum_over_examples
from cbs.stats.ghost_trace import ELEMENTWISE_USES

__all__ = [
    "CPU_CHUNK_BYTES", "FUSED_RULES", "SQ_NORM_RULES", "bind", "dense_operands",
    "elementwise_fused", "embed_layout", "embed_operands", "example_chunk", "examples_first",
    "fuse_direct", "fused", "per_example_grad", "tap", "use_gram",
]


def use_gram(t: int, d: int, o: int) -> bool:
    """Whether the Gram form (T²(D+O) per example) is cheaper than the direct one (T·D·O)."""
    return t * (d + o) < d * o


_FUSED_BYTES = 256 * 2**20  # most bytes of a layer's [B, D, O] per-example gradients


def fuse_direct(b: int, t: int, d: int, o: int) -> bool:
    """Whether a layer's weight gradient is the sum of its B per-example gradients [B, D, O]
    (formed for their norms): 4 multiply-adds per entry (memory traffic) against the Gram form's
    T²(D + O) per example (docs/guides/benchmarks.md)."""
    return t > 1 and 4 * d * o < t * t * (d + o) and 4 * b * d * o <= _FUSED_BYTES


def _direct_products(x_BxTxD: jax.Array, g_BxTxO: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(Σ_i G_i [D, O], [B] |G_i|²) of G_i = Σ_t x_it g_itᵀ, accumulated in `dtype`."""
    d = x_BxTxD.shape[-1]
    common = jnp.promote_types(x_BxTxD.dtype, g_BxTxO.dtype)
    # the larger feature axis minor: faster on XLA:CPU (docs/guides/benchmarks.md)
    o_major = d > g_BxTxO.shape[-1]
    grad_i = jnp.einsum("btd,bto->bod" if o_major else "btd,bto->bdo", x_BxTxD.astype(common),
                        g_BxTxO.astype(common), preferred_element_type=dtype)
    total = sum_over_examples(grad_i)
    return (total.T if o_major else total), _sq_norms(grad_i, 0)


def _kernel_sq_norm(x_BxTxD: jax.Array, g_BxTxO: jax.Array) -> jax.Array:
    _, t, d = x_BxTxD.shape
    o = g_BxTxO.shape[-1]
    if t == 1:
        return jnp.sum(jnp.square(x_BxTxD), (1, 2)) * jnp.sum(jnp.square(g_BxTxO), (1, 2))
    if use_gram(t, d, o):
        xx_BxTxT = jnp.einsum("btd,bsd->bts", x_BxTxD, x_BxTxD)
        gg_BxTxT = jnp.einsum("bto,bso->bts", g_BxTxO, g_BxTxO)
        return jnp.sum(xx_BxTxT * gg_BxTxT, (1, 2))
    grad_BxDxO = jnp.einsum("btd,bto->bdo", x_BxTxD, g_BxTxO)
    return jnp.sum(jnp.square(grad_BxDxO), (1, 2))


def _perm_reshape(a: jax.Array, lead: list[int], rest: list[int], b: int) -> jax.Array:
    """a transposed to (lead..., rest...) and reshaped to [b, -1, prod(rest)]."""
    a = jnp.transpose(a, lead + rest)
    return a.reshape(b, -1, int(np.prod([a.shape[len(lead) + i] for i in range(len(rest))])))


def dense_operands(use, x, g):
    """(x [B, T, C], g [B, T, F], W's contracting axes, W's free axes) of a `dot_general`
    with the parameter W on one side: C the contracting axes in the order of W's, F W's free
    axes in order, so that Σ_t x_t g_tᵀ is W's gradient with its axes permuted."""
    (lc, rc), _ = use.eqn.params["dimension_numbers"]
    xc, wc = (lc, rc) if use.pos == 1 else (rc, lc)
    w_rank = len(use.eqn.invars[use.pos].aval.shape)
    w_free = [a for a in range(w_rank) if a not in wc]
    x_free = [a for a in range(x.ndim) if a not in xc]
    offset = 0 if use.pos == 1 else len(w_free)
    x_out = {a: offset + i for i, a in enumerate(x_free)}
    w_out = [(len(x_free) if use.pos == 1 else 0) + i for i in range(len(w_free))]
    b = x.shape[use.e_in]
    rest_x = [a for a in x_free if a != use.e_in]
    x_BxTxC = _perm_reshape(x, [use.e_in] + rest_x, list(xc), b)
    g_BxTxF = _perm_reshape(g, [use.e_out] + [x_out[a] for a in rest_x], w_out, b)
    return x_BxTxC, g_BxTxF, list(wc), w_free


def _dense_fused(use, x, g, dtype) -> tuple[jax.Array, jax.Array] | None:
    """(W's gradient Σ_i G_i in W's layout, [B] |G_i|²), when `fuse_direct` admits the shapes."""
    x_BxTxC, g_BxTxF, wc, w_free = dense_operands(use, x, g)
    b, t, d = x_BxTxC.shape
    if not fuse_direct(b, t, d, g_BxTxF.shape[-1]):
        return None
    total_CxF, sq = _direct_products(x_BxTxC, g_BxTxF, dtype)
    w_shape = use.eqn.invars[use.pos].aval.shape
    total = total_CxF.reshape([w_shape[a] for a in wc] + [w_shape[a] for a in w_free])
    return jnp.transpose(total, [int(a) for a in np.argsort(wc + w_free)]), sq


def _patches(x_BxSxD: jax.Array, window, strides, padding) -> jax.Array:
    """[B, S'..., prod(window)·D] input windows of a convolution, by strided slices (faster
    than `conv_general_dilated_patches` on XLA:CPU: docs/guides/benchmarks.md)."""
    x = jnp.pad(x_BxSxD, ((0, 0), *padding, (0, 0)))
    outs = [(x.shape[1 + k] - w) // s + 1
            for k, (w, s) in enumerate(zip(window, strides, strict=True))]
    pieces = []
    for offs in itertools.product(*map(range, window)):
        index = tuple(slice(o, o + (n - 1) * s + 1, s)
                      for o, n, s in zip(offs, outs, strides, strict=True))
        pieces.append(x[(slice(None), *index)])
    return jnp.concatenate(pieces, axis=-1)


CPU_CHUNK_BYTES = 2 * 2**20  # on XLA:CPU, most bytes of a chunk's input windows and cotangent


def example_chunk(b: int, bytes_per_example: int) -> int:
    """Examples per chunk of a convolution's per-example work, a divisor of b: on XLA:CPU
    chunks that stay in cache (docs/guides/benchmarks.md), of at most `CPU_CHUNK_BYTES` and a
    multiple of the device count, at least a quarter of the largest; else b (one chunk)."""
    most = CPU_CHUNK_BYTES // max(bytes_per_example, 1)
    if jax.default_backend() != "cpu" or most >= b:
        return b
    devices = jax.device_count()
    for c in range(min(most, b), max(most // 4, 1) - 1, -1):
        if b % c == 0 and c % devices == 0:
            return c
    return b


def _conv_inputs(use, x, g):
    """(x [B, S..., D], g [B, S'..., O], window) of a `conv_general_dilated` the rules read
    (kernel on the right, no dilation or groups, explicit padding), else None."""
    p = use.eqn.params
    if (use.pos != 1 or p["feature_group_count"] != 1 or p["batch_group_count"] != 1
            or any(d != 1 for d in p["lhs_dilation"]) or any(d != 1 for d in p["rhs_dilation"])
            or isinstance(p["padding"], str)):
        return None
    dn = p["dimension_numbers"]
    kernel_shape = use.eqn.invars[1].aval.shape
    window = [kernel_shape[a] for a in dn.rhs_spec[2:]]
    x_BxSxD = jnp.transpose(x, (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1]))
    g_BxSxO = jnp.transpose(g, (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1]))
    return x_BxSxD, g_BxSxO, window


def _window_shape(x_BxSxD, g_BxSxO, window) -> tuple[int, int, int, int]:
    """(B, T output positions, D = prod(window)·input channels, O) of a convolution."""
    return (x_BxSxD.shape[0], int(np.prod(g_BxSxO.shape[1:-1])),
            int(np.prod(window)) * x_BxSxD.shape[-1], g_BxSxO.shape[-1])


def _windowed(use, fn: Callable, x_BxSxD, g_BxSxO, window):
    """fn(input windows [n, T, prod(window)·D], g [n, T, O]) -> (total, [n] per example),
    over chunks of n examples (`example_chunk`): (Σ totals, [B] per example)."""
    p = use.eqn.params
    b, t, d, o = _window_shape(x_BxSxD, g_BxSxO, window)

    def one(x_nxSxD, g_nxSxO):
        patches = _patches(x_nxSxD, window, p["window_strides"], p["padding"])
        n = x_nxSxD.shape[0]
        return fn(patches.reshape(n, t, d), g_nxSxO.reshape(n, t, o))

    chunk = example_chunk(b, 4 * t * (d + o))
    return scan_chunks(one, (x_BxSxD, g_BxSxO), chunk, interleave=jax.device_count() > 1)


def _conv_sq_norm(use, x, g) -> jax.Array | None:
    if (inputs := _conv_inputs(use, x, g)) is None:
        return None
    return _windowed(use, lambda xw, gw: ((), _kernel_sq_norm(xw, gw)), *inputs)[1]


def _conv_fused(use, x, g, dtype) -> tuple[jax.Array, jax.Array] | None:
    """(the kernel's gradient, [B] squared norms), when `fuse_direct` admits the shapes."""
    if (inputs := _conv_inputs(use, x, g)) is None:
        return None
    spatial = inputs[2]
    if not fuse_direct(*_window_shape(*inputs)):
        return None
    total, sq = _windowed(use, lambda xw, gw: _direct_products(xw, gw, dtype), *inputs)
    dn = use.eqn.params["dimension_numbers"]
    # The windows' features run over (window offsets..., input channel): the kernel's axes.
    total = total.reshape(*spatial, -1, total.shape[-1])
    order = np.argsort([*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]])
    return jnp.transpose(total, [int(a) for a in order]), sq


def embed_layout(use) -> tuple[int, int] | None:
    """(V, O) of a `gather` of whole rows of a [V, O] table by one id per position, the layout
    the embedding rules read; None for any other gather."""
    p = use.eqn.params
    dn = p["dimension_numbers"]
    table, ids, out = use.eqn.invars[0].aval, use.eqn.invars[1].aval, use.eqn.outvars[0].aval
    if len(table.shape) != 2:
        return None
    v, o = table.shape
    if (dn.offset_dims != (len(out.shape) - 1,) or dn.collapsed_slice_dims != (0,)
            or dn.start_index_map != (0,) or tuple(p["slice_sizes"]) != (1, o)
            or ids.shape[-1:] != (1,)):
        return None
    return v, o


def embed_operands(use, ids, g) -> tuple[jax.Array, jax.Array] | None:
    """(ids [B, T] clipped to [0, V), g [B, T, O]) of an embedding `gather` (`embed_layout`),
    g zero where an out-of-range id read the fill value (no gradient)."""
    if (layout := embed_layout(use)) is None:
        return None
    v, o = layout
    b = ids.shape[use.e_in]
    ids_BxT = jnp.moveaxis(ids[..., 0], use.e_in, 0).reshape(b, -1)
    g_BxTxO = jnp.moveaxis(g, use.e_out, 0).reshape(b, -1, o)
    if "FILL" in str(use.eqn.params["mode"]):  # out-of-range ids read the fill value
        g_BxTxO = jnp.where(((ids_BxT >= 0) & (ids_BxT < v))[..., None], g_BxTxO,
                            jnp.zeros((), g_BxTxO.dtype))
    return jnp.clip(ids_BxT, 0, v - 1), g_BxTxO


def _embed_sq_norm(use, ids, g) -> jax.Array | None:
    """Σ_{t,s} [id_t = id_s] g_t·g_s (one-hot when V < T)."""
    if (operands := embed_operands(use, ids, g)) is None:
        return None
    ids_BxT, g_BxTxO = operands
    v = use.eqn.invars[0].aval.shape[0]
    if ids_BxT.shape[1] == 1:
        return jnp.sum(jnp.square(g_BxTxO), (1, 2))
    if v < ids_BxT.shape[1]:
        onehot_BxTxV = jax.nn.one_hot(ids_BxT, v, dtype=g.dtype)
        grad_BxVxO = jnp.einsum("btv,bto->bvo", onehot_BxTxV, g_BxTxO)
        return jnp.sum(jnp.square(grad_BxVxO), (1, 2))
    same_BxTxT = ids_BxT[:, :, None] == ids_BxT[:, None, :]
    gg_BxTxT = jnp.einsum("bto,bso->bts", g_BxTxO, g_BxTxO)
    return jnp.sum(jnp.where(same_BxTxT, gg_BxTxT, 0), (1, 2))


def _elementwise_per_example(use, x, g) -> jax.Array | None:
    """`mul`/`add`/`sub` of a parameter w that size-1 axes broadcast (a norm scale, a bias):
    the per-example gradients x·g (mul) or g (add, sub; a subtracted w's sign left out) summed
    over those axes, in w's shape with B on the example axis; None for other layouts."""
    w_shape = use.eqn.invars[use.pos].aval.shape
    if len(w_shape) != g.ndim or (use.e_out < len(w_shape) and w_shape[use.e_out] != 1):
        return None
    mul = use.eqn.primitive.name == "mul"
    if mul and x.ndim != g.ndim:
        return None
    prod = x * g if mul else g
    summed = tuple(a for a in range(g.ndim) if a != use.e_out and w_shape[a] == 1)
    return jnp.sum(prod, summed, keepdims=True)


def _sq_norms(per_example: jax.Array, example_axis: int) -> jax.Array:
    return jnp.sum(jnp.square(per_example),
                   tuple(a for a in range(per_example.ndim) if a != example_axis))


def _elementwise_sq_norm(use, x, g) -> jax.Array | None:
    per_example = _elementwise_per_example(use, x, g)
    return None if per_example is None else _sq_norms(per_example, use.e_out)


def elementwise_fused(use, x, g, dtype) -> tuple[jax.Array, jax.Array] | None:
    """(w's gradient as the sum of its per-example gradients, their [B] squared norms)."""
    if use.e_out >= g.ndim:
        return None
    per_example = _elementwise_per_example(use, _in_dtype(x, dtype), g.astype(dtype))
    if per_example is None:
        return None
    sq = _sq_norms(per_example, use.e_out)
    total = jnp.sum(per_example, use.e_out, keepdims=True)
    if use.eqn.primitive.name == "sub" and use.pos == 1:
        total = -total
    return total, sq


def _in_dtype(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x


SQ_NORM_RULES = {"dot_general": lambda use, x, g: _kernel_sq_norm(*dense_operands(use, x, g)[:2]),
                 "conv_general_dilated": _conv_sq_norm,
                 "gather": _embed_sq_norm, **dict.fromkeys(ELEMENTWISE_USES, _elementwise_sq_norm)}
# Rules that also give the parameter's gradient (weight gradient = Σ per-example gradients).
FUSED_RULES = {"dot_general": _dense_fused, "conv_general_dilated": _conv_fused,
               **{name: elementwise_fused for name in ("mul", "add", "sub")}}


def _bind(eqn, args, params=None):
    params = dict(eqn.params if params is None else params)
    params.update({key: None for key in ("sharding", "out_sharding") if key in params})
    return eqn.primitive.bind(*args, **params)


def examples_first(uses, caps: dict, cotangents: dict) -> list[tuple[jax.Array, jax.Array]]:
    """Per use, its captured data operand and output cotangent, examples on axis 0."""
    return [(jnp.moveaxis(caps[u.uid], len(u.stack) + u.e_in, 0),
             jnp.moveaxis(cotangents[u.uid], len(u.stack) + u.e_out, 0)) for u in uses]


def per_example_grad(use, x_i, g_i, dtype) -> jax.Array:
    """One example's gradient (x_i, g_i without the example axis) in the leaf's shape."""
    x1 = _in_dtype(jnp.expand_dims(x_i, use.e_in), dtype)
    g1 = jnp.expand_dims(g_i, use.e_out).astype(dtype)
    params = dict(use.eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = dtype

    elementwise = use.eqn.primitive.name in ELEMENTWISE_USES
    chain, last = use.chain, None
    if elementwise and chain and chain[-1].primitive.name == "broadcast_in_dim":
        chain, last = chain[:-1], dict(chain[-1].params)
        if use.e_in not in last["broadcast_dimensions"]:  # broadcast to one example only
            last["shape"] = tuple(1 if a == use.e_in else n for a, n in enumerate(last["shape"]))

    def apply(w):
        for eqn in chain:  # the layout ops from the leaf to the use's operand, in w's dtype
            if eqn.primitive.name not in ("convert_element_type", "reduce_precision"):
                w = _bind(eqn, [w])
        if last is not None:
            w = _bind(use.chain[-1], [w], last)
        if elementwise and w.ndim and w.shape[use.e_in] != 1:  # the same for every example
            w = jax.lax.slice_in_dim(w, 0, 1, axis=use.e_in)
        return _bind(use.eqn, [x1, w] if use.pos == 1 else [w, x1], params)

    _, vjp = jax.vjp(apply, jnp.zeros(use.origin.shape, dtype))
    return vjp(g1)[0]


def bind(eqn: Any, invals: list) -> list:
    """One jaxpr equation on `invals`: the list of its outputs."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def tap(use: Any, dtype: Any) -> Callable:
    """`tap(y, x, slot) = y`, whose backward also returns the use's [B] squared norms (its ghost
    rule on x and the cotangent g of y) as the cotangent of `slot` (`cbs.stats.ghost`)."""
    rule = SQ_NORM_RULES[use.eqn.primitive.name]

    def bwd(x, g):
        sq = cast(jax.Array, rule(use, _in_dtype(x, dtype), g.astype(dtype)))  # plan admitted
        return g, None, sq.astype(dtype)

    tap = jax.custom_vjp(lambda y, x, slot: y)
    tap.defvjp(lambda y, x, slot: (y, x), bwd)
    return tap


def fused(use: Any, dtype: Any) -> Callable:
    """`fused(lhs, rhs, slot) = use(lhs, rhs)`, whose backward forms the B per-example gradients
    of the parameter once, for both their [B] squared norms (the cotangent of `slot`) and their
    sum (its gradient). The data operand's cotangent is the ordinary one."""
    rule, eqn = FUSED_RULES[use.eqn.primitive.name], use.eqn

    def bwd(operands, g):
        w, x = operands[use.pos], operands[1 - use.pos]
        with_x = lambda x: bind(eqn, [x, w] if use.pos == 1 else [w, x])[0]
        dx = jax.vjp(with_x, x)[1](g)[0]
        dw, sq = cast(tuple, rule(use, x, g, dtype))  # admitted by the plan
        cts = [dw.astype(w.dtype), dx] if use.pos == 0 else [dx, dw.astype(w.dtype)]
        return (*cts, sq.astype(dtype))

    fused = jax.custom_vjp(lambda lhs, rhs, slot: bind(eqn, [lhs, rhs])[0])
    fused.defvjp(lambda lhs, rhs, slot: (bind(eqn, [lhs, rhs])[0], (lhs, rhs)), bwd)
    return fused
