"""cbs.stats.ghost, fused layers: where a layer's per-example gradients are formed for their
norms (the direct form), its weight gradient is their sum. Gradient and norms must equal the
ordinary gradient and the vmap reference in every layout a `dot_general` or a convolution
can take: the parameter on either side, several contracting axes, NCHW/OIHW kernels, strides
and asymmetric padding, inside `lax.scan`, and in bfloat16 with float32 accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs.stats import ghost
from cbs.stats.ghost_rules import fuse_direct

B = 4


def _layouts_model(dtype):
    """Every layer has T ≥ 9 positions and small D·O, so every kernel takes the fused path."""
    k = jax.random.split(jax.random.key(1), 8)
    n = lambda i, shape, s=0.3: (s * jax.random.normal(k[i], shape)).astype(dtype)
    params = {"conv_nchw": n(0, (3, 2, 3, 3)),  # OIHW
              "conv_nhwc": n(1, (2, 3, 3, 4)),  # HWIO
              "left": n(2, (5, 4)),  # [O, D]: the parameter is dot_general's lhs
              "two_axes": n(3, (5, 2, 6)),  # contracts two axes of the data
              "scanned": n(4, (2, 6, 6)),  # read one slice per scan step
              "head": n(5, (6, 3))}

    def loss_fn(p, batch):
        x = batch["x"]  # [B, 2, 8, 8] NCHW
        h = jax.lax.conv_general_dilated(x, p["conv_nchw"], (2, 1), ((1, 0), (0, 1)),
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        h = jnp.tanh(jnp.transpose(h, (0, 2, 3, 1)))  # [B, 4, 8, 3] NHWC
        h = jax.lax.conv_general_dilated(h, p["conv_nhwc"], (1, 2), ((0, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h.reshape(h.shape[0], -1, 4))  # [B, T, 4]
        h = jnp.tanh(jnp.einsum("od,btd->bto", p["left"], h))  # [B, T, 5]
        h2 = h[..., None] * jnp.asarray([1.0, -0.5], dtype)  # [B, T, 5, 2]
        h = jnp.tanh(jnp.einsum("btkc,kco->bto", h2, p["two_axes"]))  # [B, T, 6]

        def body(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, h, p["scanned"])
        logits = jnp.mean(h, axis=1) @ p["head"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], -1))

    x = jax.random.normal(k[6], (B, 2, 8, 8)).astype(dtype)
    return loss_fn, params, {"x": x, "y": jnp.arange(B) % 3}


def _fused_leaves(loss_fn, params, batch):
    plan = ghost._plan(loss_fn, params, batch)
    paths = list(params)  # a flat dict: leaf i is the i-th key in sorted order
    return {sorted(paths)[leaf] for leaf, us in plan.uses.items() if us[0].uid in plan.fused}


def _info(loss_fn, method):
    return jax.jit(lambda p, b: ghost.per_example_grads_info(loss_fn, p, b, method=method))


def test_every_layout_is_fused_and_equals_the_reference_in_float64(x64):
    loss_fn, params, batch = _layouts_model(jnp.float64)
    assert _fused_leaves(loss_fn, params, batch) == {"conv_nchw", "conv_nhwc", "left",
                                                     "two_axes", "scanned"}
    loss, grad, sq = _info(loss_fn, "fast")(params, batch)
    ref_loss, ref_grad, ref_sq = _info(loss_fn, "vmap")(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    for name in params:
        np.testing.assert_allclose(grad[name], ref_grad[name], rtol=1e-10,
                                   atol=1e-12 * float(jnp.max(jnp.abs(ref_grad[name]))))
        np.testing.assert_allclose(sq[name], ref_sq[name], rtol=1e-10)
        assert float(jnp.min(sq[name])) > 0  # every norm is read, not a zero


@pytest.mark.parametrize("devices", [1, 2])  # contiguous or interleaved chunks
@pytest.mark.parametrize("fused", [True, False])
def test_convolutions_in_chunks_of_examples_equal_the_reference_in_float64(
        x64, monkeypatch, fused, devices):
    """The convolutions' per-example work in 2 chunks of 2 examples (as on XLA:CPU,
    `ghost_rules.example_chunk`; interleaved where there are several devices), fused
    (gradient and norms) or norms only (the tapped rule, with `fuse_direct` refused): the
    same as the vmap reference."""
    from cbs.stats import ghost_rules

    monkeypatch.setattr(jax, "device_count", lambda: devices)
    chunks = []
    monkeypatch.setattr(ghost_rules, "example_chunk", lambda b, _: chunks.append(b) or 2)
    if not fused:
        monkeypatch.setattr(ghost_rules, "fuse_direct", lambda *_: False)
    loss_fn, params, batch = _layouts_model(jnp.float64)
    assert ("conv_nhwc" in _fused_leaves(loss_fn, params, batch)) == fused
    _, grad, sq = _info(loss_fn, "fast")(params, batch)
    assert chunks and set(chunks) == {B}  # asked with the whole batch (plan and pass)
    _, ref_grad, ref_sq = _info(loss_fn, "vmap")(params, batch)
    for name in ("conv_nchw", "conv_nhwc"):
        np.testing.assert_allclose(grad[name], ref_grad[name], rtol=1e-10,
                                   atol=1e-12 * float(jnp.max(jnp.abs(ref_grad[name]))))
        np.testing.assert_allclose(sq[name], ref_sq[name], rtol=1e-10)
        assert len(set(np.asarray(sq[name]).tolist())) == B  # each example its own norm


def test_example_chunk_divides_the_batch_on_cpu_only(monkeypatch):
    from cbs.stats import ghost_rules

    mib = 2**20
    monkeypatch.setattr(ghost_rules, "CPU_CHUNK_BYTES", 2 * mib)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    per_example = 4 * 196 * (144 + 32)  # the default CNN's second convolution: 138 kB
    assert ghost_rules.example_chunk(128, per_example) == 8  # 15 fit: the largest divisor
    assert ghost_rules.example_chunk(8, per_example) == 8  # all fit: one chunk
    assert ghost_rules.example_chunk(127, per_example) == 127  # prime: no divisor 3..15
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    assert ghost_rules.example_chunk(128, per_example) == 8  # a multiple of the devices
    monkeypatch.setattr(jax, "device_count", lambda: 16)
    assert ghost_rules.example_chunk(128, per_example) == 128  # none: one chunk
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert ghost_rules.example_chunk(128, per_example) == 128


def test_scan_chunks_interleaves_and_sums():
    from cbs.stats.examples import scan_chunks

    xs = jnp.arange(12.0).reshape(6, 2)
    seen = []
    fn = lambda x: (seen.append(x) or jnp.sum(x, 0), jnp.sum(x, 1))
    for interleave in (True, False):
        total, per = scan_chunks(fn, (xs,), 2, interleave=interleave)
        np.testing.assert_allclose(total, xs.sum(0))
        np.testing.assert_allclose(per, xs.sum(1))
        assert seen[-1].shape == (2, 2)
    np.testing.assert_allclose(jax.jit(lambda x: scan_chunks(
        lambda c: (c[0], c[:, 0]), (x,), 2, interleave=False)[0])(xs), xs[0] + xs[2] + xs[4])
    np.testing.assert_allclose(jax.jit(lambda x: scan_chunks(
        lambda c: (c[0], c[:, 0]), (x,), 2)[0])(xs), xs[0] + xs[1] + xs[2])
    with pytest.raises(ValueError, match="does not divide"):
        scan_chunks(fn, (xs,), 4)


def test_bfloat16_layers_accumulate_in_float32():
    """bfloat16 operands, float32 accumulation: within bfloat16 rounding of the float32
    model's gradient and norms (relative 2⁻⁸ per operand, a few percent after the layers)."""
    loss_fn, params, batch = _layouts_model(jnp.bfloat16)
    assert _fused_leaves(loss_fn, params, batch)
    _, grad, sq = _info(loss_fn, "fast")(params, batch)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                       (params, batch))
    _, ref_grad, ref_sq = _info(loss_fn, "vmap")(*f32)
    for name in params:
        assert grad[name].dtype == jnp.bfloat16 and sq[name].dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(ref_grad[name])))
        np.testing.assert_allclose(np.asarray(grad[name], np.float32), ref_grad[name],
                                   atol=0.05 * scale)
        np.testing.assert_allclose(sq[name], ref_sq[name], rtol=0.1)


