"""The drop-in `value_grad_and_stats` and its NNX form: every option against the float64
per-example loop of `_reference`; keys defined per example and equal on every route; the
coupling check refuses train-mode BatchNorm on every route."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import reference_halves, reference_stats, tiny_mlp
from flax import nnx

from cbs import noise
from cbs.stats.noise import _probe_vector

SIMPLE = ("mean_grad_sq_norm", "grad_sq_norm", "trace_sigma", "b_simple")
CURV = ("mean_g_h_g", "g_h_g", "trace_h_sigma", "b_noise")
GROUPS = ["dense1", "dense1", "dense2", "dense2", "out", "out"]  # "auto" on tiny_mlp's leaves
RTOL = 1e-9  # float64 against float64: only the order of the sums differs


def _close(stats, ref, fields, rtol=RTOL):
    for name in fields:
        np.testing.assert_allclose(np.asarray(getattr(stats, name)), ref[name], rtol=rtol,
                                   err_msg=name)


def _tree_close(a, b, rtol=RTOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-14)


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_has_aux_groups_and_curvature_equal_the_reference(x64, method):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    aux_loss = lambda p, b: (loss_fn(p, b), {"x_sum": jnp.sum(b["x"])})
    vgs = noise.value_grad_and_stats(aux_loss, has_aux=True, curvature=True, groups="auto",
                                     method=method)
    (loss, aux), grads, stats = jax.jit(vgs)(params, batch)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(aux_loss, has_aux=True)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    np.testing.assert_allclose(aux["x_sum"], ref_aux["x_sum"], rtol=1e-12)
    _tree_close(grads, ref_grads)
    ref, halves = reference_stats(loss_fn, params, batch, GROUPS), reference_halves(
        loss_fn, params, batch, GROUPS)
    _close(stats, ref, SIMPLE)
    _close(stats, halves, CURV)
    for name in ("dense1", "dense2", "out"):
        _close(stats.groups[name], ref["groups"][name], SIMPLE)
        _close(stats.groups[name], halves["groups"][name], CURV)


@pytest.mark.slow
def test_the_halves_take_h_from_other_examples(x64):
    """The halves' b_noise differs from the one with each example's own Hessian in H (which
    `noise.exact(curvature=True)` without a hessian_batch gives)."""
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    stats = noise.value_grad_and_stats(loss_fn, curvature=True)(params, batch)[2]
    own = noise.exact(loss_fn, params, batch, curvature=True)
    assert abs(float(stats.trace_h_sigma) / float(own.trace_h_sigma) - 1) > 1e-3


def test_argnums_batch_argnums_and_passed_through_arguments(x64):
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    first = {"dense1": params["dense1"]}
    second = {k: v for k, v in params.items() if k != "dense1"}

    def split_loss(x, p1, scale, y, p2):  # params in two arguments, examples in two
        return scale * loss_fn({**p1, **p2}, {"x": x, "y": y})

    vgs = noise.value_grad_and_stats(split_loss, argnums=(1, 4), batch_argnums=(0, 3))
    args = (batch["x"], first, 2.0, batch["y"], second)
    loss, grads, stats = jax.jit(vgs)(*args)
    ref_loss, ref_grads = jax.value_and_grad(split_loss, argnums=(1, 4))(*args)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    assert isinstance(grads, tuple) and len(grads) == 2
    _tree_close(grads, ref_grads)
    scaled = lambda p, b: 2.0 * loss_fn(p, b)
    ref = reference_stats(scaled, params, batch)  # the same leaves, in the order of (p1, p2)
    _close(stats, ref, SIMPLE)


@pytest.mark.parametrize("jit", [False, True])
def test_keyword_arguments_go_to_the_loss_as_in_value_and_grad(x64, jit):
    """fn(*args, **kwargs): keywords reach loss_fn undifferentiated (jax.value_and_grad's
    rule), with has_aux and a tuple argnums unchanged; statistics equal the float64 reference
    of the loss with the keywords bound."""
    loss_fn, params, batch = tiny_mlp(jnp.float64)
    first = {"dense1": params["dense1"]}
    second = {k: v for k, v in params.items() if k != "dense1"}

    def loss(p1, b, p2, *, scale, shift=0.0):
        value = scale * loss_fn({**p1, **p2}, b) + shift
        return value, {"scale": scale}

    vgs = noise.value_grad_and_stats(loss, has_aux=True, argnums=(0, 2), batch_argnums=1)
    call = jax.jit(vgs) if jit else vgs
    (value, aux), grads, stats = call(first, batch, second, scale=jnp.float64(3.0), shift=0.5)
    (ref_value, ref_aux), ref_grads = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)(
        first, batch, second, scale=jnp.float64(3.0), shift=0.5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    np.testing.assert_allclose(aux["scale"], ref_aux["scale"])
    assert isinstance(grads, tuple) and len(grads) == 2
    _tree_close(grads, ref_grads)
    ref = reference_stats(lambda p, b: 3.0 * loss_fn(p, b) + 0.5, params, batch)
    _close(stats, ref, SIMPLE)


def test_aux_adds_no_second_forward_pass():
    """aux is computed by a second call of loss_fn in the same program, on the same operands
    as the ghost pass's forward; XLA merges the two: the compiled step's flops grow by the
    aux's own (an argmax), not by another [128, 256] × [256, 512] product (33.5 Mflop)."""
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(256, 512)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(512, 10)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(128, 256)), jnp.float32),
             "y": jnp.arange(128) % 10}

    def with_aux(p, b):
        logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, b["y"][:, None],
                                                                 -1)[:, 0]
        return nll.mean(), (logits.argmax(-1) == b["y"]).mean()

    def flops(fn):
        cost = jax.jit(fn).lower(params, batch).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    plain = flops(noise.value_grad_and_stats(lambda p, b: with_aux(p, b)[0]))
    extra = flops(noise.value_grad_and_stats(with_aux, has_aux=True)) - plain
    assert 0 <= extra < 0.01 * 2 * 128 * 256 * 512


