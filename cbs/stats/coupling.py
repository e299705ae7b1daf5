"""A structural test, on one shape-only trace, for examples coupled through a batch statistic
(BatchNorm in training mode), where per-example gradients need ℓ_i to depend on example i alone.

Every jaxpr variable gets two tags, propagated forward from the batch inputs (example axis 0):

- its *example axis*, mapped through each operation whose axis rule is known (those of
  `cbs.stats.ghost_trace`), lost through any other. A reshape merging the example axis with
  others (`[B, T, C] -> [B·T, C]`) keeps an axis that *holds* the examples; one splitting it
  out again gives the example axis back;
- *mixed*: a statistic over several examples, from a known operation that reduces or contracts
  an axis holding the examples, or a collective over a `jax.vmap` axis name or a mesh axis a
  `shard_map` splits the examples on.

A known operation whose output keeps an example axis while an operand is mixed is a coupling:
`x − mean(x, axis=0)`. An axis lost through an unknown operation is never reported. Nested
bodies (`jit`, `remat`, custom rules, loops, `cond`, `shard_map`) are walked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.extend import core

from cbs.stats import ghost_trace, nested
from cbs.stats.ghost_trace import _shape

__all__ = ["coupling_site"]

_ALONG_AXIS = ghost_trace._AXIS_OPS | {"sort"}
# collectives by name prefix (releases add `_invariant`, `_start`/`_done`, `unreduced_` forms);
# `psum`, `pmax` and `pmin` also take positional axes: `lax.psum` over a vmapped axis
_COLLECTIVES = ("psum", "pmax", "pmin", "pmean", "all_gather", "reduce_scatter", "psum_scatter",
                "all_to_all", "ragged_all_to_all", "ppermute", "pbroadcast", "pswapaxes",
                "unreduced_psum", "unreduced_reduce_scatter", "psend", "precv")


@dataclasses.dataclass(frozen=True)
class _Tag:
    eaxis: int | None = None  # position of the axis holding the examples
    mixed: bool = False  # a statistic over several examples
    # the axis holds `outer · B · inner` entries, example-major (1, 1: it is the example axis)
    span: tuple[int, int] = (1, 1)


class _Coupled(Exception):
    pass


def coupling_site(jaxpr: Any, batch_invars: range) -> str | None:
    """Where the open `jaxpr` combines a statistic over the examples with per-example values
    ("`sub` at file:line"), or None; `batch_invars`: the inputs led by the example axis."""
    tags = [_Tag(0 if i in batch_invars and _shape(v) else None)
            for i, v in enumerate(jaxpr.invars)]
    try:
        _walk(jaxpr, tags, frozenset())
    except _Coupled as found:
        return str(found)
    return None


def _walk(jaxpr, in_tags: list[_Tag], named: frozenset[str]) -> list[_Tag]:
    """`named`: the mesh axes an enclosing `shard_map` splits the examples on."""
    env: dict[Any, _Tag] = dict(zip(jaxpr.invars, in_tags, strict=True))
    read = lambda v: _Tag() if isinstance(v, core.Literal) else env.get(v, _Tag())
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars], named)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _merge(tags: list[_Tag]) -> _Tag:
    keys = {(t.eaxis, t.span) for t in tags}
    eaxis, span = keys.pop() if len(keys) == 1 else (None, (1, 1))
    return _Tag(eaxis, any(t.mixed for t in tags), span if eaxis is not None else (1, 1))


def _eqn(eqn, ins: list[_Tag], named: frozenset[str]) -> list[_Tag]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in nested.CALLS:
        return _walk(nested.call_body(eqn).jaxpr, ins, named)
    if name in ("scan", "while"):
        return _loop(eqn, ins, named)
    if name == "cond":
        branches = [_walk(b.jaxpr, ins[1:], named) for b in nested.cond_branches(eqn)]
        return [_merge(list(outs)) for outs in zip(*branches, strict=True)]
    if name == "shard_map":
        return _shard_map(eqn, ins, named)
    if name.startswith(_COLLECTIVES):
        return _collective(eqn, ins, named)
    mixed = any(t.mixed for t in ins)
    keys = {(t.eaxis, t.span) for t in ins if t.eaxis is not None}
    if not keys:
        return [_Tag(None, mixed)] * n_out
    if _reduces_examples(eqn, ins):
        return [_Tag(None, True)] * n_out
    e, span = min(keys)  # several only for a `dot_general` (two operands' axes)
    if (len(keys) != 1 and name != "dot_general") or len({k[1] for k in keys}) != 1:
        out = None
    elif name == "reshape":
        out, span = _reshape(eqn, e, span)
    else:
        size = _shape(next(v for v, t in zip(eqn.invars, ins, strict=True)
                           if t.eaxis is not None))[e]
        out = ghost_trace.axis_rule(eqn, ins, e, size)
    if out is None:  # an operation whose axis rule is unknown: the axis is lost, not mixed
        return [_Tag(None, False)] * n_out
    if mixed and any(a is not None for a in out):
        raise _Coupled(f"`{name}` at {_where(eqn)}")
    return [_Tag(a, False, span if a is not None else (1, 1)) for a in out]


def _reduces_examples(eqn, ins) -> bool:
    name, params = eqn.primitive.name, eqn.params
    e = next(t.eaxis for t in ins if t.eaxis is not None)
    if name in ghost_trace._REDUCE:
        return e in params["axes"]
    if name in _ALONG_AXIS:
        return params.get("axis", params.get("dimension")) == e
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = ins[0].eaxis, ins[1].eaxis
        if (lhs is not None and lhs in lc) or (rhs is not None and rhs in rc):
            return True
        return (lhs is not None and rhs is not None
                and not (lhs in lb and rhs in rb and lb.index(lhs) == rb.index(rhs)))
    return False


def _collective(eqn, ins: list[_Tag], named: frozenset[str]) -> list[_Tag]:
    """Mixed when over an axis holding the examples: a positional axis (`psum` batched by
    `jax.vmap`) or a mesh axis the examples are split on."""
    n_out, mixed = len(eqn.outvars), any(t.mixed for t in ins)
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = tuple(axes) if isinstance(axes, (tuple, list, frozenset, set)) else (axes,)
    ints = [int(a) for a in axes if not isinstance(a, str) and hasattr(a, "__index__")]
    carried = any(t.eaxis is not None or t.mixed for t in ins)
    if carried and (any(t.eaxis in ints for t in ins) or named & set(axes)):
        return [_Tag(None, True)] * n_out
    kept = [tuple(d for i, d in enumerate(_shape(v)) if i not in ints) for v in eqn.invars]
    if kept != [_shape(v) for v in eqn.outvars]:  # a gather or scatter over other axes: where
        return [_Tag(None, mixed)] * n_out  # its outputs hold the examples is not followed
    return [_Tag(None, t.mixed) if t.eaxis is None else
            _Tag(t.eaxis - sum(a < t.eaxis for a in ints), t.mixed, t.span) for t in ins]


def _reshape(eqn, e: int, span: tuple[int, int]) -> tuple[list[int | None] | None, tuple]:
    """The output axis that holds the examples after a row-major reshape, and its span: the
    example index is (flat // trail) % B, a function of output axis a alone when a's stride
    divides `trail` and its stride times its size is a multiple of trail·B."""
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if eqn.params.get("dimensions") is not None or not math.prod(old):
        return None, span
    outer, inner = span
    size = old[e] // (outer * inner)
    trail = inner * math.prod(old[e + 1:])
    for a in range(len(new)):
        stride = math.prod(new[a + 1:])
        if trail % stride == 0 and (stride * new[a]) % (trail * size) == 0:
            return [a], ((stride * new[a]) // (trail * size), trail // stride)
    return None, span


def _shard_map(eqn, ins: list[_Tag], named: frozenset[str]) -> list[_Tag]:
    """The body on each device's shard: an operand's example axis stays where it is, and the
    mesh axes its spec splits it on hold examples (a collective over them mixes them)."""
    specs = eqn.params.get("in_specs", eqn.params.get("in_names"))
    out_specs = eqn.params.get("out_specs", eqn.params.get("out_names"))
    if specs is None or out_specs is None:
        return [_Tag(None, any(t.mixed for t in ins))] * len(eqn.outvars)
    body_tags, inner_named = [], set(named)
    for t, spec in zip(ins, specs, strict=True):
        names = _spec_names(spec, t.eaxis) if t.eaxis is not None else ()
        inner_named |= set(names)
        split_merged = names and t.span != (1, 1)
        body_tags.append(_Tag(None, t.mixed) if split_merged else t)
    outs = _walk(nested.call_body(eqn).jaxpr, body_tags, frozenset(inner_named))
    example_names = inner_named - named
    return [t if t.eaxis is None or set(_spec_names(spec, t.eaxis)) == example_names
            else _Tag(None, t.mixed) for t, spec in zip(outs, out_specs, strict=True)]


def _spec_names(spec: Any, dim: int) -> tuple[str, ...]:
    """The mesh axes a `shard_map` spec (a PartitionSpec or an `in_names` dict) splits `dim` on."""
    try:
        entry = spec.get(dim) if isinstance(spec, dict) else tuple(spec)[dim]
    except (IndexError, TypeError):
        return ()
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _loop(eqn, ins: list[_Tag], named: frozenset[str]) -> list[_Tag]:
    """`scan` and `while`: the carry's tags to a fixed point (three rounds, then lost)."""
    if eqn.primitive.name == "scan":
        scan = nested.scan_parts(eqn)
        n_c, n_carry, body = scan.n_consts, scan.n_carry, scan.body.jaxpr
        xs = [_Tag(t.eaxis - 1, t.mixed, t.span) if t.eaxis else
              _Tag(None, t.mixed or t.eaxis == 0) for t in ins[n_c + n_carry:]]
        consts, carry = ins[:n_c], ins[n_c:n_c + n_carry]
    else:
        loop = nested.while_parts(eqn)
        skip, n_c, body = loop.cond_nconsts, loop.body_nconsts, loop.body.jaxpr
        consts, carry, xs = ins[skip:skip + n_c], ins[skip + n_c:], []
        n_carry = len(carry)
    for _ in range(3):
        outs = _walk(body, consts + carry + xs, named)
        new = [_merge([a, b]) for a, b in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            break
        carry = new
    else:
        carry = [_Tag(None, t.mixed) for t in carry]
        outs = _walk(body, consts + carry + xs, named)
    ys = [_Tag(None if t.eaxis is None else t.eaxis + 1, t.mixed, t.span) for t in outs[n_carry:]]
    return carry + ys


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util  # the only way to name a jaxpr equation's line
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a location is a courtesy; the refusal stands without it
        return "an unknown line"


def loss_coupling(fn: Any, *args: Any, batch_argnum: int = 1) -> str | None:
    """`coupling_site` of `fn(*args)` traced on shapes, args[batch_argnum] holding the batch;
    None also when fn cannot be traced."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                           jax.numpy.result_type(x)), args)
    try:
        closed = jax.make_jaxpr(fn)(*abstract)
    except Exception:  # noqa: BLE001 - the computation reports its own errors
        return None
    start = sum(len(jax.tree.leaves(a)) for a in args[:batch_argnum])
    return coupling_site(closed.jaxpr, range(start, start + len(jax.tree.leaves(
        args[batch_argnum]))))
