"""Tests of the training engine: step (jitted step), optim, trainer and loop
(cbs.engine).

Float32 comparisons of two computations of the same update (different summation order:
micro-batches, devices) use rtol 2e-5 / atol 1e-6 after 3 steps: a few float32 ulps of
O(1) parameters, far below any real difference (one SGD step moves parameters by ~1e-3).
Resume tests compare bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import SUBPROCESS_XLA_FLAGS, make_train_step

from cbs import data, models
from cbs.data.stream import stream_indices
from cbs.engine import config as config_lib
from cbs.engine import loop, optim, step, trainer
from cbs.engine.lr import coupled_lr
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import TrainState
from cbs.results import files, records
from cbs.runtime import checkpoint, writer
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.fields import ConfigError
from cbs.stats import noise

RTOL, ATOL = 2e-5, 1e-6


def tiny_config(**overrides) -> ml_collections.ConfigDict:
    """digits, MLP 64-16-10, m = 8, B = 32, 12 steps; dotted overrides."""
    c = config_lib.default_config()
    c.model.hidden_sizes = (16,)
    c.batch.micro_batch = 8
    c.batch.schedule.batch_size = 32
    c.train.max_steps = 12
    c.train.log_every = 4
    c.train.checkpoint_every = 5
    c.train.progress_bar = False
    c.train.tensorboard = False
    c.eval.every = 6
    c.eval.batch_size = 512
    c.mesh.data = 1
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def one_device_mesh(n: int = 1) -> jax.sharding.Mesh:
    return mesh_lib.make_mesh(devices=jax.devices()[:n])


def make_step(loss_fn, params, optim_config, mesh, *, micro_batch, lr=0.05, **kwargs):
    """(TrainStep, state) with a constant learning rate and the batch passed as inputs."""
    return make_train_step(loss_fn, params, optim.make_direction(optim_config), mesh,
                           micro_batch=micro_batch, lr=lr, **kwargs)


def run_steps(ts, state, batch, accum, n=3):
    batch = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    history = []
    for _ in range(n):
        state, m = ts(state, batch, accum)
        history.append(m)
    return state, jax.device_get(history)


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("name, reference", [
    ("sgd", lambda: optax.sgd(0.1)),
    ("momentum", lambda: optax.sgd(0.1, momentum=0.9)),
    ("adam", lambda: optax.adam(0.1)),
    ("adamw", lambda: optax.adamw(0.1, weight_decay=0.01)),
    ("clip", lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1))),
])
def test_direction_times_lr_is_optax(name, reference):
    cfg = ml_collections.ConfigDict({"name": "adam" if name == "clip" else name,
                                     "weight_decay": 0.01 if name == "adamw" else 0.0,
                                     "weight_decay_mask": "all",
                                     "clip_norm": 0.5 if name == "clip" else 0.0})
    direction, ref = optim.make_direction(cfg), reference()
    params = {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.ones(3)}
    p1, p2 = params, params
    s1, s2 = direction.init(p1), ref.init(p2)
    for k in range(3):
        g = jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 1.0)), p1)
        u, s1 = direction.update(g, s1, p1)
        p1 = step.apply_step(p1, u, jnp.float32(0.1))
        u2, s2 = ref.update(g, s2, p2)
        p2 = optax.apply_updates(p2, u2)
    assert_trees_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_unknown_optimizer_names_the_field():
    with pytest.raises(ValueError, match="config.optim.name"):
        optim.make_direction(ml_collections.ConfigDict({"name": "lion"}))


# ---------------------------------------------------------------------------- the step


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_accumulation_identity(mlp, opt):
    """micro 8 × accum 4 equals batch 32 in one step, and both equal plain optax."""
    loss_fn, params, batch = mlp
    oc = ml_collections.ConfigDict({"name": opt})
    mesh = one_device_mesh()
    ts_a, st_a = make_step(loss_fn, params, oc, mesh, micro_batch=8)
    ts_b, st_b = make_step(loss_fn, params, oc, mesh, micro_batch=32)
    st_a, hist_a = run_steps(ts_a, st_a, batch, accum=4)
    st_b, hist_b = run_steps(ts_b, st_b, batch, accum=1)
    assert_trees_close(st_a.params, st_b.params)
    tx = optax.sgd(0.05) if opt == "sgd" else optax.adam(0.05)
    p, s = params, tx.init(params)
    for h in hist_a:
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        np.testing.assert_allclose(h["train/loss"], loss, rtol=RTOL)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    assert_trees_close(st_a.params, p)
    assert float(jnp.max(jnp.abs(st_a.params["layers"][0]["kernel"][...]
                                 - params["layers"][0]["kernel"][...]))) > 1e-3


def test_eight_devices_equal_one(mlp):
    """R=8 (m=4, and m=1 with A=4) equals R=1; the two-batch estimate too (b = 4 | m)."""
    loss_fn, params, batch = mlp
    oc = ml_collections.ConfigDict({"name": "adam"})
    ts1, st1 = make_step(loss_fn, params, oc, one_device_mesh(), micro_batch=32, small_batch=4,
                         live="two_batch")
    ts8, st8 = make_step(loss_fn, params, oc, one_device_mesh(8), micro_batch=4, small_batch=4,
                         live="two_batch")
    st1, h1 = run_steps(ts1, st1, batch, accum=1)
    st8, h8 = run_steps(ts8, st8, batch, accum=1)
    assert_trees_close(st1.params, st8.params)
    for a, b in zip(h1, h8, strict=True):
        for k in ("train/loss", "noise/live_trace_sigma", "noise/ema_b_simple"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4)
    ts8a, st8a = make_step(loss_fn, params, oc, one_device_mesh(8), micro_batch=1)
    st8a, _ = run_steps(ts8a, st8a, batch, accum=4)
    assert_trees_close(st1.params, st8a.params)


def test_measure_in_step_equals_separate(mlp):
    loss_fn, params, batch = mlp
    oc = ml_collections.ConfigDict({"name": "sgd"})
    measure = NoiseSpec(every=2)
    mesh = one_device_mesh()  # with the two-batch live estimate: an exact one would give the
    # measurement itself (tests/test_live_noise.py)
    ts_a, st_a = make_step(loss_fn, params, oc, mesh, micro_batch=16,
                           measure=measure.replace(in_step=True), live="two_batch")
    ts_b, st_b = make_step(loss_fn, params, oc, mesh, micro_batch=16, measure=measure,
                           live="two_batch")
    st_a, hist_a = run_steps(ts_a, st_a, batch, accum=2)
    st_b, hist_b = run_steps(ts_b, st_b, batch, accum=2)
    assert ts_b.measurement._alone._cache_size() and not ts_a.measurement._alone._cache_size()
    assert_trees_close(st_a.params, st_b.params)
    exact = noise.exact(loss_fn, params, jax.tree.map(lambda x: x[:16], batch))
    assert "noise/b_simple" not in hist_b[1] and "noise/b_simple" not in hist_a[1]
    np.testing.assert_allclose(hist_a[0]["noise/b_simple"], exact.b_simple, rtol=1e-4)
    for t in (0, 2):
        assert sorted(hist_a[t]) == sorted(hist_b[t])
        for k, v in hist_b[t].items():
            np.testing.assert_allclose(hist_a[t][k], v, rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("method", ["vmap", "probe"])
def test_curvature_measurement_in_the_step(mlp, method):
    """exact (vmap): b_simple equals cbs.stats.noise.exact on the measured micro-batch, the
    curvature terms exact on its first half with the Hessian of its second half (H independent
    of the deviations); probe gives the keys."""
    loss_fn, params, batch = mlp
    ts, st = make_step(loss_fn, params, ml_collections.ConfigDict({"name": "sgd"}),
                       one_device_mesh(), micro_batch=16,
                       measure=NoiseSpec(method=method, every=1, curvature=True))
    b = jax.device_put(batch, mesh_lib.batch_sharding(ts.layout.mesh))
    st, measured = ts(st, b, 2)
    for k in ("b_noise", "g_h_g", "trace_h_sigma", "measured_ema_b_noise", "b_simple"):
        assert f"noise/{k}" in measured, k
    if method == "vmap":
        half = lambda lo, hi: jax.tree.map(lambda x: x[lo:hi], batch)
        want = noise.exact(loss_fn, params, half(0, 8), curvature=True, method="vmap",
                           hessian_batch=half(8, 16))
        same = noise.exact(loss_fn, params, half(0, 8), curvature=True, method="vmap")
        assert abs(float(same.trace_h_sigma) / float(want.trace_h_sigma) - 1) > 1e-3
        whole = noise.exact(loss_fn, params, half(0, 16), method="vmap")
        np.testing.assert_allclose(measured["noise/b_simple"], whole.b_simple, rtol=1e-4)
        for k in ("b_noise", "trace_h_sigma", "g_h_g"):
            np.testing.assert_allclose(measured[f"noise/{k}"], getattr(want, k), rtol=1e-4)
        assert measured["noise/measured_ema_b_noise"] == pytest.approx(
            float(want.b_noise), rel=1e-4)


def test_two_batch_estimate_agrees_with_exact_on_average():
    """At fixed parameters (η = 0), the mean over steps of the in-step estimates equals the
    exact statistics of the whole training set. Batches are drawn without replacement from
    the N examples, so E|ḡ_b|² = |G|² + σ²(N − b)/(b(N − 1)) with σ² = Σ|g_i − G|²/N; the
    two-batch formulas then give exactly exact(train set).trace_sigma (the 1/(N−1) estimate)
    and exact(train set).grad_sq_norm in expectation. Tolerance: 4 standard errors."""
    c = tiny_config(**{"batch.schedule.batch_size": 64, "noise.small_batch": 8,
                       "noise.live": "two_batch"})
    tr = trainer.Trainer(c, mesh=one_device_mesh())
    state = tr.init_state()
    state = state.replace(learning_rate=jax.device_put(jnp.float32(0.0),
                                                       state.learning_rate.sharding))
    num_steps, hist = 200, []
    for t in range(num_steps):
        state, m = tr.step(state, tr.inputs(t * 64, 64), tr.accum_steps(64))
        hist.append(m)
    hist = jax.device_get(hist)
    loss_fn = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
    full = tr.dataset.split("train").read(np.arange(tr.dataset.num_train))
    exact = noise.exact(loss_fn, state.params, full, chunk_size=256)
    for key, want in (("trace_sigma", exact.trace_sigma), ("grad_sq_norm", exact.grad_sq_norm)):
        x = np.array([h[f"noise/live_{key}"] for h in hist], np.float64)
        se = x.std(ddof=1) / np.sqrt(num_steps)
        assert abs(x.mean() - float(want)) < 4 * se, (key, x.mean(), float(want), se)
        assert se < 0.25 * abs(float(want)), (key, se)  # the check has power


# ---------------------------------------------------------------------------- runs


def test_no_recompilation_and_one_compile_per_accumulation_count(tmp_path):
    c = tiny_config(**{"batch.schedule": ml_collections.ConfigDict(
        {"kind": "step", "steps": ((0, 16), (96, 32), (224, 16))})})
    c.train.max_steps = 14
    tr = trainer.Trainer(c, str(tmp_path), mesh=one_device_mesh())
    state = tr.init_state()
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: events.append(name) if "backend_compile" in name else None)
    sizes = []
    e = 0
    for t in range(14):
        b = tr.schedule.batch_size_at(e)
        sizes.append(b)
        before = len(events)
        state, _ = tr.step(state, tr.inputs(e, b), tr.accum_steps(b))
        if t > 0 and b == sizes[-2]:
            assert len(events) == before, f"recompiled at step {t}"
        e += b
    assert sorted(set(sizes)) == [16, 32]
    assert tr.step.num_compilations() == 2  # A = 2 and A = 4, the return to 16 reuses A = 2


def test_records_checkpoints_and_status(tmp_path):
    c = tiny_config(**{"noise.every": 4, "train.tensorboard": True,
                       "batch.lr_coupling.rule": "sqrt", "optim.warmup_examples": 128})
    summary = trainer.run(c, str(tmp_path), mesh=one_device_mesh())
    assert summary["status"] == "finished" and summary["step"] == 12
    recs = records.read_records(str(tmp_path / files.METRICS_FILE))
    trains = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in trains] == list(range(12))
    assert [r["step"] for r in evals] == [0, 6, 12]
    for key in ("train/loss", "opt/lr", "opt/grad_norm", "data/batch_size", "data/examples_seen",
                "noise/ema_b_simple", "noise/live_trace_sigma", "noise/live_exact"):
        assert key in trains[5], key
    assert all(("noise/b_simple" in r) == (r["step"] % 4 == 0) for r in trains)
    # the measurement is the exact live statistics of the step's whole batch of 32
    assert trains[4]["noise/batch_size"] == 32 and trains[4]["noise/live_exact"] == 1.0
    assert trains[4]["noise/trace_sigma"] == pytest.approx(trains[4]["noise/live_trace_sigma"])
    assert {"eval/loss", "eval/accuracy", "full_train/loss", "full_train/accuracy"} <= set(
        evals[-1])
    lrs = [r["opt/lr"] for r in trains[:5]]  # warmup: η_0·min(1, (E + B)/128), B_0 = B
    np.testing.assert_allclose(lrs, [1e-3 * min(1, 32 * (t + 1) / 128) for t in range(5)],
                               rtol=1e-6)
    assert trains[3]["data/examples_seen"] == 96
    ckpt = checkpoint.Checkpointer(str(tmp_path / checkpoint.CHECKPOINT_DIR))
    assert ckpt.all_steps() == [10, 12]
    assert os.listdir(tmp_path / writer.TENSORBOARD_DIR)
    status = json.loads((tmp_path / files.STATUS_FILE).read_text())
    assert status["status"] == "finished" and status["last_eval"]["step"] == 12
    # The same command again returns the recorded summary without training.
    assert trainer.run(c, str(tmp_path), mesh=one_device_mesh())["elapsed_s"] == summary[
        "elapsed_s"]


def test_full_training_set_evaluation_is_exact(mlp):
    c = tiny_config(**{"eval.batch_size": 100})
    tr = trainer.Trainer(c, mesh=one_device_mesh())
    state = tr.init_state()
    got = tr.evaluate(state, "train")
    full = tr.dataset.split("train").read(np.arange(tr.dataset.num_train))
    want = tr.loss_fn(state.params, state.model_state, full)[0]
    np.testing.assert_allclose(got["loss"], float(want), rtol=1e-5)
    assert 0.0 <= got["accuracy"] <= 1.0
    assert tr.evaluate(state, "eval", 50)["loss"] != got["loss"]


class _Crash(Exception):
    pass


def _crash_at(step_number):
    def stop_fn(step_, record):
        if step_ >= step_number:
            raise _Crash(step_)
        return False
    return stop_fn


def _final_state(workdir, target):
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, checkpoint.CHECKPOINT_DIR))
    state, meta = ckpt.restore(None, target)
    ckpt.close()
    return state, meta


@pytest.mark.parametrize("schedule", [
    {"kind": "step", "steps": ((0, 16), (160, 32))},
    {"kind": "adaptive", "min_batch": 8, "max_batch": 64, "initial": 16, "patience": 1, "k": 4.0},
])
def test_resume_after_crash_is_bit_identical(tmp_path, schedule):
    """Crash at step 8 (checkpoint at 5, mid-ramp), rerun: same params and records."""
    c = tiny_config(**{"noise.every": 3, "batch.adapt_every": 2, "eval.every": 4,
                       "batch.schedule": ml_collections.ConfigDict(schedule)})
    mesh = one_device_mesh()
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    s1 = trainer.run(c, whole, mesh=mesh)
    with pytest.raises(_Crash):
        trainer.run(c, broken, stop_fn=_crash_at(8), mesh=mesh)
    status = records.read_json(os.path.join(broken, files.STATUS_FILE))
    assert status["status"] == "running"
    s2 = trainer.run(c, broken, mesh=mesh)
    assert s2["step"] == s1["step"] == 12
    r1 = records.read_records(os.path.join(whole, files.METRICS_FILE))
    r2 = records.read_records(os.path.join(broken, files.METRICS_FILE))
    assert r1 == r2
    sizes = {r["data/batch_size"] for r in r1 if r["kind"] == "train"}
    assert len(sizes) >= 2, sizes  # the run did change batch size
    target = trainer.Trainer(c, mesh=mesh).init_state()
    (a, meta_a), (b, meta_b) = _final_state(whole, target), _final_state(broken, target)
    assert meta_a == meta_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_run_started_from_a_state_continues_where_that_state_is(tmp_path):
    """`Trainer(start=state)` (how a branch starts from its point): the loop starts at the
    state's step and examples seen, and the records from there on equal the uninterrupted
    run's; the config's η_0 replaces the state's, as on resume."""
    c = tiny_config(**{"noise.every": 3, "eval.every": 4, "train.keep_checkpoints": 5})
    mesh = one_device_mesh()
    whole = str(tmp_path / "whole")
    trainer.run(c, whole, mesh=mesh)
    target = trainer.Trainer(c, mesh=mesh).init_state()
    ckpt = checkpoint.Checkpointer(os.path.join(whole, checkpoint.CHECKPOINT_DIR))
    state, _ = ckpt.restore(5, jax.tree.map(np.asarray, target))
    ckpt.close()
    tr = trainer.Trainer(c, str(tmp_path / "started"), mesh=mesh,
                         start=state.replace(learning_rate=np.float32(9.0)))
    assert tr.start_position == (5, 5 * 32)
    summary = tr.run()
    assert summary["step"] == 12
    got = records.read_records(str(tmp_path / "started" / files.METRICS_FILE))
    want = [r for r in records.read_records(os.path.join(whole, files.METRICS_FILE))
            if r["step"] >= 5]
    assert got[0]["step"] == 5 and got[0]["data/examples_seen"] == 160
    assert got == want