def _dropout_loss(params, batch, key):
    """tiny_mlp's loss with dropout after the first layer, masks drawn for the whole batch."""
    h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    h = jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h / 0.7, 0.0)
    h = jnp.tanh(h @ params["dense2"]["kernel"] + params["dense2"]["bias"])
    logits = h @ params["out"]["kernel"] + params["out"]["bias"]
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]
    return jnp.mean(nll)


def _keyed_reference(key):
    """The definition, written out: example at position pos draws from fold_in(key, pos)."""
    def loss(params, batch):
        size = batch["pos"].shape[0]
        return sum(_dropout_loss(params, {"x": batch["x"][i:i + 1], "y": batch["y"][i:i + 1]},
                                 jax.random.fold_in(key, batch["pos"][i]))
                   for i in range(size)) / size

    return loss


def test_a_key_is_folded_with_each_position(x64):
    """The fast check of the slow test below: the one-pass route against the definition."""
    key, size = jax.random.key(7), 6
    _, params, batch = tiny_mlp(jnp.float64, batch_size=size)
    ref_loss = _keyed_reference(key)
    indexed = {**batch, "pos": np.arange(size)}
    loss, grads, stats = jax.jit(noise.value_grad_and_stats(_dropout_loss, prng_argnum=2))(
        params, batch, key)
    np.testing.assert_allclose(loss, ref_loss(params, indexed), rtol=1e-12)
    _tree_close(grads, jax.grad(ref_loss)(params, indexed))
    _close(stats, reference_stats(ref_loss, params, indexed), SIMPLE)


@pytest.mark.slow
def test_a_key_is_folded_with_each_position_on_every_route(x64):
    key, size = jax.random.key(7), 6
    _, params, batch = tiny_mlp(jnp.float64, batch_size=size)
    ref_loss = _keyed_reference(key)
    indexed = {**batch, "pos": np.arange(size)}
    ref, halves = reference_stats(ref_loss, params, indexed), reference_halves(
        ref_loss, params, indexed)
    outs = {m: jax.jit(noise.value_grad_and_stats(_dropout_loss, prng_argnum=2, method=m,
                                                  curvature=True))(params, batch, key)
            for m in ("auto", "vmap")}
    for loss, grads, stats in outs.values():  # ghost pass, vmap(grad), curvature halves
        np.testing.assert_allclose(loss, ref_loss(params, indexed), rtol=1e-12)
        _tree_close(grads, jax.grad(ref_loss)(params, indexed))
        _close(stats, ref, SIMPLE)
        _close(stats, halves, CURV)
    keyed, keyed_batch = noise.keyed_loss(_dropout_loss, key), noise.with_keys(batch, key)
    exact = noise.exact(keyed, params, keyed_batch, curvature=True, method="vmap")
    _close(exact, ref, SIMPLE + CURV)  # whole-batch H: the reference's own
    np.testing.assert_allclose(noise.per_example_sq_norms(keyed, params, keyed_batch),
                               ref["sq_norms"], rtol=RTOL)
    # probe: its two probes' estimate from the reference's per-example gradients
    probe_key = jax.random.key(3)
    probed = noise.probe(keyed, params, keyed_batch, probe_key, num_probes=2)
    grads_BxP = np.stack([np.asarray(jax.flatten_util.ravel_pytree(jax.grad(ref_loss)(
        params, jax.tree.map(lambda x, i=i: x[i:i + 1], indexed)))[0]) for i in range(size)])
    d_BxP = grads_BxP - grads_BxP.mean(0)
    zs = [np.asarray(jax.flatten_util.ravel_pytree(_probe_vector(k, params, "rademacher"))[0])
          for k in jax.random.split(probe_key, 2)]
    expected = np.mean([np.sum((d_BxP @ z) ** 2) / (size - 1) for z in zs])
    np.testing.assert_allclose(probed.trace_sigma, expected, rtol=RTOL)


