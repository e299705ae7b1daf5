"""Tests for cbs.models: shapes, parameter counts, losses against float64 references,
causality and positions of the transformer, BatchNorm flagged as coupling examples."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from cbs import models
from cbs.models import build_model, default_model_config, make_loss_fn, param_count, split_model
from cbs.models.losses import make_eval_fn, per_example_loss
from cbs.models.transformer import SIZES, rotary
from cbs.stats import ghost


def _build(name, verbose=False, **fields):
    config = default_model_config(name)
    kwargs = {k: fields.pop(k) for k in ("input_shape", "num_classes", "vocab_size")
              if k in fields}
    config.update(fields)
    return build_model(config, rngs=nnx.Rngs(0), verbose=verbose, **kwargs)


def _tiny_lm(**fields):
    return _build("transformer", input_shape=(16,), vocab_size=13, **fields)


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _logsumexp(z):
    m = z.max(-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]


def test_mlp_shapes_and_param_count_by_hand(capsys):
    model = _build("mlp", verbose=True, input_shape=(4, 5), num_classes=2, hidden_sizes=(7, 3))
    assert param_count(model) == (20 * 7 + 7) + (7 * 3 + 3) + (3 * 2 + 2)
    assert model(jnp.ones((6, 4, 5))).shape == (6, 2)
    line = capsys.readouterr().out
    assert "179 parameters" in line and "lecun_normal" in line and line.count("\n") == 1


def test_mlp_regression_head_has_one_output():
    model = _build("mlp", input_shape=(3,), hidden_sizes=(4,))
    assert model(jnp.ones((5, 3))).shape == (5, 1)


@pytest.mark.parametrize("norm, input_shape", [  # BatchNorm forwards: tests further down
    ("none", (12,)), ("groupnorm", (8, 8)), ("layernorm", (6, 6, 3))])
def test_cnn_forward_shapes(norm, input_shape):
    model = _build("cnn", input_shape=input_shape, num_classes=5, norm=norm, channels=(4, 8),
                   dense_sizes=(6,), ghost_batch_size=2)
    logits = model(jax.random.normal(jax.random.key(0), (4, *input_shape)))
    assert logits.shape == (4, 5) and bool(jnp.all(jnp.isfinite(logits)))
    assert model.couples_examples == (norm == "batchnorm")


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("shape", [(15, 9, 3), (17,)])  # odd sizes: the last row is dropped
def test_cnn_pool_matches_flax_reduce_window_pools_and_their_gradients(pool, shape):
    image_shape = shape + (1,) * (3 - len(shape))
    x_BxHxWxC = jax.random.normal(jax.random.key(1), (3, *image_shape))
    model = _build("cnn", input_shape=shape, num_classes=2, pool=pool, channels=(2,))
    window = tuple(2 if n > 1 else 1 for n in x_BxHxWxC.shape[1:3])
    flax_pool = nnx.max_pool if pool == "max" else nnx.avg_pool

    def ours(v):
        return jnp.sum(jnp.sin(model._pool(v)))

    def reference(v):
        return jnp.sum(jnp.sin(flax_pool(v, window, strides=window, padding="VALID")))

    np.testing.assert_allclose(model._pool(x_BxHxWxC),
                               flax_pool(x_BxHxWxC, window, strides=window, padding="VALID"),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.grad(ours)(x_BxHxWxC), jax.grad(reference)(x_BxHxWxC),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("tie", [False, True])
def test_transformer_param_count_by_hand(positions, tie):
    model = nnx.eval_shape(lambda: _tiny_lm(positions=positions, tie_embeddings=tie))
    v, t, d, f, n_layers = 13, 16, 32, 128, 2
    per_block = 4 * d * d + 2 * d * f + 4 * d  # q,k,v,o; MLP; two LayerNorms
    expected = (v * d + n_layers * per_block + 2 * d + (0 if tie else d * v)
                + (t * d if positions == "learned" else 0))
    assert param_count(model) == expected
    if tie:  # untied forwards run in the causality tests
        model = _tiny_lm(positions=positions, tie_embeddings=tie)
        forward = nnx.jit(lambda m, ids: m(ids))  # compiled: op by op it took ~6 CPU-s
        assert forward(model, jnp.zeros((3, 16), jnp.int32)).shape == (3, 16, 13)
        assert forward(model, jnp.zeros((3, 5), jnp.int32)).shape == (3, 5, 13)  # < max_len


@pytest.mark.parametrize("size", list(SIZES))
def test_size_table_non_embedding_counts(size):
    v, t = 256, 64
    model = nnx.eval_shape(lambda: _build("transformer", input_shape=(t,), vocab_size=v,
                                          size=size))
    row = SIZES[size]
    d = row.d_model
    blocks = row.num_layers * (4 * d * d + 2 * d * row.d_ff + 4 * d)
    assert param_count(model) == blocks + 2 * v * d + 2 * d
    if size == "100m":
        assert 80e6 < blocks < 100e6


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_transformer_is_causal(positions):
    model = _tiny_lm(positions=positions)
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 13)
    changed = ids.at[:, 9].set((ids[:, 9] + 1) % 13)
    before, after = model(ids), model(changed)
    np.testing.assert_array_equal(np.asarray(before[:, :9]), np.asarray(after[:, :9]))
    assert float(jnp.max(jnp.abs(before[:, 9:] - after[:, 9:]))) > 1e-4


def test_positions_matter():
    """Both position schemes make the logits depend on where a token sits."""
    for positions in ("rotary", "learned"):
        model = _tiny_lm(positions=positions)
        if positions == "learned":  # the N(0, 0.02^2) table is too small to see at init
            model.pos_embed.embedding[...] = jax.random.normal(jax.random.key(2), (16, 32))
        ids = jnp.array([[3, 5, 7, 3, 5, 7, 3, 5]])
        logits = model(ids)
        assert float(jnp.max(jnp.abs(logits[0, 0] - logits[0, 3]))) > 1e-6, positions


def test_rotary_scores_depend_only_on_offset():
    q_1xTx1xK = jnp.broadcast_to(jax.random.normal(jax.random.key(3), (8,)), (1, 12, 1, 8))
    k_1xTx1xK = jnp.broadcast_to(jax.random.normal(jax.random.key(4), (8,)), (1, 12, 1, 8))
    scores_TxS = jnp.einsum("thk,shk->ts", rotary(q_1xTx1xK)[0], rotary(k_1xTx1xK)[0])
    for offset in (0, 1, 5):
        diag = np.diagonal(np.asarray(scores_TxS), offset=-offset)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-5, atol=1e-5)
    assert abs(float(scores_TxS[5, 5] - scores_TxS[5, 2])) > 1e-3


def test_classification_loss_matches_float64_reference():
    model = _build("mlp", input_shape=(6,), num_classes=4, hidden_sizes=(5,))
    graphdef, params, rest = split_model(model)
    x = jax.random.normal(jax.random.key(5), (7, 6))
    y = jnp.array([0, 1, 2, 3, 0, 1, 2], jnp.int32)
    p = _np(nnx.to_pure_dict(params))
    h = np.maximum(np.asarray(x, np.float64) @ p["layers"][0]["kernel"] + p["layers"][0]["bias"], 0)
    z = h @ p["layers"][1]["kernel"] + p["layers"][1]["bias"]
    ref_B = _logsumexp(z) - z[np.arange(7), np.asarray(y)]
    loss = make_loss_fn(graphdef, rest, "classification")(params, {"x": x, "y": y})
    # float32 forward of a 6→5→4 net against float64: a few ulps of the O(1) loss.
    np.testing.assert_allclose(float(loss), ref_B.mean(), rtol=1e-6)
    sums = make_eval_fn(graphdef, rest, "classification")(params, {"x": x, "y": y})
    np.testing.assert_allclose(float(sums["loss_sum"]), ref_B.sum(), rtol=1e-6)
    assert float(sums["correct_sum"]) == float(np.sum(z.argmax(-1) == np.asarray(y)))
    assert float(sums["count"]) == 7


def test_lm_loss_is_mean_over_positions_then_examples():
    model = _tiny_lm()
    graphdef, params, rest = split_model(model)
    x = jax.random.randint(jax.random.key(6), (3, 16), 0, 13)
    y = jnp.roll(x, -1, axis=1)
    z = np.asarray(model(x), np.float64)
    token_BxT = _logsumexp(z) - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]
    loss = make_loss_fn(graphdef, rest, "lm")(params, {"x": x, "y": y})
    np.testing.assert_allclose(float(loss), token_BxT.mean(1).mean(0), rtol=1e-6)
    sums = make_eval_fn(graphdef, rest, "lm")(params, {"x": x, "y": y})
    acc_B = (z.argmax(-1) == np.asarray(y)).mean(1)
    np.testing.assert_allclose(float(sums["correct_sum"]), acc_B.sum(), rtol=1e-6)


def test_regression_loss_and_masked_eval():
    model = _build("mlp", input_shape=(3,), hidden_sizes=(4,), activation="tanh")
    graphdef, params, rest = split_model(model)
    x = jax.random.normal(jax.random.key(7), (5, 3))
    y = jnp.linspace(-1.0, 1.0, 5)
    p = _np(nnx.to_pure_dict(params))
    h = np.tanh(np.asarray(x, np.float64) @ p["layers"][0]["kernel"] + p["layers"][0]["bias"])
    pred = (h @ p["layers"][1]["kernel"] + p["layers"][1]["bias"])[:, 0]
    ref_B = 0.5 * (pred - np.asarray(y, np.float64)) ** 2
    loss = make_loss_fn(graphdef, rest, "regression")(params, {"x": x, "y": y})
    # the loss is a small difference of O(1) terms: compare absolutely at float32 resolution.
    np.testing.assert_allclose(float(loss), ref_B.mean(), rtol=1e-5, atol=1e-7)
    padded = {"x": jnp.concatenate([x, jnp.full((3, 3), jnp.nan)]),
              "y": jnp.concatenate([y, jnp.zeros(3)]),
              "mask": jnp.array([1, 1, 1, 1, 1, 0, 0, 0])}
    sums = make_eval_fn(graphdef, rest, "regression")(params, padded)
    assert float(sums["count"]) == 5 and "correct_sum" not in sums
    np.testing.assert_allclose(float(sums["loss_sum"]), ref_B.sum(), rtol=1e-5, atol=1e-7)


def test_per_example_losses_in_float64(x64):
    """With float64 inputs the loss formulas agree with numpy float64 to 1e-12."""
    rng = np.random.default_rng(0)
    z_BxC, y_B = rng.normal(size=(5, 4)) * 3, rng.integers(0, 4, 5)
    ref_B = _logsumexp(z_BxC) - z_BxC[np.arange(5), y_B]
    got = per_example_loss(jnp.asarray(z_BxC), jnp.asarray(y_B), "classification")
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), ref_B, rtol=1e-12)
    z_BxTxV, y_BxT = rng.normal(size=(3, 4, 6)), rng.integers(0, 6, (3, 4))
    tok_BxT = _logsumexp(z_BxTxV) - np.take_along_axis(z_BxTxV, y_BxT[..., None], -1)[..., 0]
    got = per_example_loss(jnp.asarray(z_BxTxV), jnp.asarray(y_BxT), "lm")
    np.testing.assert_allclose(np.asarray(got), tok_BxT.mean(1), rtol=1e-12)
    pred_Bx1, t_B = rng.normal(size=(5, 1)), rng.normal(size=5)
    got = per_example_loss(jnp.asarray(pred_Bx1), jnp.asarray(t_B), "regression")
    np.testing.assert_allclose(np.asarray(got), 0.5 * (pred_Bx1[:, 0] - t_B) ** 2, rtol=1e-12)


def test_every_parameter_has_the_fast_per_example_path():
    """Built from cbs.models.layers, the models leave nothing to the vmap fallback, except a tied
    output head, whose embedding table is used twice."""
    x, y = jax.random.normal(jax.random.key(11), (4, 6, 6, 2)), jnp.array([0, 1, 2, 0])
    for model in (_build("mlp", input_shape=(6, 6, 2), num_classes=3),
                  *(_build("cnn", input_shape=(6, 6, 2), num_classes=3, channels=(4,),
                           dense_sizes=(), norm=norm) for norm in ("none", "layernorm",
                                                                   "groupnorm"))):
        graphdef, params, rest = split_model(model)
        loss_fn = make_loss_fn(graphdef, rest, "classification")
        assert ghost.uncovered_leaves(loss_fn, params, {"x": x, "y": y}) == {}
    ids = jax.random.randint(jax.random.key(12), (4, 8), 0, 13)
    for tie in (False, True):
        graphdef, params, rest = split_model(_tiny_lm(positions="learned", tie_embeddings=tie))
        loss_fn = make_loss_fn(graphdef, rest, "lm")
        uncovered = ghost.uncovered_leaves(loss_fn, params, {"x": ids, "y": ids})
        assert list(uncovered) == []  # a tied table: exact from the cross terms of its uses


def test_loss_fn_is_pure_and_differentiable_under_jit():
    model = _build("cnn", input_shape=(8, 8), num_classes=3, channels=(4,), dense_sizes=(),
                   norm="layernorm")
    graphdef, params, rest = split_model(model)
    batch = {"x": jax.random.normal(jax.random.key(8), (4, 8, 8)),
             "y": jnp.array([0, 1, 2, 0], jnp.int32)}
    loss_fn = make_loss_fn(graphdef, rest, "classification")
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert np.isclose(float(loss), float(loss_fn(params, batch)), rtol=1e-6)
    assert loss_fn.couples_examples is False


def test_batchnorm_couples_examples_and_ghost_batches_isolate_them():
    kw = dict(input_shape=(8, 8), num_classes=3, channels=(4,), dense_sizes=(), norm="batchnorm")
    model = _build("cnn", ghost_batch_size=2, **kw)
    assert model.couples_examples
    graphdef, params, rest = split_model(model)
    assert make_loss_fn(graphdef, rest, "classification").couples_examples
    assert not make_loss_fn(graphdef, rest, "classification", train=False).couples_examples
    assert "couples examples" in models.model_summary(model)

    x = jax.random.normal(jax.random.key(9), (4, 8, 8))
    x2 = x.at[2:].multiply(3.0)
    ghost, whole = model, _build("cnn", ghost_batch_size=0, **kw)
    np.testing.assert_array_equal(np.asarray(ghost(x)[:2]), np.asarray(ghost(x2)[:2]))
    assert float(jnp.max(jnp.abs(whole(x)[:2] - whole(x2)[:2]))) > 1e-4
    whole.eval()  # running averages: per-example again
    np.testing.assert_allclose(np.asarray(whole(x)[:2]), np.asarray(whole(x2)[:2]), rtol=1e-6)


def test_batchnorm_state_is_returned_not_mutated():
    model = _build("cnn", input_shape=(8, 8), num_classes=3, channels=(4,), dense_sizes=(),
                   norm="batchnorm", ghost_batch_size=2)
    graphdef, params, rest = split_model(model)
    before = jax.tree.map(np.asarray, rest)
    loss_fn = make_loss_fn(graphdef, rest, "classification", return_state=True)
    batch = {"x": 2.0 + jax.random.normal(jax.random.key(10), (4, 8, 8)),
             "y": jnp.zeros(4, jnp.int32)}
    (_, new_rest), _ = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, rest))
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), new_rest, before)
    assert all(v > 0 for v in jax.tree.leaves(moved))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"model\.name.*'mlp', 'cnn', 'transformer'"):
        build_model(_bad_name(), input_shape=(3,), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model\.name"):
        default_model_config("resnet")
    with pytest.raises(ValueError, match="vocab_size"):
        _build("transformer", input_shape=(8,))
    with pytest.raises(ValueError, match=r"model\.num_groups"):
        _build("cnn", input_shape=(8, 8), num_classes=2, norm="groupnorm", num_groups=3)
    with pytest.raises(ValueError, match=r"model\.hidden_sizes"):
        _build("mlp", input_shape=(3,), hidden_sizes=(4, 0))
    with pytest.raises(ValueError, match=r"model\.size"):
        _build("transformer", input_shape=(8,), vocab_size=5, size="huge")
    with pytest.raises(ValueError, match=r"model\.positions"):
        _build("transformer", input_shape=(8,), vocab_size=5, positions="alibi")
    with pytest.raises(ValueError, match="task"):
        make_loss_fn(*split_model(_build("mlp", input_shape=(3,)))[::2], "ranking")


def _bad_name():
    config = default_model_config("mlp")
    config.name = "resnet"
    return config


def test_ghost_batchnorm_against_numpy():
    from cbs.models.cnn import GhostBatchNorm

    bn = GhostBatchNorm(3, ghost_batch_size=2, momentum=0.9, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(4, 2, 2, 3)) * [1.0, 2.0, 3.0] + 5.0
    y = np.asarray(bn(jnp.asarray(x, jnp.float32)), np.float64)
    ghosts = x.reshape(2, 2, 2, 2, 3)
    mean, var = ghosts.mean(axis=(1, 2, 3), keepdims=True), ghosts.var(axis=(1, 2, 3),
                                                                          keepdims=True)
    ref = ((ghosts - mean) / np.sqrt(var + bn.bn.epsilon)).reshape(x.shape)
    # float32 normalisation of O(1) outputs: agree to a few ulps of the inputs' scale (~5).
    np.testing.assert_allclose(y, ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.bn.mean[...]), 0.1 * mean.mean(axis=(0, 1, 2, 3)),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bn.bn.var[...]),
                               0.9 + 0.1 * var.mean(axis=(0, 1, 2, 3)), rtol=1e-6)
    with pytest.raises(ValueError, match="ghost_batch_size"):
        bn(jnp.ones((3, 2, 2, 3)))


def test_registering_a_model_makes_it_buildable_from_config():
    from cbs.models import registry

    def fields():
        c = ml_collections.ConfigDict()
        c.width = 3  # hidden width
        return c

    @models.register("_test_linear", default_config=fields)
    def build(c, inputs, rngs):
        return nnx.Linear(int(np.prod(inputs.input_shape)), c.width, rngs=rngs)

    try:
        config = default_model_config("_test_linear")
        assert config.name == "_test_linear" and config.width == 3
        model = build_model(config, input_shape=(2, 2), rngs=nnx.Rngs(0), verbose=False)
        assert model.kernel[...].shape == (4, 3)
        assert "_test_linear" in models.model_names()
        with pytest.raises(ValueError, match="already registered"):
            models.register("_test_linear", default_config=fields)(build)
    finally:
        registry._MODELS.pop("_test_linear")
