"""Ghost norms of a params leaf read by several uses, every one a `dot_general` or an embedding
`gather` (a tied input/output embedding, a kernel read by two matmuls).

Example i's gradient of the leaf is the sum of its uses' per-example gradients A_u,i (in the
leaf's layout), so |Σ_u A_u,i|² = Σ_u |A_u,i|² + 2 Σ_{u<v} <A_u,i, A_v,i>, every term a sum
over pairs of positions of example i alone (letters and scaling as in `cbs.stats.ghost`):

- a `dot_general` use reads the leaf as a kernel: A_u,i = Σ_t x_t g_tᵀ, x_t over the leaf
  axes it contracts (its *x side*), g_t over the others (its *g side*);
- an embedding `gather` reads it as a table [V, O]: A_u,i = Σ_t onehot(id_t) e_tᵀ (x side
  the rows, g side the columns, e_t the output cotangent);
- two dot uses with the same x side: Σ_{t,s} (x_t·x'_s)(g_t·g'_s); with each one's x side the
  other's g side (a tied head `h @ Wᵀ` against `z @ W`): Σ_{t,s} (x_t·g'_s)(g_t·x'_s); a dot
  use against itself: |x_i|²|g_i|² for one position, else the first with x' = x, g' = g;
- a gather against a dot use whose g side is the table's rows (the tied output projection
  logits_t = W h_t of a table W [V, O], data h_t ∈ R^O, cotangent g_t ∈ R^V):
  Σ_{t,s} g_t[id_s] (h_t·e_s); whose x side is the rows (one-hot inputs times W):
  Σ_{t,s} x_t[id_s] (g_t·e_s);
- two gathers from the same table layout: Σ_{t,s: id_t = id'_s} e_t·e'_s.

`plan` takes the cheaper of this *Gram form* and the *direct form* (each example's gradient
formed, squared and summed for the leaf's gradient), or leaves the leaf to the materialised path
(docs/design.md, "Per-example gradient norms"); `FORM` forces one (benchmarks/lm_step.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from cbs.stats.examples import map_and_sum
from cbs.stats.ghost_rules import dense_operands, embed_layout, embed_operands, examples_first

__all__ = ["ENTRY_COST", "FORM", "FORMS", "Part", "Tied", "plan", "sq_norms"]

FORMS = ("auto", "gram", "direct", "materialised")
FORM = "auto"  # "auto": the cheaper of "gram" and "direct"; others force one (benchmarks)

# Layout operations that keep every entry where it is (dtype, sharding, copies).
_SAME = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision",
                   "sharding_constraint", "reshard", "mesh_cast", "pvary"})
_UNIT_AXES = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})


@dataclasses.dataclass(frozen=True)
class Part:
    """One use as the rule reads it: its x and g sides as leaf axes (non-unit ones, in the order
    the use's operands flatten them) and their sizes."""

    use: Any  # ghost_trace.Use
    kind: str  # "dot" | "gather"
    x_axes: tuple[int, ...]
    g_axes: tuple[int, ...]
    x_sizes: tuple[int, ...]
    g_sizes: tuple[int, ...]
    positions: int  # T: positions per example (per scan step)


@dataclasses.dataclass(frozen=True)
class Tied:

    parts: tuple[Part, ...]
    pairs: dict[tuple[int, int], str]  # (j, k), j <= k -> how they meet (`_pairing`)
    form: str  # "gram" | "direct"
    slice_shape: tuple[int, ...]  # the leaf (or one scan step's slice of it)
    work: tuple[int, ...]  # the direct form's layout: the leaf's non-unit axes in this order


def _operand_axes(chain, shape) -> list[int | None] | None:
    """Per axis of the use's operand, the leaf axis it is (None: a unit axis), through a chain
    of layout operations that only transpose and add or remove unit axes; else None."""
    axes: list[int | None] = [a if n != 1 else None for a, n in enumerate(shape)]
    for eqn in chain:
        name = eqn.primitive.name
        if name in _SAME:
            continue
        if name == "transpose":
            axes = [axes[p] for p in eqn.params["permutation"]]
        elif name in _UNIT_AXES:
            before, after = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            if (name == "reshape" and eqn.params.get("dimensions") is not None) or (
                    [n for n in before if n != 1] != [n for n in after if n != 1]):
                return None
            kept = iter([a for a, n in zip(axes, before, strict=True) if n != 1])
            axes = [next(kept) if n != 1 else None for n in after]
        else:
            return None
    return axes


def _part(use) -> Part | None:
    name = use.eqn.primitive.name
    axes = _operand_axes(use.chain, use.origin.shape) if use.keeps_norm else None
    if axes is None or name not in ("dot_general", "gather"):
        return None
    w_shape = use.eqn.invars[use.pos].aval.shape
    x_aval, g_aval = use.eqn.invars[1 - use.pos].aval, use.eqn.outvars[0].aval
    if name == "gather":
        layout = embed_layout(use)
        if use.pos != 0 or layout is None or None in axes:  # a table of one row or column
            return None
        positions = int(np.prod(x_aval.shape[:-1])) // x_aval.shape[use.e_in]
        return Part(use, "gather", (cast(int, axes[0]),), (cast(int, axes[1]),),
                    (layout[0],), (layout[1],), positions)
    if not jnp.issubdtype(x_aval.dtype, jnp.inexact):
        return None
    (lc, rc), _ = use.eqn.params["dimension_numbers"]
    wc = list(rc if use.pos == 1 else lc)
    w_free = [a for a in range(len(w_shape)) if a not in wc]
    x_side = [a for a in wc if axes[a] is not None]
    g_side = [a for a in w_free if axes[a] is not None]
    positions = int(np.prod(g_aval.shape)) // (g_aval.shape[use.e_out]
                                               * int(np.prod([w_shape[a] for a in w_free])))
    return Part(use, "dot", tuple(cast(int, axes[a]) for a in x_side),
                tuple(cast(int, axes[a]) for a in g_side),
                tuple(w_shape[a] for a in x_side), tuple(w_shape[a] for a in g_side),
                positions)


def _pairing(p: Part, q: Part) -> str | None:
    px, pg, qx, qg = set(p.x_axes), set(p.g_axes), set(q.x_axes), set(q.g_axes)
    if p.kind == q.kind == "dot":
        return "same" if px == qx else "transposed" if px == qg and pg == qx else None
    if p.kind == q.kind == "gather":
        return "ids" if p.x_axes == q.x_axes else None
    gather, dot = (p, q) if p.kind == "gather" else (q, p)
    if set(dot.g_axes) == set(gather.x_axes) and set(dot.x_axes) == set(gather.g_axes):
        return "head"
    if set(dot.x_axes) == set(gather.x_axes) and set(dot.g_axes) == set(gather.g_axes):
        return "onehot"
    return None


def _pair_cost(p: Part, q: Part) -> int:
    """Multiply-adds of one example's term <A_p, A_q> in the Gram form."""
    t = p.positions * q.positions
    if p.kind == q.kind == "dot":
        return (1 if p is q and p.positions == 1 else t) * (int(np.prod(p.x_sizes))
                                                            + int(np.prod(p.g_sizes)))
    gather = p if p.kind == "gather" else q
    return t * (int(np.prod(gather.g_sizes)) + 1)


ENTRY_COST = 4  # multiply-adds per entry of a per-example gradient: its memory traffic


def _direct_cost(parts: tuple[Part, ...], size: int) -> int:
    """Multiply-adds the direct form adds to one example's plain gradient."""
    return ENTRY_COST * (len(parts) + 1) * size