def test_a_raw_key_draws_what_the_typed_key_of_its_data_draws():
    _, params, batch = tiny_mlp()
    vgs = jax.jit(noise.value_grad_and_stats(_dropout_loss, prng_argnum=2))
    typed, raw = vgs(params, batch, jax.random.key(7)), vgs(params, batch, jax.random.PRNGKey(7))
    assert float(typed[0]) == float(raw[0])
    assert float(typed[2].b_simple) == float(raw[2].b_simple)


def test_keyed_aux_is_per_example():
    _, params, batch = tiny_mlp(batch_size=6)
    aux_loss = lambda p, b, k: (_dropout_loss(p, b, k), b["x"][:, 0])
    (loss, aux), _, _ = noise.value_grad_and_stats(aux_loss, has_aux=True, prng_argnum=2)(
        params, batch, jax.random.key(0))
    assert aux.shape == (6, 1)
    np.testing.assert_allclose(aux[:, 0], batch["x"][:, 0])


# ------------------------------------------------------------------------------------ NNX


class _Net(nnx.Module):
    def __init__(self, rngs, rate=0.0, batchnorm=False, dtype=jnp.float32):
        self.dense = nnx.Linear(6, 16, param_dtype=dtype, rngs=rngs)
        self.norm = nnx.BatchNorm(16, param_dtype=dtype, rngs=rngs) if batchnorm else None
        self.drop = nnx.Dropout(rate, rngs=rngs) if rate else None
        self.out = nnx.Linear(16, 3, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = self.dense(x)
        h = self.norm(h) if self.norm is not None else h
        h = jnp.tanh(h)
        return self.out(self.drop(h) if self.drop is not None else h)


def _xent(model, batch):
    logits = model(batch["x"])
    picked = jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def test_nnx_form_equals_value_and_grad_and_the_reference(x64):
    _, _, batch = tiny_mlp(jnp.float64)
    model = _Net(nnx.Rngs(0, dropout=1), dtype=jnp.float64)
    model.eval()  # dropout off: the same model as a plain split loss
    aux_loss = lambda m, b: (_xent(m, b), m(b["x"]).shape[0])
    (loss, aux), grads, stats = nnx.jit(noise.nnx_value_grad_and_stats(
        aux_loss, has_aux=True))(model, batch)
    (ref_loss, ref_aux), ref_grads = nnx.value_and_grad(aux_loss, has_aux=True)(model, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    assert aux == ref_aux == 12
    _tree_close(grads, ref_grads)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    split = lambda p, b: _xent(nnx.merge(graphdef, p, rest), b)
    _close(stats, reference_stats(split, params, batch), SIMPLE)


def test_nnx_form_passes_other_arguments_through(x64):
    """`fn(model, batch, *args)`: class weights and a temperature reach `loss_fn` unchanged,
    eagerly and under `nnx.jit` (where they are traced): the loss and gradients of
    `nnx.value_and_grad` with the same arguments, the statistics of the float64 reference."""
    _, _, batch = tiny_mlp(jnp.float64)
    model = _Net(nnx.Rngs(0), dtype=jnp.float64)
    weights, temperature = jnp.array([1.0, 2.0, 0.5], jnp.float64), jnp.float64(1.5)

    def weighted(m, b, w, t):
        logits = m(b["x"]) / t
        picked = jnp.take_along_axis(logits, b["y"][:, None], -1)[:, 0]
        return jnp.mean(w[b["y"]] * (jax.nn.logsumexp(logits, -1) - picked))

    ref_loss, ref_grads = nnx.value_and_grad(weighted)(model, batch, weights, temperature)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    split = lambda p, b: weighted(nnx.merge(graphdef, p, rest), b, weights, temperature)
    want = reference_stats(split, params, batch)
    vgs = noise.nnx_value_grad_and_stats(weighted)
    for call in (vgs, nnx.jit(vgs)):
        loss, grads, stats = call(model, batch, weights, temperature)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
        _tree_close(grads, ref_grads)
        _close(stats, want, SIMPLE)


def test_nnx_dropout_streams_are_folded_per_example_and_advance(x64):
    _, _, batch = tiny_mlp(jnp.float64, batch_size=6)
    model = _Net(nnx.Rngs(0, dropout=1), rate=0.3, dtype=jnp.float64)
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngKey, ...)
    count = int(model.drop.rngs.count[...])

    def reference(p, b, rest):  # example pos draws from the stream's key folded with pos
        size = b["pos"].shape[0]
        total = 0.0
        for i in range(size):
            folded = jax.tree.map(lambda k, i=i: jax.random.fold_in(k, b["pos"][i]), keys)
            m = nnx.merge(graphdef, p, folded, jax.tree.map(lambda x: x, rest))
            total = total + _xent(m, {"x": b["x"][i:i + 1], "y": b["y"][i:i + 1]})
        return total / size

    indexed = {**batch, "pos": np.arange(6)}
    for method in ("auto", "vmap"):
        # the stream's count now (a copy: the model's own Variables move on with the call)
        rest = jax.tree.map(lambda x: x, nnx.split(model, nnx.Param, nnx.RngKey, ...)[3])
        ref_loss = lambda p, b, rest=rest: reference(p, b, rest)
        loss, grads, stats = nnx.jit(noise.nnx_value_grad_and_stats(_xent, method=method))(
            model, batch)
        np.testing.assert_allclose(loss, ref_loss(params, indexed), rtol=1e-12)
        _tree_close(grads, jax.grad(ref_loss)(params, indexed))
        _close(stats, reference_stats(ref_loss, params, indexed), SIMPLE)
    assert int(model.drop.rngs.count[...]) == count + 2


def test_a_closed_over_nnx_stream_is_refused_in_one_line():
    _, _, batch = tiny_mlp()
    model = _Net(nnx.Rngs(0, dropout=1), rate=0.3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda p, b: _xent(nnx.merge(graphdef, p, rest), b)
    with pytest.raises(ValueError, match=r"nnx.Rngs stream .*nnx_value_grad_and_stats"):
        noise.value_grad_and_stats(loss_fn)(params, batch)


def _bn_cases():
    """(name, call) for every route on an nnx model with BatchNorm in training mode, whose
    output kernel is zero: the loss does not change with the batch statistic at all, so no
    value test can see the coupling; the jaxpr does."""
    _, _, batch = tiny_mlp()
    model = _Net(nnx.Rngs(0, dropout=1), batchnorm=True)
    model.out.kernel[...] = jnp.zeros_like(model.out.kernel[...])
    model.train()
    graphdef, state = nnx.split(model)  # the whole state as params: BatchStat included
    whole = lambda s, b: _xent(nnx.merge(graphdef, s), b)
    keyed = lambda s, b, k: _xent(nnx.merge(graphdef, s), b) + 0 * jax.random.normal(k)
    key = jax.random.key(0)
    return [
        ("eager", lambda: noise.value_grad_and_stats(whole)(state, batch)),
        ("jit", lambda: jax.jit(noise.value_grad_and_stats(whole))(state, batch)),
        ("jit curvature", lambda: jax.jit(noise.value_grad_and_stats(
            whole, curvature=True))(state, batch)),
        ("jit key", lambda: jax.jit(noise.value_grad_and_stats(keyed, prng_argnum=2))(
            state, batch, key)),
        ("exact", lambda: noise.exact(whole, state, batch)),
        ("probe", lambda: noise.probe(whole, state, batch, key)),
        ("nnx", lambda: noise.nnx_value_grad_and_stats(_xent)(model, batch)),
        ("nnx jit", lambda: nnx.jit(noise.nnx_value_grad_and_stats(_xent))(model, batch)),
    ]


@pytest.mark.parametrize("case", range(8), ids=[c[0] for c in _bn_cases()])
def test_train_mode_batchnorm_is_refused_on_every_route(case):
    with pytest.raises(ValueError, match=r"couples the examples of a batch: a statistic over "
                                         r"the batch axis .*\(`sub` at .*BatchNorm") as err:
        _bn_cases()[case][1]()
    assert "\n" not in str(err.value)


def test_eval_mode_batchnorm_is_measured():
    _, _, batch = tiny_mlp()
    model = _Net(nnx.Rngs(0), batchnorm=True)
    model.eval()
    stats = nnx.jit(noise.nnx_value_grad_and_stats(_xent))(model, batch)[2]
    assert np.isfinite(float(stats.b_simple))