@pytest.mark.parametrize("b,t,d,o,fused", [
    (32, 1, 64, 64, False),  # one position: the outer rule
    (32, 128, 32, 32, True),  # a sequence layer
    (128, 784, 9, 16, True),  # a first convolution
    (64, 4, 4096, 4096, False),  # few positions, large D·O: Gram form
    (4096, 64, 1024, 1024, False),  # [B, D, O] past the memory bound
])
def test_fuse_direct_by_shape(b, t, d, o, fused):
    assert fuse_direct(b, t, d, o) is fused


def test_a_bias_broadcast_through_unit_axes_takes_its_rule_not_the_materialised_path():
    """A bias [O] read as [1, 1, O] (a reshape: the norm is kept) takes its ghost rule in the
    backward pass, not the per-example gradients of the materialised path; one read through
    a broadcast that repeats it ([3] -> [5, 3]) still needs them."""
    params = {"b": jnp.ones((3,)), "r": jnp.ones((3,))}

    def loss_fn(p, batch):
        h = batch["x"] + p["b"][None, None, :]  # [B, T, 3]
        h = h * jnp.broadcast_to(p["r"], (5, 3))[None]  # repeated over the 5 positions
        return jnp.mean(jnp.square(h))

    batch = {"x": jax.random.normal(jax.random.key(0), (B, 5, 3))}
    plan = ghost._plan(loss_fn, params, batch)
    tapped = {leaf for leaf, us in plan.uses.items() if us[0].uid in plan.tapped}
    assert tapped == {0}  # "b"; "r" is repeated before its use
    fast = _info(loss_fn, "fast")(params, batch)
    ref = _info(loss_fn, "vmap")(params, batch)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_biases_and_scales_are_fused_with_the_sign_of_a_subtraction(x64):
    """Biases and norm scales broadcast through unit axes (`add`, `mul`, `sub` with the
    parameter on either side, one inside `lax.scan`) take their gradient as the sum of the
    per-example gradients formed for their norms: equal to the ordinary gradient and the vmap
    reference at 1e-10 in float64, and a subtracted parameter keeps its sign."""
    k = jax.random.split(jax.random.key(2), 6)
    params = {"bias": jax.random.normal(k[0], (3,)), "scale": 1 + jax.random.normal(k[1], (3,)),
              "shift": jax.random.normal(k[2], (3,)), "minus": jax.random.normal(k[3], (3,)),
              "stacked": jax.random.normal(k[4], (2, 3))}

    def loss_fn(p, batch):
        h = batch["x"] + p["bias"][None, None, :]  # [B, T, 3]
        h = jnp.tanh(h) * p["scale"][None, None, :]
        h = p["shift"][None, None, :] - jnp.tanh(h)  # parameter on the lhs of a sub
        h = jnp.tanh(h) - p["minus"][None, None, :]  # ... and on the rhs

        def body(h, b):
            return jnp.tanh(h + b[None, None, :]), None

        h, _ = jax.lax.scan(body, h, p["stacked"])
        return jnp.mean(jnp.square(h - 0.3))

    batch = {"x": jax.random.normal(k[5], (B, 5, 3), jnp.float64)}
    assert _fused_leaves(loss_fn, params, batch) == set(params)
    loss, grad, sq = _info(loss_fn, "fast")(params, batch)
    ref_loss, ref_grad, ref_sq = _info(loss_fn, "vmap")(params, batch)
    plain = jax.grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
    for name in params:
        np.testing.assert_allclose(grad[name], plain[name], rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(grad[name], ref_grad[name], rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(sq[name], ref_sq[name], rtol=1e-10)


@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 7, 10])
def test_map_and_sum_leaves_padding_out_of_the_sum(chunk):
    """7 examples in chunks of 1, 2, 3 (padded with 2 copies of the last), 7 or all: the
    stacked outputs and the sum equal a plain loop."""
    from cbs.stats.examples import map_and_sum

    xs = jnp.arange(7.0)[:, None] * jnp.ones((7, 3)) + jnp.arange(3.0)
    fn = lambda x: (jnp.sum(x), jnp.outer(x, x))
    outs, total = map_and_sum(fn, xs, chunk)
    np.testing.assert_allclose(outs, xs.sum(1))
    np.testing.assert_allclose(total, sum(np.outer(x, x) for x in np.asarray(xs)), rtol=1e-6)


