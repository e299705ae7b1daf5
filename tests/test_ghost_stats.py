"""Noise statistics on the jaxpr ghost-norm path: every NoiseStats field and the per-example
norms equal the vmap reference; `value_grad_and_stats`; sharded parameters; bf16; errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_ghost import built, compiled, jitted_info, plain_mlp

from cbs.runtime import mesh as cbs_mesh
from cbs.stats import dropin, ghost, noise

FIELDS = ("mean_grad_sq_norm", "grad_sq_norm", "trace_sigma", "b_simple")
MODELS = ("nnx", "plain_cnn", "plain_mlp", "scanned_lm", "unreadable")  # test_ghost.MODELS


def _assert_stats_close(a, b, rtol):
    for name in FIELDS:
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=rtol, err_msg=name)


def _fields_and_norms(loss_fn, params, batch, method, chunk_size=None):
    """(exact by `method`, exact by vmap, per-example norms by `method`, by vmap), from one
    compiled program (each estimator's own jit is inlined into it)."""
    def run(p, b):
        return (noise.exact(loss_fn, p, b, method=method),
                noise.exact(loss_fn, p, b, method="vmap", chunk_size=chunk_size),
                noise.per_example_sq_norms(loss_fn, p, b, method=method),
                noise.per_example_sq_norms(loss_fn, p, b, method="vmap"))

    return compiled(run, params, batch)(params, batch)


@pytest.mark.parametrize("name", MODELS)
def test_every_field_float64(name, x64):
    fast, ref, norms, ref_norms = _fields_and_norms(*built(name, x64=True), "auto", 3)
    _assert_stats_close(fast, ref, 1e-10)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10)


# scanned_lm in float32 is slow (11 CPU-s); its float64 test above checks the same fields exactly
@pytest.mark.parametrize("name", ["plain_mlp", pytest.param("scanned_lm", marks=pytest.mark.slow)])
def test_every_field_float32(name):
    # Here b_simple is ~B, so Σ|g_i|² − B|ḡ|² loses about 2ε relatively: 1e-5 holds.
    fast, ref, norms, ref_norms = _fields_and_norms(*built(name, x64=False), "fast")
    assert float(ref.b_simple) > 1.0
    _assert_stats_close(fast, ref, 1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)


def test_value_grad_and_stats_is_value_and_grad_plus_stats(x64):
    loss_fn, params, batch = built("scanned_lm", x64=True)
    run = lambda p, b: (dropin.value_grad_and_stats(loss_fn, groups="auto")(p, b),
                        jax.value_and_grad(loss_fn)(p, b),
                        noise.exact(loss_fn, p, b, method="vmap", groups="auto"))
    (loss, grads, stats), (ref_loss, ref_grads), ref = compiled(run, params, batch)(params,
                                                                                   batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    _assert_stats_close(stats, ref, 1e-10)
    for group in ref.groups:
        _assert_stats_close(stats.groups[group], ref.groups[group], 1e-10)


@functools.cache
def _one_device():
    """scanned_lm at B = 8 and its value_grad_and_stats on one device (both modes' reference)."""
    loss_fn, params, batch = built("scanned_lm", x64=False)
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[:2]]), batch)  # B = 8
    return loss_fn, params, batch, compiled(dropin.value_grad_and_stats(loss_fn), params,
                                            batch)(params, batch)


