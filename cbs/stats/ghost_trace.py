"""Discovery for the ghost-norm pass: which jaxpr operations consume each parameter leaf. A
forward walk over one shape-only trace of `loss_fn(params, batch)` (inputs: the params leaves,
then the batch leaves) gives every variable two tags:

- a *parameter tag* when it is a params leaf seen through layout-only operations (reshape,
  transpose, convert_element_type, squeeze, sharding changes keep the norm; broadcast and
  static slices do not), or one step's slice of a leaf stacked under `scan`;
- an *example axis* when one of its axes is the batch's example axis (0 on the batch
  inputs), mapped by each known operation or dropped where it reduces or mixes that axis. A
  value combining it with a batch-dependent operand that has lost the axis (a batch mean:
  BatchNorm) loses it too, so coupled examples are not read.

An operation reading a tagged parameter is a *use* when it is linear in it and its other
operand and output carry the example axis: `dot_general`, `conv_general_dilated`, `gather`
from the table, and elementwise `mul`/`add`/`sub` (norm scales and shifts, biases). The walk
enters nested `jit`, `remat`, custom-rule and `scan` bodies (a leaf scanned over as `xs`
gives one use per step). Any other read (a weight-decay term, an op not listed, a carry, a
scan's closed-over constant) makes the leaf uncovered, with the reason. B: the batch size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.extend import core

from cbs.stats import nested

__all__ = ["ELEMENTWISE_USES", "Discovery", "Use", "axis_rule", "discover"]

# Norm-preserving layout ops (their per-example transpose keeps |g|²) and linear ones that
# do not (broadcast sums, slices pad with zeros): the latter force the materialised rule.
_NORM_KEEPING = frozenset({"reshape", "transpose", "convert_element_type", "squeeze",
                          "expand_dims", "copy", "copy_p", "reduce_precision",
                          "sharding_constraint", "reshard", "mesh_cast", "pvary"})
_LINEAR_LAYOUT = frozenset({"broadcast_in_dim", "slice", "rev"})
ELEMENTWISE_USES = frozenset({"mul", "add", "sub", "add_any"})
_ELEMENTWISE = frozenset("""abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil
clamp conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt
square stop_gradient sub tan tanh xor sharding_constraint reshard mesh_cast pvary
optimization_barrier""".split())
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                     "reduce_or", "reduce_xor", "argmax", "argmin"})
_AXIS_OPS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


@dataclasses.dataclass(frozen=True)
class _PTag:
    """A value derived from params leaf `leaf` through `chain` (layout eqns, in order)."""

    leaf: int
    ctx: tuple[int, ...]  # id() of the enclosing scan eqns that slice the leaf, outermost first
    chain: tuple[Any, ...]
    keeps_norm: bool
    shared: str = ""  # non-empty: every read is uncovered for this reason (scan consts)


@dataclasses.dataclass(frozen=True)
class Use:
    """An operation linear in one params leaf, with the example axis on its other operand."""

    uid: int
    eqn: Any
    leaf: int
    ctx: tuple[int, ...]
    stack: tuple[int, ...]  # lengths of the enclosing scans (the captures' leading axes)
    pos: int  # operand index of the parameter
    chain: tuple[Any, ...]
    keeps_norm: bool
    e_in: int  # example axis of the other operand
    e_out: int  # example axis of the output

    @property
    def origin(self) -> Any:
        """The aval of the leaf (or of one scan step's slice of it)."""
        return (self.chain[0].invars[0] if self.chain else self.eqn.invars[self.pos]).aval


@dataclasses.dataclass
class _Var:
    ptag: _PTag | None = None
    eaxis: int | None = None
    dep: bool = False  # depends on the batch


@dataclasses.dataclass
class Discovery:
    """Every read of every leaf: a use, or why it cannot be one."""

    batch_size: int
    reads: dict[tuple[int, int], Use | str] = dataclasses.field(default_factory=dict)
    uids: dict[int, int] = dataclasses.field(default_factory=dict)  # use eqn id -> uid
    inner_uses: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # eqn -> uids


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def discover(jaxpr, n_params: int, batch_size: int) -> Discovery:
    disc = Discovery(batch_size)
    tags = [_Var(ptag=_PTag(i, (), (), True)) if i < n_params else
            _Var(eaxis=0 if _shape(v) else None, dep=True) for i, v in enumerate(jaxpr.invars)]
    _walk(jaxpr, tags, disc, (), (), [])
    return disc


def _walk(jaxpr, in_tags, disc, ctx, stack, scans) -> list[_Var]:
    env: dict[Any, _Var] = dict(zip(jaxpr.invars, in_tags, strict=True))  # consts: untagged
    read = lambda v: _Var() if isinstance(v, core.Literal) else env.get(v, _Var())
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars], disc, ctx, stack, scans)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _reject(disc, eqn, ins, why):
    for t in ins:
        if t.ptag is not None:
            disc.reads[id(eqn), t.ptag.leaf] = t.ptag.shared or why


