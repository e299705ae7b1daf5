"""The registry of noise-measurement methods (cbs.stats.noise.register_method): the built-ins
are registered, config validation lists the registered names, and a method registered from
outside is what a run's periodic measurement calls, end to end from a config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from cbs.engine import config as config_lib
from cbs.engine import trainer
from cbs.results import files, records
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.fields import ConfigError
from cbs.stats import noise, sampled


def _config(method: str, **noise_fields):
    """digits MLP 64-16-10, B = 32, 4 steps, a measurement every 2 steps."""
    c = config_lib.default_config()
    c.model.hidden_sizes = (16,)
    c.batch.micro_batch = 16
    c.batch.schedule.batch_size = 32
    c.train.max_steps = 4
    c.train.log_every = 2
    c.train.progress_bar = False
    c.train.tensorboard = False
    c.eval.enabled = False
    c.noise.every = 2
    c.noise.method = method
    c.noise.num_probes = 3
    for k, v in noise_fields.items():
        c.noise[k] = v
    return c


def _run(config, workdir):
    return trainer.run(config, str(workdir), mesh=mesh_lib.make_mesh(devices=jax.devices()[:1]))


@pytest.fixture
def fixed_method():
    """Registers "_test_fixed": b_simple = 84 / 2 = 42 whatever the batch; yields the calls'
    keyword arguments (recorded at trace time) and unregisters it afterwards."""
    calls = []

    def fixed(loss_fn, params, batch, *, key, curvature, num_probes, chunk_size):
        calls.append({"batch_size": jax.tree.leaves(batch)[0].shape[0], "key": key,
                      "curvature": curvature, "num_probes": num_probes,
                      "chunk_size": chunk_size, "loss": loss_fn(params, batch)})
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        return noise.NoiseStats(batch_size=jax.tree.leaves(batch)[0].shape[0],
                                mean_grad_sq_norm=f32(3.0), grad_sq_norm=f32(2.0),
                                trace_sigma=f32(84.0), b_simple=f32(42.0))

    assert noise.register_method("_test_fixed", fixed) is fixed
    try:
        yield calls
    finally:
        noise._METHODS.pop("_test_fixed")


def test_builtin_methods_are_registered_and_unknown_names_are_listed():
    assert noise.method_names()[:4] == ("auto", "fast", "vmap", "probe")
    with pytest.raises(ValueError, match=r"unknown method 'magic'; known: \['auto', 'fast'"):
        noise.get_method("magic")
    with pytest.raises(ValueError, match="already registered"):
        noise.register_method("probe", lambda *a, **k: None)
    with pytest.raises(ConfigError, match=r"config.noise.method: .*'vmap', 'probe'"):
        config_lib.validate(_config("magic"), data_replicas=1)


def test_a_registered_method_is_measured_by_a_run_from_its_config(tmp_path, fixed_method):
    config = _config("_test_fixed")
    config_lib.validate(config, data_replicas=1)  # a registered name is a valid value
    summary = _run(config, tmp_path)
    assert summary["status"] == "finished"
    measured = [r for r in records.read_records(tmp_path / files.METRICS_FILE)
                if "noise/b_simple" in r]
    assert [r["step"] for r in measured] == [0, 2]
    for r in measured:
        assert r["noise/b_simple"] == 42.0 and r["noise/trace_sigma"] == 84.0
        assert r["noise/measured_ema_b_simple"] == pytest.approx(42.0)
    call = fixed_method[0]
    assert (call["batch_size"], call["curvature"], call["num_probes"], call["chunk_size"]) == (
        16, False, 3, None)  # one micro-batch; chunk_size 0 means None
    assert jnp.issubdtype(call["key"].dtype, jax.dtypes.prng_key)


def test_a_method_without_curvature_fails_when_curvature_is_asked(tmp_path, fixed_method):
    config = _config("_test_fixed", curvature=True)
    with pytest.raises(ValueError, match="'_test_fixed' returned no curvature statistics"):
        _run(config, tmp_path)


def test_the_sweep_measurement_is_the_registered_sampled_method(mlp):
    """"sampled" (`cbs.stats.sampled.sampled_method`, what sweeps record at their
    evaluations) is a method of the registry: the same numbers as `measure_noise` on
    (𝓑, 𝓒), exact B_simple without curvature, and no curvature without an independent 𝓒."""
    loss_fn, params, batch = mlp
    grad_batch = jax.tree.map(lambda x: x[:24], batch)
    hess_batch = jax.tree.map(lambda x: x[24:], batch)
    method = noise.get_method(sampled.SAMPLED_METHOD)
    assert "hessian_batch" in noise.method_arguments(sampled.SAMPLED_METHOD)
    got = method(loss_fn, params, grad_batch, key=None, curvature=True, num_probes=None,
                 chunk_size=None, hessian_batch=hess_batch, deviations=8)
    want = sampled.measure_noise(loss_fn, params, grad_batch, hess_batch, deviations=8)
    assert set(got.to_dict(prefix="")) == set(want)
    for k, v in want.items():
        assert float(getattr(got, k)) == float(v), k
    plain = method(loss_fn, params, grad_batch, key=None, curvature=False, num_probes=None,
                   chunk_size=None)
    assert plain.b_noise is None
    assert float(plain.b_simple) == pytest.approx(
        float(noise.exact(loss_fn, params, grad_batch).b_simple), rel=1e-6)
    with pytest.raises(ValueError, match="needs a hessian_batch"):
        method(loss_fn, params, grad_batch, key=None, curvature=True, num_probes=None,
               chunk_size=None)


def test_the_whole_training_set_estimator_is_the_registered_full_data_method(mlp):
    """"full_data" (`cbs.stats.sampled.full_data_method`, what `noise.examples = "all"`
    measures) is a method of the registry: the numbers of `measure_full_data` on the same
    examples and key, no curvature unless asked."""
    loss_fn, params, batch = mlp
    method = noise.get_method(sampled.FULL_DATA_METHOD)
    key = jax.random.key(3)
    got = method(loss_fn, params, batch, key=key, curvature=True, num_probes=None,
                 chunk_size=None, deviations=8, hessian_examples=16)
    want = sampled.measure_full_data(loss_fn, params, batch, key, deviations=8,
                                     hessian_examples=16)
    assert set(got.to_dict(prefix="")) == set(want)
    for k, v in want.items():
        assert float(getattr(got, k)) == float(v), k
    plain = method(loss_fn, params, batch, key=key, curvature=False, num_probes=None,
                   chunk_size=None, deviations=8)
    assert plain.b_noise is None and float(plain.b_simple) == float(want["b_simple"])


def test_a_run_measures_with_the_sampled_method_from_its_config(tmp_path):
    """`noise.method = "sampled"` with curvature: the train step measures B_simple and
    B_noise every 2 steps with the sweep's estimator (Hessian from the other half of the
    measured examples)."""
    config = _config(sampled.SAMPLED_METHOD, curvature=True, batch_size=32)
    config_lib.validate(config, data_replicas=1)
    assert _run(config, tmp_path)["status"] == "finished"
    measured = [r for r in records.read_records(tmp_path / files.METRICS_FILE)
                if "noise/b_simple" in r]
    assert [r["step"] for r in measured] == [0, 2]
    for r in measured:
        assert r["noise/b_simple"] > 0 and r["noise/trace_h_sigma"] > 0
        assert r["noise/b_noise"] == pytest.approx(r["noise/trace_h_sigma"] / r["noise/g_h_g"],
                                                   rel=1e-5)