@pytest.mark.parametrize("mode", ["fsdp", "model"])
def test_sharded_equals_one_device(mode):
    loss_fn, params, batch, one = _one_device()
    mesh = cbs_mesh.make_mesh(data=4, model=2)
    sharded_params = cbs_mesh.shard(params, cbs_mesh.param_shardings(params, mesh, mode,
                                                                      min_size=1))
    sharded_batch = jax.device_put(batch, cbs_mesh.batch_sharding(mesh))
    assert any(not s.is_fully_replicated for s in
               jax.tree.leaves(jax.tree.map(lambda x: x.sharding, sharded_params)))
    many = compiled(dropin.value_grad_and_stats(loss_fn), sharded_params, sharded_batch)(
        sharded_params, sharded_batch)
    np.testing.assert_allclose(many[0], one[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(many[1]), jax.tree.leaves(one[1]), strict=True):
        # float32 sums in another order: errors scale with the leaf's largest entries
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    _assert_stats_close(many[2], one[2], 1e-5)


def test_explicit_mesh_axes():
    loss_fn, params, batch = plain_mlp()
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[:2]]), batch)
    reference = jitted_info(loss_fn, "vmap")(params, batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
        out = jax.jit(dropin.value_grad_and_stats(loss_fn, method="fast"))(params, sharded)
    np.testing.assert_allclose(out[2].b_simple,
                               noise.exact(loss_fn, params, batch, method="vmap").b_simple,
                               rtol=1e-5)
    fast = jitted_info(loss_fn, "fast")
    with jax.set_mesh(mesh):
        norms = fast(params, sharded)[2]
    for a, b in zip(jax.tree.leaves(norms), jax.tree.leaves(reference[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_bf16_params_accumulate_in_float32():
    loss_fn, params, batch = built("scanned_lm", x64=False)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)  # scanned_lm(dtype=bf16)
    assert ghost.uncovered_leaves(loss_fn, params, batch) == {}
    # The reference: the same bf16 forward pass, per-example gradients in float32.
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    loss32 = lambda p, b: loss_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), b)
    run = lambda p, p32, b: (
        ghost.per_example_grads_info(loss_fn, p, b, method="fast")[2],
        ghost.per_example_grads_info(loss32, p32, b, method="vmap")[2])
    fast, ref = compiled(run, params, params32, batch)(params, params32, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fast))
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2)  # bf16 cotangents: 8 mantissa bits


def test_auto_chunk_never_holds_all_gradients_of_a_large_model():
    params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((256, 4096), jnp.float32)}
    chunk = ghost.vmap_chunk_size(params, batch)
    assert 1 <= chunk < 256
    assert chunk * 3 * 4096 * 4096 * 4 <= ghost.MEMORY_BUDGET_BYTES
    small = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    narrow = {"x": jax.ShapeDtypeStruct((256, 4), jnp.float32)}
    assert ghost.vmap_chunk_size(small, narrow) == 256  # small model, small examples: one chunk


def test_bad_input_on_the_new_path():
    loss_fn, params, batch = plain_mlp()
    vgs = dropin.value_grad_and_stats(loss_fn)
    with pytest.raises(ValueError, match="B=1 is too small"):
        vgs(params, jax.tree.map(lambda x: x[:1], batch))
    with pytest.raises(ValueError, match="same leading"):
        vgs(params, {"x": batch["x"], "y": batch["y"][:3]})
    with pytest.raises(ValueError, match="floating-point"):
        vgs({**params, "step": jnp.zeros((), jnp.int32)}, batch)
    per_example = lambda p, b: loss_fn(p, b) * jnp.ones(b["x"].shape[0])
    with pytest.raises(ValueError, match="must return a scalar"):
        dropin.value_grad_and_stats(per_example)(params, batch)
    with pytest.raises(ValueError, match="method"):
        dropin.value_grad_and_stats(loss_fn, method="ghost")
    summed = lambda p, b: loss_fn(p, b) * b["x"].shape[0]  # a sum over the batch, not a mean
    for call in (dropin.value_grad_and_stats(summed), functools.partial(noise.exact, summed)):
        with pytest.raises(ValueError, match="SUM over the batch"):
            call(params, batch)


def test_a_new_closure_over_a_checked_program_is_not_value_checked_again(monkeypatch):
    """The value checks run once per program (jaxpr and constants): a second closure over the
    same loss skips them; a summed loss is a different program and is refused every time."""
    from cbs.stats import loss_checks

    loss_fn, params, batch = plain_mlp()
    calls = []
    sample = loss_checks._sample_losses
    monkeypatch.setattr(loss_checks, "_sample_losses",
                        lambda *a: calls.append(1) or sample(*a))
    monkeypatch.setattr(loss_checks, "_PASSED_PROGRAMS", {})
    for _ in range(2):
        loss_checks.check_loss_fn(lambda p, b: loss_fn(p, b), params, batch)
    assert len(calls) == 1
    scaled = jax.tree.map(lambda x: 2 * x, params)  # other inputs, the same program
    loss_checks.check_loss_fn(lambda p, b: loss_fn(p, b), scaled, batch)
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="SUM over the batch"):
            loss_checks.check_loss_fn(lambda p, b: loss_fn(p, b) * b["x"].shape[0], params,
                                      batch)
    assert len(calls) == 3