def test_evaluations_at_given_steps_replace_the_interval(tmp_path):
    """`eval.steps` (a sweep trial's log-spaced grid): evaluations after exactly those steps
    and at the end, whatever `eval.every` says; a grid that is not increasing is refused."""
    c = tiny_config(**{"eval.steps": (0, 1, 4, 9), "eval.every": 6})
    trainer.run(c, str(tmp_path), mesh=one_device_mesh())
    recs = records.read_records(str(tmp_path / files.METRICS_FILE))
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 1, 4, 9, 12]
    with pytest.raises(ConfigError, match=r"config\.eval\.steps: must be increasing"):
        trainer.Trainer(tiny_config(**{"eval.steps": (4, 4)}), mesh=one_device_mesh())


def _poisoned_digits(bad_step: int, batch_size: int) -> data.Dataset:
    ds = data.get_dataset("digits")
    idx = stream_indices(bad_step * batch_size, batch_size, ds.num_train, 0)
    arrays = {k: v.copy() for k, v in ds.train.items()}
    arrays["x"] = arrays["x"].astype(np.float32)
    arrays["x"][idx[3]] = np.nan
    split = dataclasses.replace(ds.split("train"), arrays=arrays)
    return dataclasses.replace(ds, splits={**ds.splits, "train": split})


