"""The higher-order primitives that cbs's jaxpr walkers (`ghost_trace`, `ghost`, `coupling`,
`loss_checks`) enter, read the same way on every JAX release from 0.9.2 on: a body (an open jaxpr
and its constants) and how the equation's operands and results map onto the body's. JAX moves
these between releases (`scan`'s `num_consts`/`num_carry` became `ft_in`/`ft_out` in 0.11, the
closed jaxpr stopped being a wrapper, `pjit` became `jit`, `remat`'s `prevent_cse` became per
operand), so each split is derived from the jaxpr's own avals where the parameters do not name it:

- scan: operands `consts + carry + xs`, results `carry + ys`; the split is the first operand
  (result) whose rank differs from its body input (output).
- while: operands `cond_consts + body_consts + carry`; the carry is as long as the body's
  outputs, and each jaxpr's consts are its inputs before it.
- cond: operands `index + ops`, every branch a jaxpr over `ops`.
- calls (`jit`, `pjit`, `closed_call`, `core_call`, `remat`, `custom_jvp_call`,
  `custom_vjp_call`, `shard_map`): one body over all operands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CALLS", "Scan", "body_of", "call_body", "cond_branches", "remat_options", "scan_parts",
    "sub_jaxprs", "while_parts",
]

# Primitives that run one body on their operands as they are (a call); shard_map runs it on
# each device's shard, so only a walker that follows axes through shapes enters it.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                   "custom_jvp_call", "custom_vjp_call"})
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True)
class Body:
    """An open jaxpr (`eqns`, `constvars`, `invars`, `outvars`) and its constants' values."""

    jaxpr: Any
    consts: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Scan:
    """A `scan` equation read: operands consts, carry, xs; results carry, ys."""

    body: Body
    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: int | bool


@dataclasses.dataclass(frozen=True)
class While:
    """A `while` equation read: operands `cond_consts + body_consts + carry`."""

    body: Body
    cond_nconsts: int
    body_nconsts: int


def body_of(value: Any) -> Body:
    """A closed jaxpr (a wrapper up to JAX 0.10, with consts from 0.11) or open jaxpr."""
    jaxpr = getattr(value, "jaxpr", value)
    return Body(jaxpr, tuple(getattr(value, "consts", ()) or ()))


def call_body(eqn: Any) -> Body:
    """The body of a call-like equation (CALLS, shard_map) over its operands."""
    for name in _BODY_PARAMS:
        if name in eqn.params:
            return body_of(eqn.params[name])
    raise ValueError(f"`{eqn.primitive.name}` holds no jaxpr among {_BODY_PARAMS}: "
                     f"{sorted(eqn.params)}")


def scan_parts(eqn: Any) -> Scan:
    p = eqn.params
    body = body_of(p["jaxpr"])
    if "num_consts" in p and "num_carry" in p:  # JAX <= 0.10
        n_consts, n_carry = int(p["num_consts"]), int(p["num_carry"])
    else:
        n_consts, n_carry = _scan_split_from_avals(eqn, body.jaxpr)
    return Scan(body, n_consts, n_carry, int(p["length"]), bool(p.get("reverse", False)),
                p.get("unroll", 1))


def _first_rank_change(outer: list, inner: list) -> int:
    """Index of the first outer variable whose rank differs from its inner one, or len(inner)."""
    for i, (o, b) in enumerate(zip(outer, inner, strict=True)):
        if len(getattr(o.aval, "shape", ())) != len(getattr(b.aval, "shape", ())):
            return i
    return len(inner)


def _scan_split_from_avals(eqn: Any, jaxpr: Any) -> tuple[int, int]:
    n_carry = _first_rank_change(list(eqn.outvars), list(jaxpr.outvars))
    xs_start = _first_rank_change(list(eqn.invars), list(jaxpr.invars))
    n_consts = xs_start - n_carry
    if n_consts < 0:
        raise ValueError(f"scan at {eqn.source_info}: {n_carry} carried values but the scanned "
                         f"operands start at {xs_start}")
    return n_consts, n_carry


def while_parts(eqn: Any) -> While:
    cond, body = body_of(eqn.params["cond_jaxpr"]), body_of(eqn.params["body_jaxpr"])
    n_carry = len(body.jaxpr.outvars)
    return While(body, len(cond.jaxpr.invars) - n_carry, len(body.jaxpr.invars) - n_carry)


def cond_branches(eqn: Any) -> list[Body]:
    return [body_of(b) for b in eqn.params["branches"]]


def remat_options(eqn: Any) -> dict[str, Any]:
    """`jax.checkpoint` keywords that rebuild a `remat` equation (prevent_cse per operand from
    JAX 0.11: kept when any operand keeps it)."""
    pcse = eqn.params.get("prevent_cse", True)
    if isinstance(pcse, (tuple, list)):
        pcse = any(pcse)
    return {"prevent_cse": bool(pcse), "policy": eqn.params.get("policy")}


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """Every open jaxpr among an equation's parameters (any primitive, any release)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner
