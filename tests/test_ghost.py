"""cbs.stats.ghost: per-example gradient norms read from the jaxpr equal the vmap(grad) reference,
for models written in plain jax.numpy, nnx, linen, with scan/remat and tied embeddings, and
for parameters read inside nested jit, custom_vjp/custom_jvp, lax.scan and jax.checkpoint."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from cbs.stats import ghost

B = 6


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def _float():
    """nnx.Embed computes in its dtype (float32 by default), also under x64."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _nnx_loss(model, loss):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        return loss(nnx.merge(graphdef, p, rest), batch)

    return loss_fn, params


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


# ----------------------------------------------------------------------------- models


def plain_mlp(dtype=jnp.float32):
    k = _keys(6)
    sizes = (5, 7, 7, 3)
    params = {f"layer{i}": {"w": jax.random.normal(k[i], (a, b), dtype) / np.sqrt(a),
                            "b": 0.1 * jax.random.normal(k[i + 3], (b,), dtype)}
              for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))}

    def loss_fn(p, batch):
        h = batch["x"]
        for i in range(3):
            h = h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
            h = jnp.tanh(h) if i < 2 else h
        return _xent(h, batch["y"])

    x = jax.random.normal(k[5], (B, 5), dtype)
    return loss_fn, params, {"x": x, "y": jnp.arange(B) % 3}


def plain_cnn(dtype=jnp.float32):
    k = _keys(5)
    params = {"c1": jax.random.normal(k[0], (3, 3, 2, 4), dtype) / 4,
              "c1_b": 0.1 * jax.random.normal(k[1], (4,), dtype),
              "c2": jax.random.normal(k[2], (2, 2, 4, 3), dtype) / 4,
              "head": jax.random.normal(k[3], (2 * 2 * 3, 3), dtype) / 4}

    def loss_fn(p, batch):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.lax.conv_general_dilated(batch["x"], p["c1"], (1, 1), "SAME",
                                         dimension_numbers=dn) + p["c1_b"]
        h = jax.nn.relu(h)
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "VALID", dimension_numbers=dn)
        return _xent(jnp.tanh(h).reshape(h.shape[0], -1) @ p["head"], batch["y"])

    x = jax.random.normal(k[4], (B, 10, 10, 2), dtype)
    return loss_fn, params, {"x": x, "y": jnp.arange(B) % 3}


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 4, dtype=_float(), rngs=rngs)
        self.conv = nnx.Conv(4, 5, (3,), rngs=rngs)
        self.norm = nnx.LayerNorm(5, rngs=rngs)
        self.lin = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, ids):
        h = self.norm(jax.nn.gelu(self.conv(self.embed(ids))))
        return self.lin(h)


def nnx_model():
    loss_fn, params = _nnx_loss(NNXNet(nnx.Rngs(0)),
                                lambda m, b: _xent(m(b["ids"]), b["y"]))
    ids = jax.random.randint(_keys(1)[0], (B, 7), 0, 11)
    return loss_fn, params, {"ids": ids, "y": ids % 3}


class LinenNet(linen.Module):
    dtype: jnp.dtype = jnp.float32  # linen's Embed computes in its dtype (float32 default)

    @linen.compact
    def __call__(self, ids, img):
        h = linen.Embed(9, 4, dtype=self.dtype)(ids).mean(1)
        c = linen.Conv(3, (3, 3), strides=(2, 2))(img)
        c = linen.LayerNorm()(jax.nn.relu(c)).reshape(c.shape[0], -1)
        return linen.Dense(3)(jnp.concatenate([h, c], -1))


