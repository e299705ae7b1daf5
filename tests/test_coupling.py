"""The refusal of losses that couple the examples of a batch (`cbs.stats.coupling`, with the
value check of `cbs.stats.loss_checks`), through the drop-in that users call, eagerly and
under jit: every way of coupling examples in the table is refused, every loss in the table of
per-example losses is measured."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from cbs import noise
from cbs.stats import coupling

B, T, C = 8, 3, 8
COUPLED = r"couples the examples of a batch"


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((B, T, C)).astype(np.float32),
            "y": rng.standard_normal(B).astype(np.float32),
            "mask": (rng.random((B, T)) > 0.3).astype(np.int32)}


def _weights():
    return {"w": jnp.asarray(np.random.default_rng(1).standard_normal((C, C)) / C ** 0.5,
                             dtype=jnp.float32)}


def _plain(per_example_out):
    """`mean((out(params, x) - y)²)`, out of shape [B], and its arguments."""
    return lambda p, b: jnp.mean((per_example_out(p, b["x"]) - b["y"]) ** 2), (_weights(),
                                                                                 _batch())


class _NnxNet(nnx.Module):
    def __init__(self, norm, rngs, merge_tokens=False):
        self.dense = nnx.Linear(C, C, rngs=rngs)
        self.norm = norm(C, rngs=rngs)
        self.merge_tokens = merge_tokens

    def __call__(self, x):  # x [B, T, C]
        h = self.dense(x)
        h = (self.norm(h.reshape(-1, C)).reshape(h.shape) if self.merge_tokens
             else self.norm(h[:, 0]))
        return jnp.tanh(h).sum(range(1, h.ndim))


def _nnx(norm, train=True, merge_tokens=False):
    model = _NnxNet(norm, nnx.Rngs(0), merge_tokens)
    model.train() if train else model.eval()
    return lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), (model, _batch())


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.BatchNorm(use_running_average=False)(nn.Dense(C)(x))).sum(-1)


def _linen():
    batch = _batch()
    variables = _LinenNet().init(jax.random.key(0), batch["x"][:, 0])

    def loss(params, b):
        out, _ = _LinenNet().apply({"params": params, **{k: v for k, v in variables.items()
                                                         if k != "params"}},
                                   b["x"][:, 0], mutable=["batch_stats"])
        return jnp.mean((out - b["y"]) ** 2)

    return loss, (variables["params"], batch)


class _EqxNet(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.dense = eqx.nn.Linear(C, C, key=key)
        self.norm = eqx.nn.BatchNorm(C, axis_name="batch", mode="ema")


def _equinox():
    """equinox's BatchNorm takes its statistic with `lax.pmean` over the vmapped axis name,
    which a vmap turns into a `psum` over the example axis."""
    model, state = eqx.nn.make_with_state(_EqxNet)(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, b):
        net = eqx.combine(p, static)

        def one(x, state):
            h, state = net.norm(net.dense(x[0]), state)
            return jnp.tanh(h).sum(), state

        out, _ = jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            b["x"], state)
        return jnp.mean((out - b["y"]) ** 2)

    return loss, (params, _batch())


def _haiku():
    hk = pytest.importorskip("haiku")

    def forward(x):
        h = hk.BatchNorm(True, True, 0.9)(hk.Linear(C)(x), is_training=True)
        return jnp.tanh(h).sum(-1)

    net = hk.without_apply_rng(hk.transform_with_state(forward))
    batch = _batch()
    params, state = net.init(jax.random.key(0), batch["x"][:, 0])
    loss = lambda p, b: jnp.mean((net.apply(p, state, b["x"][:, 0])[0] - b["y"]) ** 2)
    return loss, (params, batch)


def _over_vmap_axis(collective):
    def out(p, x):
        def one(x):
            h = jnp.tanh(x[0] @ p["w"])
            return jnp.sum(h - collective(h, "examples"))

        return jax.vmap(one, axis_name="examples")(x)

    return _plain(out)


def _shard_map(axis: str, spec_x: jax.P, combine):
    """A loss in `shard_map` on 8 devices, `combine` using a collective over the mesh axis
    `axis`: "data" splits the examples, "model" the features (and the weights' rows)."""
    mesh = jax.make_mesh((8,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))

    def out(p, x):
        local = lambda w, x: jnp.tanh(combine(x[:, 0] @ w)).sum(-1)
        w_spec = jax.P(axis) if axis == "model" else jax.P()
        return jax.shard_map(local, mesh=mesh, in_specs=(w_spec, spec_x),
                             out_specs=jax.P(spec_x[0]))(p["w"], x)

    return _plain(out)


def _extra_argument():
    """A coupling only the value check sees (the statistic is taken after an FFT, whose axis
    rule the structural check does not know), with an argument after the batch."""

    def loss(p, b, scale):
        h = jnp.fft.fft(b["x"][:, 0] @ p["w"]).real
        return jnp.mean(((h - h.mean(0)) * scale).sum(-1) ** 2)

    return loss, (_weights(), _batch(), jnp.float32(1.0))


def _merged_rows_normalised(p, x):
    h = (x @ p["w"]).reshape(-1, C)  # [B·T, C]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
    return jnp.tanh(h).reshape(x.shape).sum((1, 2))


COUPLING = {
    "nnx BatchNorm": lambda: _nnx(nnx.BatchNorm),
    "nnx BatchNorm on (B*T, C)": lambda: _nnx(nnx.BatchNorm, merge_tokens=True),
    "linen BatchNorm": _linen,
    "equinox BatchNorm(axis_name) under vmap": _equinox,
    "haiku BatchNorm": _haiku,
    "x - x.mean(0)": lambda: _plain(lambda p, x: jnp.tanh(
        (h := x[:, 0] @ p["w"]) - h.mean(0)).sum(-1)),
    "(B*T, C) normalised over axis 0": lambda: _plain(_merged_rows_normalised),
    "lax.psum over a vmap axis": lambda: _over_vmap_axis(lax.psum),
    "lax.pmean over a vmap axis": lambda: _over_vmap_axis(lax.pmean),
    "lax.pmax over a vmap axis": lambda: _over_vmap_axis(lax.pmax),
    "pmean over the batch's mesh axis": lambda: _shard_map(
        "data", jax.P("data"), lambda h: h - lax.pmean(h, "data")),
    "value check with an extra argument": _extra_argument,
}


def _per_row_and_back(p, x):
    h = (x @ p["w"]).reshape(-1, C)  # [B·T, C]
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return jnp.tanh(h @ p["w"]).reshape(x.shape).sum((1, 2))


def _attention(p, x):
    q = k = v = x @ p["w"]
    att = jax.nn.softmax(jnp.einsum("btc,bsc->bts", q, k) / C ** 0.5, axis=-1)
    return jnp.tanh(jnp.einsum("bts,bsc->btc", att, v)).sum((1, 2))


def _token_weighted():
    def loss(p, b):
        per_token = jnp.tanh(b["x"] @ p["w"]).sum(-1) ** 2
        mask = b["mask"].astype(per_token.dtype)
        return jnp.sum(mask * per_token) / jnp.sum(mask)

    return loss, (_weights(), _batch())


PER_EXAMPLE = {
    "mean loss": lambda: _plain(lambda p, x: jnp.tanh(x[:, 0] @ p["w"]).sum(-1)),
    "nnx LayerNorm": lambda: _nnx(nnx.LayerNorm),
    "nnx BatchNorm in eval mode": lambda: _nnx(nnx.BatchNorm, train=False),
    "token-weighted mean": _token_weighted,
    "attention within each example": lambda: _plain(_attention),
    "(B*T, C) per-row ops and back": lambda: _plain(_per_row_and_back),
    "psum over a model axis": lambda: _shard_map(
        "model", jax.P(None, None, "model"), lambda h: lax.psum(h, "model")),
}


def _drop_in(loss, args, jitted: bool):
    """The drop-in users call on (loss, args): the NNX form for a module, eager or jitted."""
    if isinstance(args[0], nnx.Module):
        fn = noise.nnx_value_grad_and_stats(loss)
        return nnx.jit(fn) if jitted else fn
    fn = noise.value_grad_and_stats(loss)
    return jax.jit(fn) if jitted else fn


def _structural(loss, args) -> str | None:
    """The structural check alone (`coupling.loss_coupling`); a module's whole state is an
    argument (BatchStat included)."""
    if isinstance(args[0], nnx.Module):
        graphdef, state = nnx.split(args[0])
        return coupling.loss_coupling(lambda s, b: loss(nnx.merge(graphdef, s), b), state,
                                      args[1])
    return coupling.loss_coupling(loss, *args)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", COUPLING)
def test_a_loss_that_couples_examples_is_refused(case, jitted):
    loss, args = COUPLING[case]()
    with pytest.raises(ValueError, match=COUPLED) as err:
        _drop_in(loss, args, jitted)(*args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", [c for c in COUPLING if c != "value check with an extra argument"])
def test_the_jaxpr_shows_the_coupling_whatever_the_values(case):
    """The structural check alone finds each coupling (the value check may miss one that the
    parameters or the stand-ins make small)."""
    assert _structural(*COUPLING[case]()) is not None


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", PER_EXAMPLE)
def test_a_per_example_loss_is_measured(case, jitted):
    loss, args = PER_EXAMPLE[case]()
    stats = _drop_in(loss, args, jitted)(*args)[2]
    assert np.isfinite(float(stats.trace_sigma))
    assert _structural(loss, args) is None