def plan(uses) -> Tied | None:
    """The rule for a leaf read by `uses` (two or more, in one scan context) in the form `FORM`
    asks for, or None for the materialised path."""
    form = FORM
    if form not in FORMS:
        raise ValueError(f"ghost_tied.FORM must be one of {FORMS}, got {form!r}")
    if form == "materialised" or len(uses) < 2:
        return None
    found = tuple(_part(u) for u in uses)
    if any(p is None for p in found):
        return None
    parts = cast(tuple[Part, ...], found)
    pairs = {(j, k): _pairing(parts[j], parts[k])
             for j in range(len(parts)) for k in range(j, len(parts))}
    if None in pairs.values():
        return None
    slice_shape = tuple(uses[0].origin.shape)
    gram = sum(_pair_cost(parts[j], parts[k]) for j, k in pairs)
    direct = _direct_cost(parts, int(np.prod(slice_shape)))
    if form == "auto":
        form = "gram" if gram < direct else "direct"
    # The direct form sums the per-example gradients in the layout its first dot use forms
    # them in, so that only their sum is transposed to the leaf's.
    work = _natural(next((p for p in parts if p.kind == "dot"), parts[0]))
    return Tied(parts, cast(dict[tuple[int, int], str], pairs), form, slice_shape, work)


def _sorted_side(a: jax.Array, axes: tuple[int, ...], sizes: tuple[int, ...]) -> jax.Array:
    """a [T, prod(sizes)] with its features reordered from `axes` order to ascending leaf axes."""
    order = [int(i) for i in np.argsort(axes)]
    if order == list(range(len(axes))):
        return a
    t = a.shape[0]
    return a.reshape(t, *sizes).transpose(0, *(1 + i for i in order)).reshape(t, -1)


