"""Tests of cbs.runtime.checkpoint (orbax behind one class) and the run records."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cbs.engine import state as state_lib
from cbs.results import files, records
from cbs.runtime import checkpoint, writer
from cbs.runtime import mesh as mesh_lib
from cbs.stats import smoothing


def _state(mesh, scale: float = 1.0) -> state_lib.TrainState:
    params = {"w": jnp.arange(32.0).reshape(8, 4) * scale, "b": jnp.ones(4) * scale}
    direction = optax.scale_by_adam()
    state = state_lib.init_train_state(params, direction, learning_rate=3e-3)
    state = state.replace(step=jnp.int32(7), examples_seen=jnp.int32(224),
                          noise_ema=state.noise_ema.update(jnp.float32(2.0), jnp.float32(50.0)))
    shardings = jax.tree.map(lambda _: mesh_lib.replicated(mesh), state)
    shardings = shardings.replace(params={"w": jax.sharding.NamedSharding(
        mesh, jax.P(None, mesh_lib.MODEL)), "b": mesh_lib.replicated(mesh)})
    return jax.device_put(state, shardings)


@pytest.fixture
def mesh():
    return mesh_lib.make_mesh(data=2, model=4)


def test_round_trip_keeps_values_structure_and_shardings(tmp_path, mesh):
    ckpt = checkpoint.Checkpointer(str(tmp_path), max_to_keep=2)
    state = _state(mesh)
    meta = {"step": 7, "examples_seen": 224, "schedule_state": {"batch_size": 64, "streak": 1}}
    assert ckpt.save(7, state, meta)
    ckpt.wait()
    assert ckpt.latest_step() == 7
    target = _state(mesh, scale=0.0)  # same structure and shardings, other values
    restored, restored_meta = ckpt.restore(None, target)
    ckpt.close()
    assert restored_meta == meta
    assert isinstance(restored, state_lib.TrainState)
    assert isinstance(restored.noise_ema, smoothing.NoiseScaleEMA)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert float(restored.noise_ema.b_simple) == pytest.approx(25.0)


def test_keeps_the_newest_and_restores_a_chosen_step(tmp_path, mesh):
    ckpt = checkpoint.Checkpointer(str(tmp_path), max_to_keep=2)
    for s in (1, 2, 3):
        ckpt.save(s, _state(mesh, scale=float(s)), {"step": s})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    restored, meta = ckpt.restore(2, _state(mesh, scale=0.0))
    assert meta == {"step": 2}
    np.testing.assert_array_equal(np.asarray(restored.params["b"]), 2.0 * np.ones(4))
    ckpt.close()


def test_a_torn_save_is_not_the_latest(tmp_path, mesh):
    """A save killed before orbax's final rename leaves a tmp dir that is not a checkpoint."""
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(4, _state(mesh), {"step": 4})
    ckpt.close()
    os.makedirs(tmp_path / "9.orbax-checkpoint-tmp-1234" / "state")
    assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 4


def test_restore_without_checkpoint_says_so(tmp_path, mesh):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.Checkpointer(str(tmp_path)).restore(None, _state(mesh))


# ----------------------------------------------------------------------------- records


def test_records_append_skip_torn_lines_and_truncate(tmp_path):
    path = str(tmp_path / files.METRICS_FILE)
    w = writer.MetricsWriter(str(tmp_path), progress=False, tensorboard=False)
    w.write([{"step": s, "kind": "train", "train/loss": np.float32(1.0 / (s + 1))}
             for s in range(5)])
    w.write([{"step": 5, "kind": "eval", "eval/loss": float("nan")}])
    w.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "kind": "tr')  # a kill in the middle of a write
    recs = records.read_records(path)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5]
    assert recs[1]["train/loss"] == pytest.approx(0.5) and np.isnan(recs[5]["eval/loss"])
    assert records.truncate_records(path, 3) == 3
    assert [r["step"] for r in records.read_records(path)] == [0, 1, 2]
    with open(path) as f:
        assert f.read().endswith("\n")
    # Reopening at a restored step drops what comes after it, then appends.
    w = writer.MetricsWriter(str(tmp_path), start_step=2, progress=False, tensorboard=False)
    w.write([{"step": 2, "kind": "train"}])
    w.close()
    assert [r["step"] for r in records.read_records(path)] == [0, 1, 2]


def test_disabled_writer_writes_nothing(tmp_path):
    w = writer.MetricsWriter(str(tmp_path / "run"), enabled=False)
    w.write([{"step": 0, "kind": "train"}])
    w.close()
    assert not os.path.exists(tmp_path / "run")


def test_status_is_replaced_atomically(tmp_path):
    path = str(tmp_path / files.STATUS_FILE)
    records.write_json_atomic(path, {"status": "running", "step": np.int32(3)})
    records.write_json_atomic(path, {"status": "finished", "step": 9})
    assert json.load(open(path)) == {"status": "finished", "step": 9}
    assert os.listdir(tmp_path) == [files.STATUS_FILE]
    assert records.read_json(str(tmp_path / "missing.json")) is None