def linen_model():
    k = _keys(3)
    ids = jax.random.randint(k[0], (B, 5), 0, 9)
    img = jax.random.normal(k[1], (B, 6, 6, 2))
    net = LinenNet(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    params = net.init(k[2], ids, img)["params"]
    loss_fn = lambda p, b: _xent(net.apply({"params": p}, b["ids"], b["img"]), b["y"])
    return loss_fn, params, {"ids": ids, "img": img, "y": jnp.arange(B) % 3}


class Block(nnx.Module):
    """Pre-LN block: 2-head causal attention (one fused qkv einsum) and an MLP."""

    def __init__(self, d, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Einsum("btd,dnhk->btnhk", (d, 3, 2, d // 2), rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, h):
        b, t, _ = h.shape
        q, k, v = jnp.moveaxis(self.qkv(self.ln1(h)), 2, 0)
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
        h = h + self.out(a)
        return h + self.fc2(jax.nn.gelu(self.fc1(self.ln2(h))))


class ScannedLM(nnx.Module):
    def __init__(self, vocab, length, d, n_layers, *, tied, rngs):
        self.embed = nnx.Embed(vocab, d, dtype=_float(), rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, d)))

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(d, rngs)

        self.blocks = blocks(rngs)
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = None if tied else nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids) + self.pos[: ids.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(h, block):
            return block(h)

        h = self.ln(run(h, self.blocks))
        return self.embed.attend(h) if self.head is None else self.head(h)


def scanned_lm(tied=False, n_layers=4, dtype=None):
    model = ScannedLM(13, 6, 8, n_layers, tied=tied, rngs=nnx.Rngs(0))
    loss_fn, params = _nnx_loss(model, lambda m, b: _xent(m(b["ids"]), b["y"]))
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    ids = jax.random.randint(_keys(1)[0], (B, 6), 0, 13)
    return loss_fn, params, {"ids": ids, "y": jnp.roll(ids, -1, 1)}


@jax.custom_vjp
def _dense_custom_vjp(x, w):
    return x @ w


def _dense_fwd(x, w):
    return x @ w, (x, w)


def _dense_bwd(res, g):
    x, w = res
    return g @ w.T, jnp.einsum("...d,...o->do", x, g)


_dense_custom_vjp.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_jvp
def _scale_custom_jvp(h, s):
    return h * s


_scale_custom_jvp.defjvp(lambda primals, tangents: (
    _scale_custom_jvp(*primals), tangents[0] * primals[1] + primals[0] * tangents[1]))


def wrapped_jax():
    """Plain JAX whose parameters are read inside a nested jit, a custom_vjp and a custom_jvp
    function, and a lax.scan over stacked [L, D, D] kernels with a jax.checkpoint body."""
    k = _keys(5)
    params = {"w_in": jax.random.normal(k[0], (5, 4)) / 2,
              "stack": jax.random.normal(k[1], (3, 4, 4)) / 2,
              "stack_b": 0.1 * jax.random.normal(k[2], (3, 4)),
              "scale": 1 + 0.1 * jax.random.normal(k[3], (4,)),
              "w_out": jax.random.normal(k[4], (4, 3)) / 2}

    @jax.jit
    def embed(w, x):
        return jnp.tanh(x @ w)

    def loss_fn(p, batch):
        h = embed(p["w_in"], batch["x"])

        @jax.checkpoint
        def layer(h, wb):
            return jnp.tanh(h @ wb[0] + wb[1]), None

        h, _ = jax.lax.scan(layer, h, (p["stack"], p["stack_b"]))
        h = _scale_custom_jvp(h, p["scale"])
        return _xent(_dense_custom_vjp(h, p["w_out"]), batch["y"])

    x = jax.random.normal(_keys(1, seed=1)[0], (B, 5))
    return loss_fn, params, {"x": x, "y": jnp.arange(B) % 3}


def mixed_cnn(dtype=jnp.float32):
    """Two convolutions whose per-example norms take different forms ("mixed" ghost norms,
    Bu et al. 2022): 6×6×3 → 3×3 SAME → 6×6×8 (T = 36 positions, D = 27 window features,
    O = 8: the direct form T·D·O is cheaper than the Gram form T²(D + O)), then 3×3 stride 3
    → 2×2×16 (T = 4, D = 72, O = 16: the Gram form is cheaper)."""
    k = _keys(4)
    params = {"c1": jax.random.normal(k[0], (3, 3, 3, 8), dtype) / 5,
              "c2": jax.random.normal(k[1], (3, 3, 8, 16), dtype) / 8,
              "head": jax.random.normal(k[2], (4 * 16, 3), dtype) / 8}

    def loss_fn(p, batch):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jnp.tanh(jax.lax.conv_general_dilated(batch["x"], p["c1"], (1, 1), "SAME",
                                                  dimension_numbers=dn))
        h = jnp.tanh(jax.lax.conv_general_dilated(h, p["c2"], (3, 3), "VALID",
                                                  dimension_numbers=dn))
        return _xent(h.reshape(h.shape[0], -1) @ p["head"], batch["y"])

    x = jax.random.normal(k[3], (B, 6, 6, 3), dtype)
    return loss_fn, params, {"x": x, "y": jnp.arange(B) % 3}


def scalar_params(dtype=jnp.float32):
    """Linear regression with rank-0 parameters: a scalar bias added and a scalar gain
    multiplied elementwise (lax binary ops take a rank-0 operand without broadcast_in_dim)."""
    k = _keys(3)
    params = {"w": jax.random.normal(k[0], (5,), dtype), "b": jnp.asarray(0.3, dtype),
              "gain": jnp.asarray(1.2, dtype)}

    def loss_fn(p, batch):
        pred = (batch["x"] @ p["w"]) * p["gain"] + p["b"]
        return jnp.mean(0.5 * (pred - batch["y"]) ** 2)

    x = jax.random.normal(k[1], (B, 5), dtype)
    return loss_fn, params, {"x": x, "y": jax.random.normal(k[2], (B,), dtype)}


def unreadable():
    """A plain MLP whose second kernel goes through an op no rule covers (sin)."""
    loss_fn, params, batch = plain_mlp()

    def odd_loss(p, b):
        p = {**p, "layer1": {**p["layer1"], "w": jnp.sin(p["layer1"]["w"])}}
        return loss_fn(p, b)

    return odd_loss, params, batch


MODELS = {"plain_mlp": plain_mlp, "plain_cnn": plain_cnn, "mixed_cnn": mixed_cnn,
          "nnx": nnx_model,
          "linen": linen_model, "scanned_lm": scanned_lm,
          "tied_lm": lambda: scanned_lm(tied=True), "unreadable": unreadable,
          "wrapped_jax": wrapped_jax, "scalar_params": scalar_params}
EXPECTED_UNCOVERED = {"unreadable": {"layer1/w"}}


@functools.cache
def built(name, x64):
    """MODELS[name]() built once per process and precision (x64: built under float64, with
    float64 inputs), so the tests of one model share its loss_fn object and with it the
    loss check that runs once per loss_fn."""
    assert bool(jax.config.jax_enable_x64) == x64  # nnx/linen embeddings take the setting
    loss_fn, params, batch = MODELS[name]()
    if x64:
        params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        batch = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x,
                             batch)
    return loss_fn, params, batch


def compiled(fn, *args):
    """fn jitted and compiled for `args` at XLA backend optimisation level 0: about half the
    compile time of these small programs, which then run for milliseconds (the level picks
    LLVM's code-generation passes, not the arithmetic; the tolerances are unchanged)."""
    return jax.jit(fn).trace(*args).lower().compile({"xla_backend_optimization_level": 0})


def jitted_info(loss_fn, method, **kw):
    """ghost.per_example_grads_info compiled once (op-by-op dispatch is slow to test)."""
    return jax.jit(functools.partial(ghost.per_example_grads_info, loss_fn, method=method, **kw))


def _compare(loss_fn, params, batch, rtol):
    both = lambda p, b: (ghost.per_example_grads_info(loss_fn, p, b, method="auto"),
                         ghost.per_example_grads_info(loss_fn, p, b, method="vmap",
                                                      chunk_size=2))
    fast, ref = compiled(both, params, batch)(params, batch)
    np.testing.assert_allclose(fast[0], ref[0], rtol=rtol)
    for a, b in zip(jax.tree.leaves(fast[1:]), jax.tree.leaves(ref[1:]), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(b))))
    return fast


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(MODELS))
def test_coverage_report(name):
    loss_fn, params, batch = built(name, x64=False)
    uncovered = ghost.uncovered_leaves(loss_fn, params, batch)
    assert set(uncovered) == EXPECTED_UNCOVERED.get(name, set()), uncovered
    frac = ghost.coverage(loss_fn, params, batch)
    assert (frac == 1.0) == (name not in EXPECTED_UNCOVERED)
    if name == "unreadable":
        assert "sin" in uncovered["layer1/w"]
        with pytest.raises(ValueError, match="layer1/w: read by `sin`"):
            ghost.per_example_grads_info(loss_fn, params, batch, method="fast")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fast_equals_vmap_float64(name, x64):
    _compare(*built(name, x64=True), 1e-10)


# The two language models in float32 are slow (13 CPU-s each); their float64 test above is the
# exact check of the same rules, and float32 runs fast on the eight other models.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("_lm")
                                  else n for n in sorted(MODELS)])
def test_fast_equals_vmap_float32(name):
    _compare(*built(name, x64=False), 1e-5)


def test_mixed_cnn_takes_both_forms():
    """The per-layer choice of `mixed_cnn`: direct for the first convolution, Gram for the
    second (its norms equal the vmap reference in test_fast_equals_vmap_*)."""
    from cbs.stats.ghost_rules import use_gram

    assert not use_gram(36, 27, 8) and use_gram(4, 72, 16)
