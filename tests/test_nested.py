"""cbs.stats.nested: the nested primitives read alike whatever the release names.

The split of a `scan` (consts, carry, xs) and of a `while` (cond consts, body consts, carry)
derived from the avals equals the one JAX <= 0.10 names in its parameters, on every scan and
loop shape; and the walkers (ghost discovery and evaluation, the coupling check) give the same
answers when a scan names no split, as on JAX >= 0.11 (`ft_in`/`ft_out`). The same walkers run
on the newest releases in tests/test_newest.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ghost import built, jitted_info, scanned_lm

from cbs.stats import coupling, ghost, nested


def _eqns(jaxpr, name):
    """Every equation called `name` in `jaxpr` and the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for inner in nested.sub_jaxprs(eqn):
            yield from _eqns(inner, name)


def _scan_cases():
    x = jnp.ones((5, 3))

    def consts_carry_xs(c, xs, w):
        return jax.lax.scan(lambda h, r: (h * w + r.sum(), r * 2), c, xs)

    def no_xs(c):
        return jax.lax.scan(lambda h, _: (h + 1.0, h), c, None, length=4)

    def no_ys(c, xs):
        return jax.lax.scan(lambda h, r: (h + r, None), c, xs, reverse=True)

    def no_carry(xs, w):
        return jax.lax.scan(lambda _, r: (None, jnp.tanh(r @ w)), None, xs)

    def nested_scan(c, xs):
        inner = lambda h, r: jax.lax.scan(lambda g, s: (g + s, g * s), h, r)
        return jax.lax.scan(inner, c, xs[None].repeat(2, 0))

    def matrix_carry(xs):  # carry of rank 2, xs of rank 2: the ranks differ from the body's
        return jax.lax.scan(lambda h, r: (h + r[:, None], h.sum()), jnp.zeros((3, 3)), xs)

    return {
        "consts_carry_xs": (consts_carry_xs, (1.0, x, 2.0)),
        "no_xs": (no_xs, (jnp.ones(3),)),
        "no_ys": (no_ys, (jnp.zeros(3), x)),
        "no_carry": (no_carry, (x, jnp.ones((3, 3)))),
        "nested": (nested_scan, (jnp.zeros(3), x)),
        "matrix_carry": (matrix_carry, (x,)),
        "lm": (lambda p, b: scanned_lm()[0](p, b), scanned_lm()[1:]),
    }


@pytest.mark.parametrize("case", sorted(_scan_cases()))
def test_scan_split_from_avals_equals_the_named_split(case):
    fn, args = _scan_cases()[case]
    scans = list(_eqns(jax.make_jaxpr(fn)(*args).jaxpr, "scan"))
    assert scans, "the case has a scan"
    for eqn in scans:
        if "num_consts" not in eqn.params:
            pytest.skip("this JAX names no split (>= 0.11): tests/test_newest.py covers it")
        named = (eqn.params["num_consts"], eqn.params["num_carry"])
        assert nested._scan_split_from_avals(eqn, nested.body_of(eqn.params["jaxpr"]).jaxpr) \
            == named
        assert (nested.scan_parts(eqn).n_consts, nested.scan_parts(eqn).n_carry) == named


def test_scan_without_named_split_reads_the_avals():
    fn, args = _scan_cases()["consts_carry_xs"]
    eqn = next(_eqns(jax.make_jaxpr(fn)(*args).jaxpr, "scan"))
    params = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry")}
    parts = nested.scan_parts(eqn.replace(params={**params, "ft_in": None, "ft_out": None}))
    assert (parts.n_consts, parts.n_carry, parts.length) == (1, 1, 5)


def test_while_split_from_the_jaxprs_equals_the_named_split():
    def loop(x, lim, step):
        return jax.lax.while_loop(lambda c: c[0] < lim, lambda c: (c[0] + step, c[1] * x),
                                  (0.0, jnp.ones(3)))

    eqn = next(_eqns(jax.make_jaxpr(loop)(jnp.ones(3), 3.0, 1.0).jaxpr, "while"))
    parts = nested.while_parts(eqn)
    assert (parts.cond_nconsts, parts.body_nconsts) == (eqn.params["cond_nconsts"],
                                                        eqn.params["body_nconsts"]) == (1, 2)


class _OneObjectJaxpr:
    """A closed jaxpr as JAX >= 0.11 has it: the jaxpr itself, holding its consts."""

    def __init__(self, closed):
        self._closed = closed
        self.consts = closed.consts

    def __getattr__(self, name):
        return getattr(self._closed.jaxpr, name)

    @property
    def jaxpr(self):
        return self


def test_body_of_reads_both_closed_forms():
    closed = jax.make_jaxpr(lambda x: x * jnp.arange(3.0))(jnp.ones(3))
    old, new = nested.body_of(closed), nested.body_of(_OneObjectJaxpr(closed))
    assert old.jaxpr is closed.jaxpr and len(old.consts) == len(closed.consts)
    assert new.consts == tuple(closed.consts) and new.jaxpr.eqns == closed.jaxpr.eqns
    assert nested.body_of(closed.jaxpr).consts == ()


def test_remat_options_take_per_operand_prevent_cse():
    eqn = next(_eqns(jax.make_jaxpr(jax.checkpoint(jnp.sin, prevent_cse=False))(1.0).jaxpr,
                     "remat2"))
    assert nested.remat_options(eqn) == {"prevent_cse": False, "policy": None}
    per_operand = eqn.replace(params={**eqn.params, "prevent_cse": (False, True)})
    assert nested.remat_options(per_operand)["prevent_cse"] is True


def test_call_body_names_what_it_found():
    eqn = next(_eqns(jax.make_jaxpr(jnp.sin)(1.0).jaxpr, "sin"))
    with pytest.raises(ValueError, match="holds no jaxpr"):
        nested.call_body(eqn)


@pytest.fixture
def avals_only(monkeypatch):
    """Every scan read as on JAX >= 0.11: the split from the avals, not from the params."""
    real = nested.scan_parts

    def from_avals(eqn):
        parts = real(eqn)
        n_consts, n_carry = nested._scan_split_from_avals(eqn, parts.body.jaxpr)
        return dataclasses.replace(parts, n_consts=n_consts, n_carry=n_carry)

    monkeypatch.setattr(nested, "scan_parts", from_avals)


@pytest.mark.parametrize("name", ["scanned_lm", "tied_lm"])
def test_ghost_norms_on_a_scanned_lm_with_the_split_from_avals(name, avals_only):
    loss_fn, params, batch = built(name, x64=False)
    assert ghost.coverage(loss_fn, params, batch) == 1.0
    fast = jitted_info(loss_fn, "fast")(params, batch)
    ref = jitted_info(loss_fn, "vmap")(params, batch)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))


def test_coupling_inside_a_scan_found_with_the_split_from_avals(avals_only):
    def loss(w, x_BxD):
        def layer(h, w_l):
            h = h @ w_l
            return h - h.mean(axis=0), None  # a batch mean inside the scanned body

        return jax.lax.scan(layer, x_BxD, w)[0].sum(axis=1).mean()

    site = coupling.loss_coupling(loss, jnp.ones((2, 3, 3)), jnp.ones((4, 3)))
    assert site is not None and "sub" in site
    fine = lambda w, x: jax.lax.scan(lambda h, w_l: (jnp.tanh(h @ w_l), None), x, w)[0].mean()
    assert coupling.loss_coupling(fine, jnp.ones((2, 3, 3)), jnp.ones((4, 3))) is None