def test_nan_stops_with_step_named_and_checkpoint_intact(tmp_path):
    c = tiny_config()
    tr = trainer.Trainer(c, str(tmp_path), mesh=one_device_mesh(),
                       dataset=_poisoned_digits(7, 32))
    with pytest.raises(loop.DivergedError, match="step 7") as err:
        tr.run()
    assert err.value.step == 7
    status = records.read_json(str(tmp_path / files.STATUS_FILE))
    assert status["status"] == "diverged" and status["step"] == 7
    assert status["checkpoint_step"] == 5
    ckpt = checkpoint.Checkpointer(str(tmp_path / checkpoint.CHECKPOINT_DIR))
    state, meta = ckpt.restore(None, jax.tree.map(np.asarray, tr.init_state()))
    assert meta["step"] == 5 and int(state.step) == 5
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    recs = records.read_records(str(tmp_path / files.METRICS_FILE))
    assert recs[-1]["step"] == 7 and not np.isfinite(recs[-1]["train/loss"])
    summary = trainer.Trainer(c, str(tmp_path), mesh=one_device_mesh(),
                            dataset=_poisoned_digits(7, 32)).run(raise_on_divergence=False)
    assert summary["status"] == "diverged"


def test_without_grad_norm_records_lack_it_and_a_nan_still_stops_the_run(tmp_path):
    """train.grad_norm=False with no live estimate: no `opt/grad_norm` in the records, and
    the divergence guard still stops at the poisoned step through its loss."""
    c = tiny_config(**{"train.grad_norm": False, "noise.live": "none"})
    summary = trainer.Trainer(c, str(tmp_path), mesh=one_device_mesh(),
                              dataset=_poisoned_digits(7, 32)).run(raise_on_divergence=False)
    assert summary["status"] == "diverged" and summary["step"] == 7
    assert "non-finite loss" in summary["message"]
    trains = [r for r in records.read_records(str(tmp_path / files.METRICS_FILE))
              if r["kind"] == "train"]
    assert [r["step"] for r in trains] == list(range(8))
    assert not any("opt/grad_norm" in r for r in trains)
    assert all(np.isfinite(r["train/loss"]) for r in trains[:7])


