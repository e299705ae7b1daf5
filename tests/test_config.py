"""Tests of cbs.engine.config: every bad field fails, names itself, and fails before compiling."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re

import jax
import ml_collections
import pytest

from cbs.engine import config as config_lib
from cbs.engine import trainer
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.fields import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "cbs", "configs")  # the presets


def _set(c, key, value):
    node = c
    *path, last = key.split(".")
    for p in path:
        node = node[p]
    node[last] = value


def test_default_config_is_valid_and_every_field_is_documented():
    c = config_lib.default_config()
    for replicas in (1, 4):
        assert config_lib.validate(c, data_replicas=replicas).every == c.noise.every
    # every leaf field is assigned on a line with a trailing comment giving its meaning
    source = inspect.getsource(config_lib.default_config)
    assigned = dict(re.findall(r"^\s*c\.([\w.]+) = .*?(#.*)?$", source, flags=re.M))
    leaves = {k for k, v in _flatten(c.to_dict()).items()}
    missing = sorted(k for k in leaves if k not in assigned and not k.startswith("model."))
    assert missing == [], f"fields without an assignment in default_config: {missing}"
    undocumented = sorted(k for k in leaves if k in assigned and not assigned[k])
    assert undocumented == [], f"fields without a trailing comment: {undocumented}"
    assert len(leaves) > 40


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


BAD = [
    ("batch.micro_batch", 0, "config.batch.micro_batch"),
    ("batch.micro_batch", -8, "config.batch.micro_batch"),
    ("batch.schedule.batch_size", 100, "config.batch.schedule"),
    ("batch.schedule.batch_size", 0, "config.batch.schedule"),
    ("batch.schedule", ml_collections.ConfigDict({"kind": "step", "steps": ((0, 64), (10, 48))}),
     "config.batch.schedule"),
    ("batch.schedule", ml_collections.ConfigDict({"kind": "ramp"}), "config.batch.schedule"),
    ("batch.schedule", ml_collections.ConfigDict(
        {"kind": "adaptive", "min_batch": 32, "max_batch": 512, "source": "b_noise"}),
     "config.batch.schedule.source"),
    ("optim.name", "lion", "config.optim.name"),
    ("optim.learning_rate", 0.0, "config.optim.learning_rate"),
    ("optim.learning_rate", -1e-3, "config.optim.learning_rate"),
    ("optim.decay", "cosine", "config.optim.total_examples"),
    ("model.name", "resnet", "config.model.name"),
    ("data.name", "imagenet21k", "config.data.name"),
    ("noise.small_batch", 3, "config.noise.small_batch"),
    ("noise.method", "magic", "config.noise.method"),
    ("noise.live", "magic", "config.noise.live"),
    ("noise.ema_decay", 1.0, "config.noise.ema_decay"),
    ("noise.every", -1, "config.noise.every"),
    ("train.max_steps", -1, "config.train.max_steps"),
    ("train.checkpoint_every", 0, "config.train.checkpoint_every"),
    ("train.log_every", 0, "config.train.log_every"),
    ("train.grad_norm", "no", "config.train.grad_norm"),
    ("eval.batch_size", 0, "config.eval.batch_size"),
    ("mesh.data", 0, "config.mesh.data"),
    ("mesh.param_mode", "zero3", "config.mesh.param_mode"),
]


@pytest.mark.parametrize("key, value, field", BAD, ids=[f"{b[0]}={b[1]!r}"[:40] for b in BAD])
def test_bad_field_is_named(key, value, field):
    c = config_lib.default_config()
    _set(c, key, value)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.validate(c, data_replicas=1, model_names=("mlp", "cnn", "transformer"),
                            dataset_names=("digits", "mnist1d"))


@pytest.mark.parametrize("section, key, value, field", [
    ("optim", "eps", 0.0, "config.optim.eps"),
    ("optim", "weight_decay_mask", "odd", "config.optim.weight_decay_mask"),
    ("optim", "warmup_examples", -1, "config.optim.warmup_examples"),
    ("mesh", "data", True, "config.mesh.data"),
    ("mesh", "model", 0, "config.mesh.model"),
    ("perf", "profile_start", -2, "config.perf.profile_start"),
    ("data", "name", "imagenet21k", "config.data.name"),
    ("data", "options", ml_collections.ConfigDict({"colour": True}), "config.data.options"),
])
def test_each_component_checks_its_own_section(section, key, value, field):
    """The section's own validator names the field on its own, and `validate` reaches it."""
    from cbs import data
    from cbs.engine import optim
    from cbs.runtime import throughput
    own = {"optim": optim.validate_config, "mesh": mesh_lib.validate_config,
           "perf": throughput.validate_config, "data": data.validate_config}[section]
    c = config_lib.default_config()
    own(c[section])  # the defaults pass
    c[section][key] = value
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        own(c[section])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_lib.validate(c, data_replicas=1, model_names=("mlp",),
                            dataset_names=("digits", "mnist1d"))


def test_data_options_must_be_a_mapping():
    from cbs import data
    with pytest.raises(ValueError, match=r"config\.data\.options: must be a mapping"):
        data.validate_config({"name": "digits", "options": 3})


def test_a_decay_takes_its_end_from_the_run_budget():
    from cbs.engine import optim
    c = config_lib.default_config().optim
    c.decay = "cosine"
    with pytest.raises(ConfigError, match=r"config\.optim\.total_examples"):
        optim.validate_config(c)
    optim.validate_config(c, max_examples=1000)


def test_batch_must_divide_over_replicas():
    c = config_lib.default_config()  # m = 32, B = 128
    config_lib.validate(c, data_replicas=4)
    with pytest.raises(ConfigError, match=r"config\.batch\.schedule.*32 × 8"):
        config_lib.validate(c, data_replicas=8)


def test_noise_batch_must_fit_the_smallest_batch():
    c = config_lib.default_config()
    c.noise.every, c.noise.batch_size = 10, 256
    with pytest.raises(ConfigError, match=r"config\.noise\.batch_size"):
        config_lib.validate(c, data_replicas=1)


@pytest.fixture
def compile_events():
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: events.append(name) if "backend_compile" in name else None)
    return events


@pytest.mark.parametrize("key, value, field", [
    ("batch.schedule.batch_size", 36, "config.batch.schedule"),
    ("batch.schedule.batch_size", 4096, "config.batch.schedule"),  # > 1438 digits examples
    ("optim.name", "lamb", "config.optim.name"),
    ("model.name", "vit", "config.model.name"),
    ("model.hidden_sizes", (0,), "config.model"),
    ("data.name", "nope", "config.data.name"),
    ("data.options", ml_collections.ConfigDict({"colour": True}), "config.data.options"),
])
def test_trainer_fails_before_compiling(key, value, field, compile_events):
    c = config_lib.default_config()
    _set(c, key, value)
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    before = len(compile_events)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        trainer.Trainer(c, mesh=mesh)
    assert len(compile_events) == before


TRAINING_CONFIGS = ("digits_mlp.py", "mnist1d_mlp.py", "shakespeare_transformer.py", "cnn.py")


@pytest.mark.parametrize("path", [os.path.join(CONFIG_DIR, n) for n in TRAINING_CONFIGS],
                         ids=TRAINING_CONFIGS)
def test_experiment_configs_are_valid(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "cbs-train --config=" in module.__doc__  # the command that runs it
    for arg in ("tiny", ""):
        c = module.get_config(arg) if arg else module.get_config()
        config_lib.validate(c, data_replicas=1, model_names=("mlp", "cnn", "transformer"))