def _eqn(eqn, ins, disc, ctx, stack, scans) -> list[_Var]:
    name = eqn.primitive.name
    ptagged = [i for i, t in enumerate(ins) if t.ptag is not None]
    if name == "scan":
        return _scan(eqn, ins, disc, ctx, stack, scans)
    if name in nested.CALLS:
        outs = _walk(nested.call_body(eqn).jaxpr, ins, disc, ctx, stack, scans + [id(eqn)])
        if name.startswith("custom"):  # their outputs follow a custom rule: not a layout chain
            outs = [_passed(t, ctx, f"returned by `{name}`") for t in outs]
        return outs
    if ptagged and len(ins) == 1 and (name in _NORM_KEEPING or name in _LINEAR_LAYOUT):
        p = ins[0].ptag
        # a `broadcast_in_dim` that only inserts size-1 axes (a bias [O] as [1, 1, O]) keeps it
        keeps = p.keeps_norm and (name in _NORM_KEEPING or (
            name == "broadcast_in_dim"
            and np.prod(eqn.outvars[0].aval.shape) == np.prod(eqn.invars[0].aval.shape)))
        return [_Var(ptag=dataclasses.replace(p, chain=p.chain + (eqn,), keeps_norm=keeps))]
    eaxis = _example_axis(eqn, ins, disc.batch_size)
    if ptagged:
        _record_use(eqn, ins, ptagged, eaxis, disc, ctx, stack, scans)
    dep = any(t.dep for t in ins)
    return [_Var(eaxis=eaxis[k] if eaxis else None, dep=dep) for k in range(len(eqn.outvars))]


def _record_use(eqn, ins, ptagged, eaxis, disc, ctx, stack, scans):
    name = eqn.primitive.name
    others = [i for i in range(len(ins)) if i not in ptagged]
    kinds = ("dot_general", "conv_general_dilated", "gather") + tuple(ELEMENTWISE_USES)
    if name not in kinds:
        return _reject(disc, eqn, ins, f"read by `{name}`, which the ghost rules do not cover")
    if len(ptagged) != 1 or len(others) != 1 or (name == "gather" and ptagged != [0]):
        return _reject(disc, eqn, ins, f"`{name}` reads it with another parameter, not data")
    p, other = ins[ptagged[0]].ptag, ins[others[0]]
    if p.shared:
        return _reject(disc, eqn, ins, p.shared)
    if other.eaxis is None or not eaxis or eaxis[0] is None:
        return _reject(disc, eqn, ins, f"`{name}` reads it with an operand that has no "
                                       "example axis (the batch's leading axis)")
    if p.ctx != ctx:
        return _reject(disc, eqn, ins, "read inside a scan it is not scanned over")
    if name == "dot_general" and eqn.params["dimension_numbers"][1][ptagged[0]]:
        return _reject(disc, eqn, ins, "`dot_general` with batch dimensions on the parameter")
    uid = disc.uids.setdefault(id(eqn), len(disc.uids))
    for s in [-1, *scans]:
        disc.inner_uses.setdefault(s, set()).add(uid)
    disc.reads[id(eqn), p.leaf] = Use(uid, eqn, p.leaf, ctx, stack, ptagged[0], p.chain,
                                      p.keeps_norm, other.eaxis, eaxis[0])


def _passed(t: _Var, ctx, why: str) -> _Var:
    """A leaf leaving a scan or custom rule: harmless unless something reads it."""
    if t.ptag is None:
        return t
    return dataclasses.replace(t, ptag=_PTag(t.ptag.leaf, ctx, (), False, shared=why))