def _operands(part: Part, x_i: jax.Array, g_i: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One example's (x [T, C], g [T, F]) of a dot part (features in ascending leaf axes), or
    (ids [T], e [T, O]) of a gather."""
    u = part.use
    x1, g1 = jnp.expand_dims(x_i, u.e_in), jnp.expand_dims(g_i, u.e_out)
    if part.kind == "gather":
        ids, e = cast(tuple[jax.Array, jax.Array], embed_operands(u, x1, g1))  # `_part` read it
        return ids[0], e[0]
    x, g, _, _ = dense_operands(u, x1, g1)
    return (_sorted_side(x[0], part.x_axes, part.x_sizes),
            _sorted_side(g[0], part.g_axes, part.g_sizes))


def _gram(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """[T, S]: a_t·b_s, in the operands' common dtype, accumulated in `dtype`."""
    common = jnp.promote_types(a.dtype, b.dtype)
    return jnp.einsum("tc,sc->ts", a.astype(common), b.astype(common), preferred_element_type=dtype)


def _term(how: str, p: Part, q: Part, op_p, op_q, dtype) -> jax.Array:
    if how == "same":
        (x, g), (x2, g2) = op_p, op_q
        if p is q and p.positions == 1:
            return _gram(x, x, dtype)[0, 0] * _gram(g, g, dtype)[0, 0]
        return jnp.sum(_gram(x, x2, dtype) * _gram(g, g2, dtype))
    if how == "transposed":
        (x, g), (x2, g2) = op_p, op_q
        return jnp.sum(_gram(x, g2, dtype) * _gram(g, x2, dtype))
    if how == "ids":
        (ids, e), (ids2, e2) = op_p, op_q
        return jnp.sum(jnp.where(ids[:, None] == ids2[None, :], _gram(e, e2, dtype), 0))
    (ids, e), (x, g) = (op_p, op_q) if p.kind == "gather" else (op_q, op_p)
    if how == "head":  # the dot's g side is the table's rows: Σ g_t[id_s] (x_t·e_s)
        picked, other = jnp.take(g, ids, axis=1), _gram(x, e, dtype)
    else:  # "onehot": its x side is: Σ x_t[id_s] (g_t·e_s)
        picked, other = jnp.take(x, ids, axis=1), _gram(g, e, dtype)
    return jnp.sum(picked.astype(dtype) * other)


def _natural(part: Part) -> tuple[int, ...]:
    """The leaf axes of a part's per-example gradient as formed: a dot's g side then its x
    side ([F, C]), a gather's rows then columns ([V, O])."""
    sides = (part.g_axes, part.x_axes) if part.kind == "dot" else (part.x_axes, part.g_axes)
    return tuple(sorted(sides[0])) + tuple(sorted(sides[1]))


def _in_work_layout(part: Part, op, tied: Tied, dtype) -> jax.Array:
    """One example's gradient of the leaf by `part`, its axes in `tied.work` order."""
    natural = _natural(part)
    if part.kind == "gather":
        ids, e = op
        if tied.work == natural[::-1]:  # columns first: scattered into the columns
            return jnp.zeros((part.g_sizes[0], part.x_sizes[0]), dtype).at[:, ids].add(
                e.astype(dtype).T)
        grad = jnp.zeros((part.x_sizes[0], part.g_sizes[0]), dtype).at[ids].add(e.astype(dtype))
    else:
        # [F, C] = Σ_t g_t x_tᵀ, contracting a unit axis with T: XLA:CPU then takes its library
        # kernel (over T alone, its generic loop: up to 1.6× the LM step's tied-head share).
        x, g = op
        common = jnp.promote_types(x.dtype, g.dtype)
        grad = jax.lax.dot_general(g.astype(common)[None], x.astype(common)[None],
                                   (((0, 1), (0, 1)), ((), ())), preferred_element_type=dtype)
    grad = grad.reshape([tied.slice_shape[a] for a in natural])
    if natural == tied.work:
        return grad
    return jnp.transpose(grad, [natural.index(a) for a in tied.work])


def _slice_norm(tied: Tied, items: list, dtype):
    """(|Σ_u A_u|², Σ_u A_u in `tied.work` order or () in the Gram form) of one example."""
    ops = [_operands(p, x, g) for p, (x, g) in zip(tied.parts, items, strict=True)]
    if tied.form == "gram":  # |Σ_u A_u|² from the Gram terms
        sq = jnp.zeros((), dtype)
        for (j, k), how in tied.pairs.items():
            term = _term(how, tied.parts[j], tied.parts[k], ops[j], ops[k], dtype)
            sq = sq + (term if j == k else 2 * term)
        return sq, ()
    total = sum(_in_work_layout(p, op, tied, dtype) for p, op in zip(tied.parts, ops, strict=True))
    return jnp.sum(jnp.square(total)), total


def sq_norms(tied: Tied, caps: dict, cotangents: dict, dtype, chunk_size: int | None,
             budget_bytes: int) -> tuple[jax.Array, jax.Array | None]:
    """([B] |Σ_u A_u,i|² of the MEAN loss's cotangents, the leaf's gradient Σ_i Σ_u A_u,i or
    None in the Gram form), in chunks of `chunk_size` examples (None: as `budget_bytes` holds)."""
    items = examples_first([p.use for p in tied.parts], caps, cotangents)
    stack = tied.parts[0].use.stack

    def one(items_i):
        fn = lambda items: _slice_norm(tied, items, dtype)
        for _ in stack:
            fn = jax.vmap(fn)
        sq, total = fn(items_i)
        return jnp.sum(sq), total

    batch_size = items[0][0].shape[0]
    if chunk_size is None:  # per scan step: two [T_u, T_v] per pair, or the uses' gradients
        item = np.dtype(dtype).itemsize
        if tied.form == "gram":
            per_step = 2 * item * sum(tied.parts[j].positions * tied.parts[k].positions
                                      for j, k in tied.pairs)
        else:
            per_step = item * (len(tied.parts) + 1) * int(np.prod(tied.slice_shape))
        per_example = per_step * int(np.prod(stack))
        chunk_size = int(max(1, min(batch_size, budget_bytes // max(per_example, 1))))
    sq, total = map_and_sum(one, items, chunk_size)
    if tied.form == "gram":
        return sq, None
    # the summed gradient from `tied.work` order (after the stack axes) to the leaf's layout
    depth, stack = len(stack), total.shape[:len(stack)]
    total = total.reshape(*stack, *[tied.slice_shape[a] for a in tied.work])
    order = [depth + int(i) for i in np.argsort(tied.work)]
    return sq, jnp.transpose(total, [*range(depth), *order]).reshape(*stack, *tied.slice_shape)