def test_stop_fn_ends_the_run_as_stopped(tmp_path):
    c = tiny_config(**{"train.max_steps": 40, "eval.every": 2, "optim.learning_rate": 1e-2})
    seen = []

    def stop_fn(step_, record):
        seen.append(step_)
        return record["kind"] == "eval" and record["full_train/loss"] < 2.0

    summary = trainer.run(c, str(tmp_path), stop_fn=stop_fn, mesh=one_device_mesh())
    assert summary["status"] == "stopped" and summary["step"] < 40
    assert summary["last_eval"]["full_train/loss"] < 2.0
    assert seen == sorted(seen)
    again = trainer.run(c, str(tmp_path), stop_fn=lambda *a: False, mesh=one_device_mesh())
    assert again == summary


def test_train_state_learning_rate_is_runtime(mlp):
    """η_0 lives in the state: two learning rates share one compilation."""
    loss_fn, params, batch = mlp
    ts, st = make_step(loss_fn, params, ml_collections.ConfigDict({"name": "sgd"}),
                       one_device_mesh(), micro_batch=32)
    lr = jax.device_put(jnp.float32(0.5), st.learning_rate.sharding)  # same sharding: no retrace
    st2 = jax.tree.map(jnp.copy, st).replace(learning_rate=lr)  # (st itself is donated)
    st_a, h_a = run_steps(ts, st, batch, accum=1, n=1)
    st_b, h_b = run_steps(ts, st2, batch, accum=1, n=1)
    assert ts.num_compilations() == 1
    assert h_a[0]["opt/lr"] == pytest.approx(0.05) and h_b[0]["opt/lr"] == pytest.approx(0.5)
    assert coupled_lr(0.05, 64, 32, "sqrt") == pytest.approx(0.05 * 2 ** 0.5)


