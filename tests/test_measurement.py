"""Tests of cbs.sweeps.measurement: a streamed dataset's measurement batches, read on the
host, are the examples the in-memory path gathers on the device (the same draws of
(seed, evaluation index) in both sweep back ends), and give the same statistics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cbs import data
from cbs.engine import measure, mesh, trainer
from cbs.sweeps import grid, measurement, trials
from experiments.configs import digits_sweep


def _sweep(noise_examples: str) -> measurement.SweepNoise:
    s = grid.default_sweep_config()
    s.noise_batch_size = 48
    s.noise_curvature_batch_size = 8
    s.noise_hessian_batch_size = 24
    s.noise_examples = noise_examples
    noise = measurement.SweepNoise.from_sweep(s)
    assert noise == measurement.SweepNoise(48, 8, 24, noise_examples, s.noise_chunk_size)
    return noise


def test_host_batches_are_the_device_draws():
    ds = data.get_dataset("digits")
    arrays = ds.device_arrays("train")
    s = _sweep("sampled")
    for index in (0, 3, 40):  # 40·48 > N: a later epoch of the measurement stream
        want = jax.device_get(measure.measurement_batches(
            ds, arrays, index, seed=5, batch_size=48, hessian_batch_size=24))
        got = measurement.host_batches(s, ds, index, seed=5)
        for w, g in zip(want, got, strict=True):
            jax.tree.map(np.testing.assert_array_equal, g, w)


def test_host_batches_of_the_full_data_measurement_are_the_training_set():
    ds = data.get_dataset("digits")
    everything, hess = measurement.host_batches(_sweep("all"), ds, 2, seed=5)
    assert hess is None
    jax.tree.map(np.testing.assert_array_equal, everything,
                 ds.split("train").read(np.arange(ds.num_train)))


@pytest.mark.parametrize("noise_examples", ["sampled", "all"])
def test_engine_measurement_of_a_streamed_split_equals_the_in_memory_one(noise_examples):
    c = digits_sweep.get_config("tiny")
    c.sweep.noise_examples = noise_examples
    c.sweep.noise_batch_size = 64
    trial = grid.make_trials(c.sweep)[0]
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    tr = trainer.Trainer(trials.trial_config(c, trial), mesh=one)
    state = tr.init_state()
    steps = trials.eval_steps(c.sweep, trial.batch_size)
    hook = lambda: measurement.EngineMeasurement(measurement.SweepNoise.from_sweep(c.sweep),
                                                 seed=trial.seed, steps=steps)
    want = jax.device_get(hook()(tr, state, steps[3]))
    tr.in_memory = False  # the host path a streamed training split takes
    got = jax.device_get(hook()(tr, state, steps[3]))
    assert set(got) == set(want) and "noise/trace_h_sigma" in got
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, err_msg=k)
