"""cbs.stats.ghost: fast per-example gradient norms equal the vmap(grad) reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from cbs.models import layers
from cbs.stats import ghost, ghost_rules

# The checks compile fast, vmap and plain programs per model; unoptimised XLA compiles in half
# the time on CPU, and these tests are about values, not speed.
FAST_COMPILE = {"xla_backend_optimization_level": 0}

# ----------------------------------------------------------------------------- tiny models


class MLP(nnx.Module):
    def __init__(self, sizes, *, use_bias, rngs):
        self.layers = nnx.List([layers.Linear(a, b, use_bias=use_bias, rngs=rngs)
                                for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    def __init__(self, *, use_bias, strides, padding, norm, rngs):
        other = "VALID" if padding == "SAME" else "SAME"
        self.conv1 = layers.Conv(2, 4, (3, 3), strides=strides, padding=padding,
                                 use_bias=use_bias, rngs=rngs)
        self.norm = {"group": layers.GroupNorm(4, num_groups=2), "layer": layers.LayerNorm(4),
                     None: None}[norm]
        self.conv2 = layers.Conv(4, 3, (2, 2), padding=other, use_bias=use_bias, rngs=rngs)
        side = {("SAME", 1): 7, ("VALID", 1): 5, ("SAME", 2): 4, ("VALID", 2): 3}[padding,
                                                                                 strides]
        side = side if other == "SAME" else side - 1
        self.head = layers.Linear(side * side * 3, 3, use_bias=use_bias, rngs=rngs)

    def __call__(self, x):
        h = self.conv1(x)
        if self.norm is not None:
            h = self.norm(h)
        h = jax.nn.relu(self.conv2(jax.nn.relu(h)))
        return self.head(h.reshape(h.shape[0], -1))


class Transformer(nnx.Module):
    """One pre-LN block: embeddings, causal attention (2 heads), MLP, output head."""

    def __init__(self, vocab, length, d=8, *, use_bias, tied=False, rngs):
        self.embed = layers.Embed(vocab, d, rngs=rngs)
        self.pos = layers.Embed(length, d, rngs=rngs)
        self.ln1, self.ln2, self.ln3 = (layers.LayerNorm(d) for _ in range(3))
        self.q, self.k, self.v, self.o = (layers.Linear(d, d, use_bias=use_bias, rngs=rngs)
                                          for _ in range(4))
        self.fc1 = layers.Linear(d, 2 * d, use_bias=use_bias, rngs=rngs)
        self.fc2 = layers.Linear(2 * d, d, use_bias=use_bias, rngs=rngs)
        self.head = None if tied else layers.Linear(d, vocab, use_bias=use_bias, rngs=rngs)

    def __call__(self, ids):
        b, t = ids.shape
        h = self.embed(ids) + self.pos(jnp.broadcast_to(jnp.arange(t), (b, t)))
        x = self.ln1(h)
        heads = lambda y: y.reshape(b, t, 2, -1)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
        h = h + self.o(a)
        h = h + self.fc2(jax.nn.gelu(self.fc1(self.ln2(h))))
        h = self.ln3(h)
        if self.head is None:
            return h @ self.embed.embedding[...].T
        return self.head(h)


def make_loss(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn, params


def classification_batch(shape, classes=3, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, shape), "y": jax.random.randint(ky, shape[:1], 0, classes)}


def lm_batch(b, t, vocab, seed=1):
    ids = jax.random.randint(jax.random.key(seed), (b, t + 1), 0, vocab)
    return {"x": ids[:, :-1], "y": ids[:, 1:]}


def to_f64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating)
                        else a, tree)


def assert_norms_close(fast, ref, rtol):
    """Per example and leaf: |fast - ref| <= rtol (ref + 1e-3 Σ_leaves ref).

    The floor is relative to the example's whole squared gradient norm, so leaves whose true
    gradient vanishes (an attention key bias) are compared at the rounding level of the rest.
    """
    assert jax.tree.structure(fast) == jax.tree.structure(ref)
    fast_l, ref_l = [np.asarray(a) for a in jax.tree.leaves(fast)], jax.tree.leaves(ref)
    ref_l = [np.asarray(a) for a in ref_l]
    total_B = sum(ref_l)
    assert np.all(total_B > 0)
    for path, a, b in zip(ghost._leaf_paths(fast), fast_l, ref_l, strict=True):
        assert a.shape == b.shape
        bound = rtol * (np.abs(b) + 1e-3 * total_B)
        assert np.all(np.abs(a - b) <= bound), (path, np.max(np.abs(a - b) / bound))


def check_fast_equals_vmap(loss_fn, params, batch, rtol, method="fast"):
    """Norms, loss and ḡ of `method` against vmap, and loss and ḡ against plain autodiff."""
    def run(params, batch):
        return (ghost.per_example_grads_info(loss_fn, params, batch, method=method),
                ghost.per_example_grads_info(loss_fn, params, batch, method="vmap"),
                jax.value_and_grad(loss_fn)(params, batch))

    compiled = jax.jit(run).trace(params, batch).lower().compile(FAST_COMPILE)
    (loss, grad, sq), (loss_v, grad_v, sq_v), (loss_p, grad_p) = compiled(params, batch)
    assert_norms_close(sq, sq_v, rtol)
    np.testing.assert_allclose(loss, loss_p, rtol=rtol)
    np.testing.assert_allclose(loss_v, loss_p, rtol=rtol)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grad_p))
    for a, b, c in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_p), jax.tree.leaves(grad_v),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)
        np.testing.assert_allclose(c, b, rtol=rtol, atol=rtol * scale)
    return sq


# ----------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("use_bias", [True, False])
def test_mlp_fast_equals_vmap(use_bias):
    loss_fn, params = make_loss(MLP((6, 8, 8, 3), use_bias=use_bias, rngs=nnx.Rngs(0)))
    sq = check_fast_equals_vmap(loss_fn, params, classification_batch((5, 6)), 1e-5)
    assert all(leaf.dtype == jnp.float32 and leaf.shape == (5,) for leaf in jax.tree.leaves(sq))


@pytest.mark.parametrize("use_bias,strides,padding,norm", [
    (True, 1, "SAME", None), (False, 2, "VALID", None), (True, 2, "SAME", "group"),
    (False, 1, "VALID", "layer")])
def test_cnn_fast_equals_vmap(use_bias, strides, padding, norm):
    model = CNN(use_bias=use_bias, strides=strides, padding=padding, norm=norm,
                rngs=nnx.Rngs(0))
    loss_fn, params = make_loss(model)
    check_fast_equals_vmap(loss_fn, params, classification_batch((4, 7, 7, 2)), 1e-5)


@pytest.mark.parametrize("use_bias,vocab,gram", [
    (True, 11, True), (False, 11, False), (True, 4, False)])
def test_transformer_fast_equals_vmap(use_bias, vocab, gram, monkeypatch):
    # vocab 4 < T = 6 takes the one-hot embedding rule, 11 the Gram rule; `gram` forces the
    # Gram or the direct form of every dense kernel with a sequence axis.
    monkeypatch.setattr(ghost_rules, "use_gram", lambda t, d, o: gram)
    loss_fn, params = make_loss(Transformer(vocab, 6, use_bias=use_bias, rngs=nnx.Rngs(0)))
    check_fast_equals_vmap(loss_fn, params, lm_batch(3, 6, vocab), 1e-5)


@pytest.mark.parametrize("model,gram", [("transformer", True), ("cnn", False)])
def test_float64_is_tighter(x64, model, gram, monkeypatch):
    monkeypatch.setattr(ghost_rules, "use_gram", lambda t, d, o: gram)
    if model == "transformer":
        loss_fn, params = make_loss(Transformer(7, 5, use_bias=True, rngs=nnx.Rngs(0)))
        batch = lm_batch(3, 5, 7)
    else:
        loss_fn, params = make_loss(CNN(use_bias=True, strides=2, padding="SAME", norm="group",
                                        rngs=nnx.Rngs(0)))
        batch = to_f64(classification_batch((3, 7, 7, 2)))
    sq = check_fast_equals_vmap(loss_fn, to_f64(params), batch, 1e-11)
    assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(sq))


# ----------------------------------------------------------------------------- fallbacks


class Mixed(nnx.Module):
    """A cbs layer, an nnx.Linear, a raw parameter, one Linear used twice, an unused leaf."""

    def __init__(self, rngs):
        self.ours = layers.Linear(4, 5, rngs=rngs)
        self.theirs = nnx.Linear(5, 5, rngs=rngs)
        self.twice = layers.Linear(5, 5, rngs=rngs)
        self.raw = nnx.Param(jax.random.normal(rngs.params(), (5, 3)))
        self.unused = nnx.Param(jnp.ones((2,)))

    def __call__(self, x):
        h = jnp.tanh(self.theirs(jnp.tanh(self.ours(x))))
        h = jnp.tanh(self.twice(jnp.tanh(self.twice(h))))
        return h @ self.raw[...]


def test_unknown_layers_fall_back_under_auto_and_raise_under_fast():
    loss_fn, params = make_loss(Mixed(nnx.Rngs(0)))
    batch = classification_batch((5, 4))
    uncovered = ghost.uncovered_leaves(loss_fn, params, batch)
    assert set(uncovered) == {"theirs/kernel", "theirs/bias", "twice/kernel", "twice/bias",
                              "raw"}
    assert "shared by 2" in uncovered["twice/kernel"]
    sq = check_fast_equals_vmap(loss_fn, params, batch, 1e-5, method="auto")
    np.testing.assert_array_equal(sq["unused"][...], 0.0)
    with pytest.raises(ValueError, match=r"theirs/kernel.*twice/bias|raw"):
        ghost.per_example_grads_info(loss_fn, params, batch, method="fast")


def test_tied_embedding_falls_back():
    loss_fn, params = make_loss(Transformer(7, 5, use_bias=False, tied=True, rngs=nnx.Rngs(0)))
    batch = lm_batch(3, 5, 7)
    assert list(ghost.uncovered_leaves(loss_fn, params, batch)) == ["embed/embedding"]
    check_fast_equals_vmap(loss_fn, params, batch, 1e-5, method="auto")
    with pytest.raises(ValueError, match="embed/embedding"):
        ghost.per_example_grads_info(loss_fn, params, batch, method="fast")


class Odd(nnx.Module):
    """Batch not leading (time-major input); layers under jax.checkpoint and lax.scan."""

    def __init__(self, rngs):
        self.time_major = layers.Linear(4, 4, rngs=rngs)
        self.remat = layers.Linear(4, 4, rngs=rngs)
        self.recurrent = layers.Linear(4, 3, rngs=rngs)

    def __call__(self, x_BxTxD):
        h_TxBxD = jnp.tanh(self.time_major(jnp.swapaxes(x_BxTxD, 0, 1)))
        h_BxD = jax.checkpoint(lambda h: jnp.tanh(self.remat(h)))(h_TxBxD.mean(0))
        # Three applications of one layer inside a scan body traced once: per-example
        # norms of the summed gradient are not the sum of per-application norms.
        step = lambda h, _: (jnp.tanh(h + jnp.pad(self.recurrent(h), ((0, 0), (0, 1)))), None)
        return self.recurrent(jax.lax.scan(step, h_BxD, length=3)[0])


def test_batch_not_leading_and_transformed_leaves_fall_back():
    loss_fn, params = make_loss(Odd(nnx.Rngs(0)))
    batch = classification_batch((5, 3, 4))
    uncovered = ghost.uncovered_leaves(loss_fn, params, batch)
    assert "leading axis" in uncovered["time_major/kernel"]
    assert "nested" in uncovered["remat/bias"]
    assert set(uncovered) == {f"{layer}/{leaf}" for layer in ("time_major", "remat", "recurrent")
                              for leaf in ("kernel", "bias")}
    check_fast_equals_vmap(loss_fn, params, batch, 1e-5, method="auto")


# ----------------------------------------------------------------------------- transformations


def test_jit_chunks_and_sharded_batch():
    loss_fn, params = make_loss(Mixed(nnx.Rngs(0)))
    batch = classification_batch((16, 4))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))

    def run(method, chunk_size, batch):
        fn = jax.jit(functools.partial(ghost.per_example_grads_info, loss_fn, method=method,
                                       chunk_size=chunk_size))
        return fn.trace(params, batch).lower().compile(FAST_COMPILE)(params, batch)

    reference = run("auto", None, batch)  # the fallback leaves are vmapped in one chunk
    for method, chunk_size, b in [("auto", None, sharded), ("auto", 3, batch),
                                  ("vmap", 5, sharded)]:
        out = run(method, chunk_size, b)
        assert_norms_close(out[2], reference[2], 1e-5)
        for x, y in zip(jax.tree.leaves(out[:2]), jax.tree.leaves(reference[:2]), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_explicit_mesh_axes():
    loss_fn, params = make_loss(MLP((6, 8, 3), use_bias=True, rngs=nnx.Rngs(0)))
    batch = classification_batch((16, 6))
    reference = ghost.per_example_grads_info(loss_fn, params, batch, method="vmap")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = jax.jit(functools.partial(ghost.per_example_grads_info, loss_fn, method="fast"))
        out = fn.trace(params, sharded).lower().compile(FAST_COMPILE)(params, sharded)
    assert_norms_close(out[2], reference[2], 1e-5)


def test_bad_input():
    loss_fn, params = make_loss(MLP((4, 3), use_bias=True, rngs=nnx.Rngs(0)))
    batch = classification_batch((5, 4))
    with pytest.raises(ValueError, match="method"):
        ghost.per_example_grads_info(loss_fn, params, batch, method="ghost")
    with pytest.raises(ValueError, match="chunk_size"):
        ghost.per_example_grads_info(loss_fn, params, batch, chunk_size=0)
    with pytest.raises(ValueError, match="leading"):
        ghost.per_example_grads_info(loss_fn, params, {"x": batch["x"], "y": batch["y"][:4]})