def _streamed(ds: data.Dataset) -> data.Dataset:
    """The same dataset with its training split read from the host (no stored arrays)."""
    split = ds.split("train")
    streamed = dataclasses.replace(split, arrays=None, reader=split.read)
    return dataclasses.replace(ds, splits={**ds.splits, "train": streamed})


def test_host_stream_equals_device_gather(tmp_path):
    c = tiny_config(**{"train.max_steps": 4, "eval.full_train": False, "mesh.data": 2,
                       "batch.micro_batch": 4})
    mesh = one_device_mesh(2)
    ds = data.get_dataset("digits")
    device_run = loop_state(trainer.Trainer(c, str(tmp_path / "a"), mesh=mesh, dataset=ds))
    host_trainer = trainer.Trainer(c, str(tmp_path / "b"), mesh=mesh, dataset=_streamed(ds))
    assert not host_trainer.in_memory
    host_run = loop_state(host_trainer)
    host_trainer.close()
    assert_trees_close(device_run.params, host_run.params, rtol=1e-6, atol=1e-7)


def loop_state(trainer) -> TrainState:
    from cbs.engine import loop

    run = loop.Loop(trainer)
    run.run()
    return run.state


def test_batchnorm_cnn_keeps_running_statistics(tmp_path):
    """A model with BatchNorm trains through the stateful loss (statistics in the state) and
    refuses per-example measurements."""
    c = tiny_config(**{"train.max_steps": 3, "eval.enabled": False})
    c.data.options = ml_collections.ConfigDict({"flatten": False})
    c.model = models.default_model_config("cnn")
    c.model.channels, c.model.dense_sizes, c.model.norm = (4,), (8,), "batchnorm"
    tr = trainer.Trainer(c, str(tmp_path), mesh=one_device_mesh())
    assert tr.stateful
    state = tr.init_state()
    before = jax.tree.map(np.asarray, state.model_state)
    state, m = tr.step(state, tr.inputs(0, 32), tr.accum_steps(32))
    assert np.isfinite(float(m["train/loss"]))
    changed = [not np.array_equal(a, np.asarray(b)) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(state.model_state), strict=True)]
    assert changed and all(changed)
    c.noise.every = 2
    with pytest.raises(ConfigError, match=r"config\.noise\.every"):
        trainer.Trainer(c, mesh=one_device_mesh())


