"""Tests for cbs.runtime.mesh on 8 fake CPU devices: mesh shapes, sharding rules, and sharded jitted
loss and gradients equal to the single-device results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from cbs.models import build_model, default_model_config, make_loss_fn, split_model
from cbs.runtime import mesh as cmesh


def test_make_mesh_shapes_and_axis_types():
    m = cmesh.make_mesh()
    assert dict(m.shape) == {"data": 8, "model": 1}
    assert tuple(m.axis_types) == (AxisType.Auto, AxisType.Auto)
    m = cmesh.make_mesh(model=2)
    assert dict(m.shape) == {"data": 4, "model": 2} and cmesh.data_replicas(m) == 4
    assert dict(cmesh.make_mesh(2, 1, devices=jax.devices()[:2]).shape) == {"data": 2, "model": 1}
    with pytest.raises(ValueError, match=r"mesh\.model"):
        cmesh.make_mesh(model=3)
    with pytest.raises(ValueError, match=r"mesh\.data"):
        cmesh.make_mesh(data=3, model=2)


def test_batch_and_replicated_shardings():
    m = cmesh.make_mesh(model=2)
    x = cmesh.shard(jnp.arange(16.0).reshape(8, 2), cmesh.batch_sharding(m))
    assert x.sharding.spec == P("data")
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2)}
    r = cmesh.shard(jnp.ones(3), cmesh.replicated(m))
    assert r.sharding.is_fully_replicated
    g = cmesh.global_batch({"x": np.arange(8.0)}, m)["x"]
    assert g.sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(g), np.arange(8.0))


def test_param_sharding_rules():
    m = cmesh.make_mesh(model=2)
    tree = {"big": jax.ShapeDtypeStruct((6, 64), jnp.float32),
            "tall": jax.ShapeDtypeStruct((64, 6), jnp.float32),
            "odd": jax.ShapeDtypeStruct((63, 65), jnp.float32),
            "small": jax.ShapeDtypeStruct((4, 4), jnp.float32),
            "bias": jax.ShapeDtypeStruct((64,), jnp.float32)}
    fsdp = cmesh.param_shardings(tree, m, "fsdp", min_size=64)
    assert fsdp["big"].spec == P(None, "model") and fsdp["tall"].spec == P("model", None)
    assert fsdp["odd"].spec == P() and fsdp["small"].spec == P()
    assert fsdp["bias"].spec == P("model")
    col = cmesh.param_shardings(tree, m, "model")
    assert col["big"].spec == P(None, "model") and col["tall"].spec == P(None, "model")
    assert col["odd"].spec == P() and col["bias"].spec == P()
    assert all(s.spec == P() for s in jax.tree.leaves(cmesh.param_shardings(tree, m)))
    with pytest.raises(ValueError, match="param_mode"):
        cmesh.param_shardings(tree, m, "zero3")


def _model_and_batch(name):
    key_x, key_y = jax.random.split(jax.random.key(0))
    if name == "transformer":
        config = default_model_config("transformer")
        config.update(num_layers=1, positions="learned")
        model = build_model(config, input_shape=(8,), vocab_size=16, rngs=nnx.Rngs(0),
                            verbose=False)
        x = jax.random.randint(key_x, (8, 8), 0, 16)
        return model, "lm", {"x": x, "y": jnp.roll(x, -1, axis=1)}
    config = default_model_config(name)
    if name == "cnn":
        config.update(channels=(4, 8), dense_sizes=(8,), norm="layernorm")
        shape = (8, 8, 2)
    else:
        config.hidden_sizes = (32, 16)
        shape = (12,)
    model = build_model(config, input_shape=shape, num_classes=4, rngs=nnx.Rngs(0),
                        verbose=False)
    return model, "classification", {"x": jax.random.normal(key_x, (8, *shape)),
                                      "y": jax.random.randint(key_y, (8,), 0, 4)}


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_sharded_loss_and_grads_equal_single_device(name):
    model, task, batch = _model_and_batch(name)
    graphdef, params, rest = split_model(model)
    step = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, rest, task)))
    loss_1, grads_1 = step(params, batch)

    m = cmesh.make_mesh(data=4, model=2)
    sharded_batch = cmesh.shard(batch, cmesh.batch_sharding(m))
    for mode in cmesh.PARAM_MODES:
        shardings = cmesh.param_shardings(params, m, mode, min_size=64)
        sharded = cmesh.shard(params, shardings)
        if mode != "replicated":  # the check must see parameters that are really split
            assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
        loss_8, grads_8 = step(sharded, sharded_batch)
        # float32 sums in a different order across devices: a few ulps of O(1) values.
        np.testing.assert_allclose(float(loss_8), float(loss_1), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.tree.map(np.asarray, grads_8), jax.tree.map(np.asarray, grads_1))


def test_named_modes_match_rules_and_check_divisibility():
    m = cmesh.make_mesh(data=4, model=2)
    tree = {"blocks": {"wq": jax.ShapeDtypeStruct((3, 16, 8), jnp.float32),
                       "wo": jax.ShapeDtypeStruct((3, 8, 16), jnp.float32),
                       "mlp_norm": jax.ShapeDtypeStruct((3, 16), jnp.float32)},
            "embed": jax.ShapeDtypeStruct((10, 16), jnp.float32),
            "other": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    s = cmesh.param_shardings(tree, m, "fsdp_tp")
    assert s["blocks"]["wq"].spec == P(None, "data", "model")
    assert s["blocks"]["wo"].spec == P(None, "model", "data")
    assert s["blocks"]["mlp_norm"].spec == P(None, None)
    assert s["embed"].spec == P("model", "data")  # V = 10 over 2, D = 16 over 4
    assert s["other"].spec == P()  # no rule: replicated
    tp = cmesh.param_shardings(tree, m, "tp")
    assert tp["blocks"]["wq"].spec == P(None, None, "model")
    odd = cmesh.param_shardings({"wq": jax.ShapeDtypeStruct((6, 5), jnp.float32)}, m, "fsdp_tp")
    assert odd["wq"].spec == P(None, None)  # 6 % 4 and 5 % 2: both axes stay whole