def test_tied_embedding_gradient_is_the_sum_of_its_per_example_gradients(x64, monkeypatch):
    """A table read twice (a gather and the output projection) on the materialised path
    (forced here: `ghost_tied` reads this pair, tests/test_ghost_tied.py): its gradient, now
    the sum of the per-example gradients formed for its norms (the uses hold it constant in
    the ordinary backward), equals the ordinary gradient, also when the examples are taken
    in padded chunks."""
    from cbs.stats import ghost_tied

    monkeypatch.setattr(ghost_tied, "FORM", "materialised")
    k = jax.random.split(jax.random.key(2), 3)
    params = {"embed": jax.random.normal(k[0], (11, 4), jnp.float64),
              "mix": jax.random.normal(k[1], (4, 4), jnp.float64) / 2}

    def loss_fn(p, batch):
        h = jnp.tanh(p["embed"][batch["ids"]] @ p["mix"])  # [B, T, 4]
        logits = h @ p["embed"].T
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

    batch = {"ids": jax.random.randint(k[2], (7, 5), 0, 11), "y": jnp.arange(35).reshape(7, 5) % 11}
    plan = ghost._plan(loss_fn, params, batch)
    assert len(plan.uses[0]) == 2 and plan.uses[0][0].uid not in plan.tapped
    assert not plan.tied
    ref_loss, ref_grad = jax.value_and_grad(loss_fn)(params, batch)
    ref_sq = _info(loss_fn, "vmap")(params, batch)[2]
    for chunk in (None, 3):
        loss, grad, sq = jax.jit(lambda p, b, c=chunk: ghost.per_example_grads_info(
            loss_fn, p, b, method="fast", chunk_size=c))(params, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
        for name in params:
            np.testing.assert_allclose(grad[name], ref_grad[name], rtol=1e-10, atol=1e-14)
            np.testing.assert_allclose(sq[name], ref_sq[name], rtol=1e-10)