@pytest.mark.slow
def test_entry_point_with_overrides_then_rerun(tmp_path):
    """python -m experiments.main --config=...:tiny --workdir=... --config.x=y, twice."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    cmd = [sys.executable, "-m", "experiments.main",
           "--config=experiments/configs/digits_mlp.py:tiny", f"--workdir={tmp_path}",
           "--config.train.max_steps=6", "--config.optim.learning_rate=3e-3"]
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    first = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    summary = json.loads(first.stdout[first.stdout.index("{"):])
    assert summary["status"] == "finished" and summary["step"] == 6
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["optim"]["learning_rate"] == 3e-3
    again = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(again.stdout[again.stdout.index("{"):]) == summary


def test_model_sharded_parameters_equal_replicated():
    """mesh 4 × 2 with kernels split over "model" equals 8 data replicas, replicated."""
    def final_params(mesh, mode):
        c = tiny_config(**{"batch.micro_batch": 4, "mesh.param_mode": mode})
        tr = trainer.Trainer(c, mesh=mesh)
        state = tr.init_state()
        for t in range(3):
            state, _ = tr.step(state, tr.inputs(32 * t, 32), tr.accum_steps(32))
        return state.params

    replicated = final_params(mesh_lib.make_mesh(data=8, model=1), "replicated")
    sharded = final_params(mesh_lib.make_mesh(data=4, model=2), "model")
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded)}
    assert "P(None, 'model')" in specs
    assert_trees_close(jax.tree.map(np.asarray, replicated), jax.tree.map(np.asarray, sharded))