def _scan(eqn, ins, disc, ctx, stack, scans) -> list[_Var]:
    scan = nested.scan_parts(eqn)
    body, n_c, n_carry = scan.body.jaxpr, scan.n_consts, scan.n_carry
    sid = id(eqn)
    inner_ctx, inner_stack = ctx + (sid,), stack + (scan.length,)
    consts, carry, xs = ins[:n_c], ins[n_c:n_c + n_carry], ins[n_c + n_carry:]
    consts = [dataclasses.replace(t, ptag=dataclasses.replace(
        t.ptag, shared="closed over by a scan body, so shared by every step"))
        if t.ptag else t for t in consts]
    carry = [_passed(t, inner_ctx, "carried through a scan") for t in carry]
    xs_in = []
    for t in xs:
        ptag = None
        if t.ptag is not None:
            if t.ptag.ctx != ctx or not t.ptag.keeps_norm or t.ptag.shared:
                disc.reads[sid, t.ptag.leaf] = (t.ptag.shared or "scanned over after an op "
                                                "that changes its norm")
            else:
                ptag = _PTag(t.ptag.leaf, inner_ctx, (), True)
        xs_in.append(_Var(ptag=ptag, eaxis=t.eaxis - 1 if t.eaxis else None, dep=t.dep))
    for _ in range(3):  # fixed point on the carry's example axis
        outs = _walk(body, consts + carry + xs_in, disc, inner_ctx, inner_stack, scans + [sid])
        same = [a.eaxis == b.eaxis and a.dep == b.dep
                for a, b in zip(outs[:n_carry], carry, strict=True)]
        if all(same):
            break
        carry = [c if ok else dataclasses.replace(c, eaxis=None, dep=True)
                 for c, ok in zip(carry, same, strict=True)]
    why = "returned by a scan body"
    ys = [_passed(_Var(t.ptag, None if t.eaxis is None else t.eaxis + 1, t.dep), ctx, why)
          for t in outs[n_carry:]]
    return [_passed(_Var(c.ptag, c.eaxis, c.dep), ctx, why) for c in carry] + ys


def _example_axis(eqn, ins, batch_size) -> list[int | None] | None:
    """Per output, where the example axis goes (None: lost), or None when nothing has it."""
    name = eqn.primitive.name
    if any(t.dep and t.eaxis is not None for t in ins):
        # A batch-independent value's axis is a guess from its size (`_broadcast_axis`): it
        # yields to the data's (equinox's per-position LayerNorm with B equal to the width).
        ins = [dataclasses.replace(t, eaxis=None) if not t.dep else t for t in ins]
    axes = [t.eaxis for t in ins]
    if name == "broadcast_in_dim":
        return [_broadcast_axis(eqn, ins[0], batch_size)]
    if all(a is None for a in axes):
        return None
    if any(t.dep and t.eaxis is None for t in ins):
        return None  # mixes a batch statistic (BatchNorm-like) into every example
    tagged = {a for a in axes if a is not None}
    if len(tagged) != 1:
        return None
    out = axis_rule(eqn, ins, tagged.pop(), batch_size)
    return None if name in _ELEMENTWISE and out and None in out else out


def axis_rule(eqn, ins, e: int, size: int) -> list[int | None] | None:
    """Per output, where the operands' example axis `e` (of `size` entries) goes (None: lost);
    None without an axis rule."""
    rule = (lambda eqn, ins, e: e) if eqn.primitive.name in _ELEMENTWISE else _AXIS_RULES.get(
        eqn.primitive.name)
    out = None if rule is None else rule(eqn, ins, e)
    if out is None:
        return None
    out = out if isinstance(out, list) else [out] * len(eqn.outvars)
    return [a if a is not None and _shape(v)[a:a + 1] == (size,) else None
            for a, v in zip(out, eqn.outvars, strict=True)]


def _broadcast_axis(eqn, operand: _Var, batch_size: int) -> int | None:
    dims = eqn.params["broadcast_dimensions"]
    shape = _shape(eqn.outvars[0])
    if operand.eaxis is not None:
        return dims[operand.eaxis]
    if operand.dep or operand.ptag is not None:
        return None
    new = [a for a in range(len(shape)) if a not in dims and shape[a] == batch_size]
    return new[0] if len(new) == 1 else None  # batch-independent values copied per example


