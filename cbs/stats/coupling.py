"""A structural test for examples coupled through a batch statistic, read from the jaxpr.

Per-example gradients need ℓ_i to depend on example i alone. A layer such as BatchNorm in
training mode breaks that: it reduces over the example axis (a batch mean or variance) and
combines the result with every example. Whether it does is a property of the program, not of
the numbers in it, so it is read from one shape-only trace of `loss_fn(params, batch)` and
holds whatever the parameters are (a value test on two examples can miss a coupling that the
parameters make small).

Every jaxpr variable gets two tags, propagated forward from the batch inputs (example axis 0):

- its *example axis*, mapped through each operation whose axis rule is known (the rules of
  `cbs.stats.ghost_trace`: elementwise ops, layout ops, `dot_general`, convolutions, gathers,
  reductions over other axes), and lost (no tag) through any other operation;
- *mixed*: the value is a statistic over several examples, formed by a known operation that
  reduces or contracts the example axis (`reduce_sum`, `reduce_max`, ..., `argmax`,
  cumulative ops along it, a `dot_general` contracting it or pairing the examples of two
  operands), and kept by everything computed from it.

A known operation whose output keeps an example axis while one of its operands is mixed is a
coupling: `x − mean(x, axis=0)`, `x / std(x, axis=0)`. The mean loss itself is a mixed value
that nothing per-example reads, and so is a token-weighted mean `Σ mask·ℓ / Σ mask`. A value
whose example axis was lost through an unknown operation is never reported (no false refusal);
the value test of `cbs.stats.loss_checks` still runs on it.

Nested `jit`, `remat`, `custom_jvp`/`custom_vjp`, `scan`, `while` and `cond` bodies are walked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core

from cbs.stats import ghost_trace, nested

__all__ = ["coupling_site"]

_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                     "reduce_or", "reduce_xor", "argmax", "argmin"})
_ALONG_AXIS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"})


@dataclasses.dataclass(frozen=True)
class _Tag:
    eaxis: int | None = None  # position of the example axis
    mixed: bool = False  # a statistic over several examples


class _Coupled(Exception):
    pass


def coupling_site(jaxpr: Any, batch_invars: range) -> str | None:
    """Where `jaxpr` (an open jaxpr) combines a statistic over the examples with per-example
    values ("`sub` at file:line"), or None. `batch_invars`: the indices of the inputs whose
    leading axis is the example axis."""
    tags = [_Tag(0 if i in batch_invars and _shape(v) else None)
            for i, v in enumerate(jaxpr.invars)]
    try:
        _walk(jaxpr, tags)
    except _Coupled as found:
        return str(found)
    return None


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _walk(jaxpr, in_tags: list[_Tag]) -> list[_Tag]:
    env: dict[Any, _Tag] = dict(zip(jaxpr.invars, in_tags, strict=True))
    read = lambda v: _Tag() if isinstance(v, core.Literal) else env.get(v, _Tag())
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _merge(tags: list[_Tag]) -> _Tag:
    axes = {t.eaxis for t in tags}
    return _Tag(axes.pop() if len(axes) == 1 else None, any(t.mixed for t in tags))


def _eqn(eqn, ins: list[_Tag]) -> list[_Tag]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in nested.CALLS:
        return _walk(nested.call_body(eqn).jaxpr, ins)
    if name in ("scan", "while"):
        return _loop(eqn, ins)
    if name == "cond":
        branches = [_walk(b.jaxpr, ins[1:]) for b in nested.cond_branches(eqn)]
        return [_merge(list(outs)) for outs in zip(*branches, strict=True)]
    mixed = any(t.mixed for t in ins)
    axes = {t.eaxis for t in ins if t.eaxis is not None}
    if not axes:
        return [_Tag(None, mixed)] * n_out
    if _reduces_examples(eqn, ins):
        return [_Tag(None, True)] * n_out
    out = _out_axes(eqn, ins, min(axes)) if len(axes) == 1 or name == "dot_general" else None
    if out is None:  # an operation whose axis rule is unknown: the axis is lost, not mixed
        return [_Tag(None, False)] * n_out
    if mixed and any(a is not None for a in out):
        raise _Coupled(f"`{name}` at {_where(eqn)}")
    return [_Tag(a, False) for a in out]


def _reduces_examples(eqn, ins) -> bool:
    """Whether a known operation reduces, accumulates or contracts the example axis, or pairs
    the examples of two operands (`z @ z.T`)."""
    name, params = eqn.primitive.name, eqn.params
    e = next(t.eaxis for t in ins if t.eaxis is not None)
    if name in _REDUCE:
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


def _out_axes(eqn, ins, e) -> list[int | None] | None:
    """The example axis of each output under the axis rules of `cbs.stats.ghost_trace`."""
    name = eqn.primitive.name
    shapes = [_shape(v) for v in eqn.outvars]
    size = _shape(next(v for v, t in zip(eqn.invars, ins, strict=True)
                       if t.eaxis is not None))[e]
    if name == "broadcast_in_dim":
        out: Any = eqn.params["broadcast_dimensions"][e]
    elif name in ghost_trace._ELEMENTWISE:
        out = e
    else:
        rule = ghost_trace._AXIS_RULES.get(name)
        out = None if rule is None else rule(eqn, ins, e)
    if out is None:
        return None
    out = out if isinstance(out, list) else [out] * len(shapes)
    return [a if a is not None and s[a:a + 1] == (size,) else None
            for a, s in zip(out, shapes, strict=True)]


def _loop(eqn, ins: list[_Tag]) -> list[_Tag]:
    """`scan` (consts, carry, xs sliced on axis 0) and `while` (cond consts, body consts,
    carry): the carry's tags to a fixed point (three rounds, then lost)."""
    if eqn.primitive.name == "scan":
        scan = nested.scan_parts(eqn)
        n_c, n_carry, body = scan.n_consts, scan.n_carry, scan.body.jaxpr
        xs = [_Tag(t.eaxis - 1 if t.eaxis else None, t.mixed or t.eaxis == 0)
              for t in ins[n_c + n_carry:]]
        consts, carry = ins[:n_c], ins[n_c:n_c + n_carry]
    else:
        loop = nested.while_parts(eqn)
        skip, n_c, body = loop.cond_nconsts, loop.body_nconsts, loop.body.jaxpr
        consts, carry, xs = ins[skip:skip + n_c], ins[skip + n_c:], []
        n_carry = len(carry)
    for _ in range(3):
        outs = _walk(body, consts + carry + xs)
        new = [_merge([a, b]) for a, b in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            break
        carry = new
    else:
        carry = [_Tag(None, t.mixed) for t in carry]
        outs = _walk(body, consts + carry + xs)
    ys = [_Tag(None if t.eaxis is None else t.eaxis + 1, t.mixed) for t in outs[n_carry:]]
    return carry + ys


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util  # the only way to name a jaxpr equation's line
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a location is a courtesy; the refusal stands without it
        return "an unknown line"


def loss_coupling(fn: Any, *args: Any, batch_argnum: int = 1) -> str | None:
    """`coupling_site` of `fn(*args)` traced on shapes only, args[batch_argnum] holding the
    batch (its leaves' leading axis is the example axis); None also when fn cannot be traced."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x),
                                                           jax.numpy.result_type(x)), args)
    try:
        closed = jax.make_jaxpr(fn)(*abstract)
    except Exception:  # noqa: BLE001 - the computation reports its own errors
        return None
    start = sum(len(jax.tree.leaves(a)) for a in args[:batch_argnum])
    return coupling_site(closed.jaxpr, range(start, start + len(jax.tree.leaves(
        args[batch_argnum]))))
