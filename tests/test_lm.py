"""cbs.models.lm on 8 fake CPU devices: the scanned blocks equal a loop over layers, remat
changes nothing, and the full train step (accumulation, in-step two-batch estimate and exact
measurement) under FSDP, FSDP × TP and TP shardings equals one device; no recompilation;
bf16 compute keeps float32 parameters and optimizer state; the device counter is exact past
int32 at 3·10¹² tokens."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from cbs import models
from cbs.engine import state as counts
from cbs.engine import trainer
from cbs.models import lm
from cbs.runtime import mesh as mesh_lib
from experiments.configs import lm_shakespeare

T, V = 16, 80


def _model(remat="none", dtype="float32", **kw):
    c = models.default_model_config("lm")
    c.update(remat=remat, compute_dtype=dtype, **kw)
    return models.build_model(c, input_shape=(T,), vocab_size=V, rngs=nnx.Rngs(0),
                              verbose=False)


def _batch(b=8, seed=1):
    x = jax.random.randint(jax.random.key(seed), (b, T + 1), 0, V)
    return {"x": x[:, :-1], "y": x[:, 1:]}


def test_scan_equals_loop_over_layers_and_remat_changes_nothing():
    model = _model()
    ids = _batch()["x"]
    h = jnp.take(model.embed[...], ids, axis=0)
    graphdef, stacked = nnx.split(model.blocks)
    for i in range(model.num_layers):  # layer i = slice i of every stacked parameter
        h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))(h)
    h = lm.rms_norm(h, model.final_norm[...])
    np.testing.assert_allclose(model(ids), h @ model.embed[...].T, rtol=1e-5, atol=1e-5)
    assert jax.tree.leaves(stacked)[0].shape[0] == model.num_layers

    batch = _batch()
    results = []
    for remat in lm.REMAT_POLICIES:
        graphdef, params, rest = models.split_model(_model(remat))
        fn = jax.jit(jax.value_and_grad(models.make_loss_fn(graphdef, rest, "lm")))
        results.append(jax.tree.map(np.asarray, fn(params, batch)))
    for other in results[1:]:  # recomputation is the same float32 arithmetic
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                     other, results[0])
    with pytest.raises(ValueError, match="model.remat"):
        _model("sometimes")


def test_named_rules_shard_lm_parameters_and_optimizer_state():
    mesh = mesh_lib.make_mesh(data=4, model=2)
    graphdef, params, _ = models.split_model(nnx.eval_shape(lambda: _model()))
    specs = {mesh_lib.path_name(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        mesh_lib.param_shardings(params, mesh, "fsdp_tp"))[0]}
    assert specs["blocks/wq"] == P(None, "data", "model")  # [L, D, D]: layer axis whole
    assert specs["blocks/w_down"] == P(None, "model", "data")
    assert specs["blocks/attn_norm"] == P(None, None)
    assert specs["embed"] == P("model", "data")  # [V, D]: V = 80 over 2, D = 32 over 4
    tp = {mesh_lib.path_name(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        mesh_lib.param_shardings(params, mesh, "tp"))[0]}
    assert tp["blocks/w_gate"] == P(None, None, "model") and tp["blocks/wo"] == P(
        None, "model", None)
    mu = optax.adam(1.0).init(params)[0].mu
    mu_specs = {mesh_lib.path_name(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        mesh_lib.param_shardings(mu, mesh, "fsdp_tp"))[0]}
    assert mu_specs["blocks/wq"] == specs["blocks/wq"]
    odd = jax.ShapeDtypeStruct((3, 5), jnp.float32)  # indivisible axes stay whole
    assert mesh_lib.named_spec("blocks/wq", odd.shape, mesh) == P(None, None)


def _config(remat: str, param_mode: str, dtype: str = "float32", data: int = 1):
    c = lm_shakespeare.get_config("tiny")
    c.data.options.seq_len = T
    c.model.remat, c.model.compute_dtype = remat, dtype
    c.mesh.param_mode = param_mode
    c.batch.micro_batch = 16 // data  # m per replica: A = 2 accumulation steps on any mesh
    c.batch.schedule.batch_size = 32  # B
    c.noise.every, c.noise.in_step, c.noise.method = 2, True, "auto"  # ghost norms
    c.noise.batch_size = 32  # the exact measurement sees the whole logical batch
    return c


_RUNS: dict = {}


def _run(config, mesh, steps=3):
    key = (config.to_json(), tuple(mesh.shape.items()), steps)
    if key in _RUNS:
        return _RUNS[key]
    tr = trainer.Trainer(config, None, mesh=mesh)
    state, out, e = tr.init_state(), [], 0
    b = config.batch.schedule.batch_size
    for t in range(steps):  # the trainer's dispatch: the step, measuring when due
        state, values = tr.measurement.step(state, tr.inputs(e, b), tr.accum_steps(b), t)
        out.append(tr.measurement.fields(t, jax.device_get(values)))
        e += b
    sharded = not all(s.is_fully_replicated for s in jax.tree.leaves(tr.state_sharding.params))
    _RUNS[key] = ((tr.measurement.num_compilations(), sharded), jax.device_get(state), out)
    return _RUNS[key]


def _assert_close(a, b, rtol, atol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol),
                 jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))


def _assert_metrics_close(got, want, keys=None):
    for m, w in zip(got, want, strict=True):
        assert m.keys() == w.keys()
        # float32 sums in another order across devices; b_simple divides two noisy sums.
        for k in [k for k in keys or m if k in m]:  # a measured key only on measured steps
            np.testing.assert_allclose(m[k], w[k], rtol=2e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("data,model,mode,remat", [
    pytest.param(8, 1, "fsdp_tp", "full", marks=pytest.mark.slow),  # FSDP over 8 replicas
    pytest.param(4, 2, "fsdp_tp", "dots", marks=pytest.mark.xdist_group("lm_fsdp_tp")),
    # tensor parallel, parameters replicated over data (FSDP × TP above splits the same axes)
    pytest.param(4, 2, "tp", "none", marks=pytest.mark.slow),
])
def test_sharded_step_equals_one_device(data, model, mode, remat):
    """Everything that is a function of the logical batch (loss, update, exact statistics)
    equals one device; the live estimate (two-batch where it runs, whose small batches are
    per-replica chunks) equals the same data axis with unsharded parameters."""
    one = mesh_lib.make_mesh(1, 1, devices=jax.devices()[:1])
    mesh = mesh_lib.make_mesh(data, model)
    _, state_1, metrics_1 = _run(_config("none", "replicated"), one)
    (compilations, sharded), state, metrics = _run(_config(remat, mode, data=data), mesh)
    _, _, metrics_rep = _run(_config("none", "replicated", data=data), mesh)
    assert compilations <= 2  # three steps: one program, and one for the measured steps
    #                          where the live statistics are not the measurement
    assert sharded  # the check sees parameters that are really split
    logical = [k for k in metrics_1[0] if not k.startswith(("noise/live_", "noise/ema_"))]
    assert "noise/b_simple" in logical and "noise/measured_ema_b_simple" in logical
    assert np.isfinite(metrics_1[0]["noise/b_simple"])
    _assert_metrics_close(metrics, metrics_1, logical)
    _assert_metrics_close(metrics, metrics_rep)
    _assert_close(state.params, state_1.params, 2e-5, 2e-6)
    _assert_close(state.opt_state, state_1.opt_state, 2e-4, 1e-8)
    assert counts.count_to_int(state.examples_seen) == 3 * 32


@pytest.mark.xdist_group("lm_fsdp_tp")  # reuses the float32 FSDP × TP run of the test above
def test_bf16_compute_keeps_float32_parameters_and_optimizer_state():
    mesh = mesh_lib.make_mesh(4, 2)
    _, state, metrics = _run(_config("dots", "fsdp_tp", "bfloat16", data=4), mesh)
    _, _, metrics_32 = _run(_config("dots", "fsdp_tp", data=4), mesh)
    floats = [x for x in jax.tree.leaves((state.params, state.opt_state, state.noise_ema))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    assert all(isinstance(v, (int, float)) for v in metrics[0].values())  # one f32 vector
    # bf16 has an 8-bit mantissa: the loss agrees to its rounding (~0.4 % per op, averaged).
    assert metrics[0]["train/loss"] == pytest.approx(metrics_32[0]["train/loss"], rel=1e-2)


def test_counter_and_learning_rate_at_three_trillion_tokens():
    """A step starting at 3·10¹² tokens (E = 3e12/T sequences > 2^31) counts exactly and
    reads the learning rate there."""
    c = _config("none", "replicated")
    c.optim.warmup_examples = 2**31  # warmup past int32, in sequences
    c.optim.decay, c.optim.final_fraction = "cosine", 0.1
    c.optim.total_examples = 10**12 // T * 15  # 1.5·10¹³ tokens
    c.noise.every = 0
    tr = trainer.Trainer(c, None, mesh=mesh_lib.make_mesh(1, 1, devices=jax.devices()[:1]))
    e0 = 3 * 10**12 // T
    state = tr.init_state().replace(examples_seen=counts.count_from_int(e0))
    b = c.batch.schedule.batch_size
    state, metrics = tr.step(state, tr.inputs(0, b), tr.accum_steps(b))
    assert counts.count_to_int(state.examples_seen) == e0 + b
    w, total = float(2**31), float(c.optim.total_examples)
    p = (e0 + b - w) / (total - w)
    expected = c.optim.learning_rate * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))
    assert float(metrics["opt/lr"]) == pytest.approx(expected, rel=1e-5)


def test_count_words_are_exact_and_carry():
    n = 3 * 10**12
    count = counts.count_from_int(n)
    assert count.dtype == jnp.int32 and counts.count_to_int(count) == n
    add = jax.jit(counts.count_add)
    c = counts.count_from_int(counts.COUNT_BASE - 1)
    for _ in range(3):  # carries across the low word
        c = add(c, 2**29 + 3)
    assert counts.count_to_int(c) == counts.COUNT_BASE - 1 + 3 * (2**29 + 3)
    big = counts.count_from_int(2**61 - 2**31)
    assert counts.count_to_int(add(big, 2**29)) == 2**61 - 2**31 + 2**29
    assert float(counts.count_value(count)) == pytest.approx(n, rel=1e-7)
    assert 0 <= int(counts.count_int32(count)) < 2**31
    with pytest.raises(ValueError, match="examples seen"):
        counts.count_from_int(-1)


def test_flops_formula_matches_parameter_count():
    """6·N per token for the matmul parameters (tied head counted once as D·V)."""
    model = _model(num_layers=3)
    s = lm.resolve_size(models.default_model_config("lm"))
    n_matmul = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param))[0] if "norm" not in mesh_lib.path_name(path))
    flops = lm.lm_flops_per_token(s.d_model, 3, s.d_ff, V, seq_len=T)
    assert flops == 6 * n_matmul + 6 * 3 * T * s.d_model


def test_attention_kernel_auto_is_xla_off_gpu_and_cudnn_refused_there():
    assert lm.resolve_attention("auto", jnp.bfloat16, 64) == (
        "cudnn" if jax.default_backend() == "gpu" else "xla")
    assert lm.resolve_attention("auto", jnp.float32, 64) == "xla"  # cuDNN: bf16/fp16 only
    assert lm.resolve_attention("auto", jnp.bfloat16, 12) == "xla"  # width not a multiple of 8
    assert "attention=xla" in _model().description
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="model.attention='cudnn' needs a GPU"):
            _model(dtype="bfloat16", attention="cudnn", d_model=64, num_heads=4)
    with pytest.raises(ValueError, match="model.attention='flash'"):
        _model(attention="flash")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_library_attention_equals_the_written_scores(dtype):
    """`jax.nn.dot_product_attention` (the cuDNN path's API, here its XLA form) against the
    [B, H, T, T] float32 scores as written: the same function of q, k, v to float rounding."""
    block = _model(dtype=dtype).blocks
    graphdef, stacked = nnx.split(block)
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))
    x = jax.random.normal(jax.random.key(3), (4, T, 32)).astype(layer.compute_dtype)
    written = layer.attention(x)
    layer.attention_kernel = "library"  # anything but "cudnn" runs the written form

    def library(x_BxTxD):
        b, t, d = x_BxTxD.shape
        heads = lambda y: y.reshape(b, t, layer.num_heads, d // layer.num_heads)
        q, k, v = (lm.rotary(heads(x_BxTxD @ layer._w(w))) if r else heads(x_BxTxD @ layer._w(w))
                   for w, r in ((layer.wq, True), (layer.wk, True), (layer.wv, False)))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return out.reshape(b, t, d) @ layer._w(layer.wo)

    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(library(x), np.float32),
                               np.asarray(written, np.float32), rtol=tol, atol=tol)


def _bf16_gradient_program(remat="none"):
    """value_and_grad of a bf16 LM's loss with its layers unrolled (XLA's cost analysis counts
    a loop's body once), lowered and compiled on this machine: (StableHLO text, compiled)."""
    c = models.default_model_config("lm")
    c.update(size="tiny", compute_dtype="bfloat16", d_model=64, num_heads=4, scan_unroll=2,
             remat=remat, attention="xla")
    graphdef, params, rest = models.split_model(models.build_model(
        c, input_shape=(32,), vocab_size=96, rngs=nnx.Rngs(0), verbose=False))
    x = jnp.zeros((4, 33), jnp.int32)
    lowered = jax.jit(jax.value_and_grad(models.make_loss_fn(graphdef, rest, "lm"))).lower(
        params, {"x": x[:, :-1], "y": x[:, 1:]})
    return lowered.as_text(), lowered.compile(), lm.resolve_size(c)


def test_bf16_step_has_no_unexpected_float32_matmul():
    """Every matmul of a bf16 LM's gradient takes bf16 operands, except the two of XLA's
    attention backward that multiply the float32 score cotangent [B, H, T, T] (dq, dk; the
    cuDNN kernel has none): a float32 matmul elsewhere (the [B·T, V] vocabulary projection's
    backward was one: TF32 on a GPU, 17 % of the 124m step) fails here on a CPU."""
    text, _, _ = _bf16_gradient_program()
    operands = [re.search(r":\s*\((.*?)\)\s*->", line)[1] for line in text.splitlines()
                if "stablehlo.dot_general" in line]
    assert len(operands) > 10
    f32 = [o for o in operands if o.count("xf32>") == 2]
    assert f32 and len(f32) % 2 == 0, f32  # dq and dk of each block the program holds
    assert all("4x4x32x32xf32" in o for o in f32), f32  # [B, H, T, T] scores only


def test_compiled_gradient_flops_match_the_formula():
    """XLA's count of the compiled gradient's FLOPs (matmuls and elementwise work) is
    1.0-1.25× the model's formula (6·N per token plus attention, `lm_flops_per_token`):
    a matmul run twice, a missing backward or a float32 copy of a projection moves it out."""
    _, compiled, size = _bf16_gradient_program()
    cost = compiled.cost_analysis()
    flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    formula = 4 * 32 * lm.lm_flops_per_token(size.d_model, size.num_layers, size.d_ff, 96, 32)
    assert 1.0 <= flops / formula <= 1.25, (flops, formula)