def _reshape(eqn, ins, e):
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if eqn.params.get("dimensions") is not None:
        return None
    before = int(np.prod(old[:e]))
    for a in range(len(new)):
        if int(np.prod(new[:a])) == before and new[a] == old[e]:
            return a
    return None


def _dot_general(eqn, ins, e):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nb, shapes = len(lb), [_shape(v) for v in eqn.invars]
    free = [[a for a in range(len(s)) if a not in c and a not in b]
            for s, c, b in zip(shapes, (lc, rc), (lb, rb), strict=True)]
    where = set()
    for side, (t, c, b) in enumerate(zip(ins, (lc, rc), (lb, rb), strict=True)):
        if t.eaxis is None:
            continue
        if t.eaxis in c:
            return None
        where.add(b.index(t.eaxis) if t.eaxis in b else
                  nb + len(free[0]) * side + free[side].index(t.eaxis))
    return where.pop() if len(where) == 1 else None


def _conv(eqn, ins, e):
    dn = eqn.params["dimension_numbers"]
    ok = ins[0].eaxis == dn.lhs_spec[0] and ins[1].eaxis is None
    return dn.out_spec[0] if ok and eqn.params["batch_group_count"] == 1 else None


def _gather(eqn, ins, e):
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims or ins[0].eaxis is not None:
        return None
    idx_rank = len(_shape(eqn.invars[1]))
    if e == idx_rank - 1:
        return None
    out_rank = len(_shape(eqn.outvars[0]))
    return [a for a in range(out_rank) if a not in dn.offset_dims][e]


def _drop(axes, e):
    return None if e in axes else e - sum(a < e for a in axes)


def _window(eqn, ins, e):
    p = eqn.params
    ok = (p["window_dimensions"][e] == 1 and p["window_strides"][e] == 1
          and tuple(p["padding"][e]) == (0, 0))
    return e if ok else None


def _fused_attention(eqn, ins, e):
    """cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`, layout
    [B, T, heads, width]): example i's outputs read example i's queries, keys and values only."""
    return 0 if e == 0 and all(t.eaxis in (None, 0) for t in ins) else None


_AXIS_RULES = {
    "broadcast_in_dim": lambda eqn, ins, e: eqn.params["broadcast_dimensions"][e],
    "reshape": _reshape,
    "dot_product_attention_fwd": _fused_attention,
    "dot_product_attention_fwd_wrapper": _fused_attention,
    "transpose": lambda eqn, ins, e: list(eqn.params["permutation"]).index(e),
    "squeeze": lambda eqn, ins, e: _drop(eqn.params["dimensions"], e),
    "expand_dims": lambda eqn, ins, e: e + sum(d <= e for d in eqn.params["dimensions"]),
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "concatenate": lambda eqn, ins, e: None if eqn.params["dimension"] == e else e,
    "pad": lambda eqn, ins, e: e if tuple(eqn.params["padding_config"][e]) == (0, 0, 0)
    else None,
    "slice": lambda eqn, ins, e: e if (eqn.params["start_indices"][e] == 0 and
                                       eqn.params["limit_indices"][e]
                                       == _shape(eqn.invars[0])[e]) else None,
    "rev": lambda eqn, ins, e: None if e in eqn.params["dimensions"] else e,
    "sort": lambda eqn, ins, e: None if eqn.params["dimension"] == e else e,
    "split": lambda eqn, ins, e: None if eqn.params["axis"] == e else e,
    # JAX >= 0.11: one output per index along `axis` (an unpacked fused projection)
    "unstack": lambda eqn, ins, e: _drop((eqn.params["axis"],), e),
    "reduce_window_sum": _window, "reduce_window_max": _window, "reduce_window_min": _window,
    "reduce_window": _window,
    **{n: (lambda eqn, ins, e: _drop(eqn.params["axes"], e)) for n in _REDUCE},
    **{n: (lambda eqn, ins, e: None if eqn.params["axis"] == e else e) for n in _AXIS_OPS},
}
