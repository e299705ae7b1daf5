"""cbs.configs: the packaged presets by name, `--config` resolution, and the repository paths
`experiments/configs/<name>.py` that re-export them."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from cbs import commands, configs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESET = str(ROOT / "cbs" / "configs" / "digits_sweep.py")


def test_names_are_the_modules_with_get_config():
    found = configs.names()
    assert {"digits_sweep", "digits_mlp", "digits_branch", "digits_ramps", "lm_shakespeare"
            } <= set(found)
    assert "base" not in found
    assert found == sorted(found)


@pytest.mark.parametrize("value, expected", [
    ("digits_sweep", PRESET),
    ("digits_sweep:tiny", PRESET + ":tiny"),
    ("cbs:digits_sweep", PRESET),
    ("cbs:digits_sweep:tiny", PRESET + ":tiny"),
    ("experiments/configs/digits_sweep.py:tiny", "experiments/configs/digits_sweep.py:tiny"),
    ("/abs/elsewhere/my_config.py", "/abs/elsewhere/my_config.py"),
    ("my_config.py:small", "my_config.py:small"),
])
def test_resolve_maps_names_to_the_packaged_file_and_leaves_paths(value, expected):
    assert configs.resolve(value) == expected


def test_resolve_keeps_an_existing_file_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits_sweep").write_text("")
    assert configs.resolve("digits_sweep:tiny") == "digits_sweep:tiny"
    assert configs.resolve("cbs:digits_sweep:tiny") == PRESET + ":tiny"


@pytest.mark.parametrize("value", ["nosuch", "cbs:nosuch:tiny", "cbs:base", "digits-sweep"])
def test_resolve_refuses_an_unknown_name_listing_the_presets(value):
    with pytest.raises(ValueError, match="no such config file or packaged preset.*digits_sweep"):
        configs.resolve(value)


def test_commands_rewrite_the_config_flag_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["cbs-sweep", "--config=digits_sweep:tiny", "--sweep_dir=x",
            "--config", "cbs:digits_mlp"]
    commands.make_configs_importable(argv)
    assert argv == ["cbs-sweep", f"--config={PRESET}:tiny", "--sweep_dir=x",
                    f"--config={ROOT / 'cbs' / 'configs' / 'digits_mlp.py'}"]


def test_commands_refuse_an_unknown_preset_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        commands.make_configs_importable(["cbs-train", "--config=digits_swep:tiny"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config=digits_swep: no such") and err.count("\n") == 1


def test_every_repository_path_re_exports_the_packaged_module():
    here = {p.stem for p in (ROOT / "experiments" / "configs").glob("*.py")} - {"__init__"}
    packaged = {p.stem for p in (ROOT / "cbs" / "configs").glob("*.py")} - {"__init__"}
    assert here == packaged
    for name in configs.names():
        old = importlib.import_module(f"experiments.configs.{name}")
        assert old.get_config is importlib.import_module(f"cbs.configs.{name}").get_config
    from experiments.configs import base

    assert base.base_config is importlib.import_module("cbs.configs.base").base_config


@pytest.mark.parametrize("value", ["digits_sweep:tiny", "cbs:digits_sweep:tiny",
                                   "experiments/configs/digits_sweep.py:tiny"])
def test_the_flag_library_loads_a_resolved_value(value, monkeypatch):
    """What the commands' `--config` flag parses: the same tiny config by name and by path."""
    from absl import flags
    from ml_collections import config_flags

    monkeypatch.chdir(ROOT)
    holder = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=holder)
    holder(["prog", f"--config={configs.resolve(value)}"])
    expected = importlib.import_module("cbs.configs.digits_sweep").get_config("tiny")
    assert holder.config.to_dict() == expected.to_dict()


@pytest.mark.parametrize("arg, kind, first, rate", [
    ("llama3", "step", 32, 5e-3), ("deepseek", "linear", 32, 5e-3),
    ("adaptive", "adaptive", 16, 4e-3), ("adaptive,calibrated,tiny", "adaptive", 16, 4e-3)])
def test_each_digits_ramp_is_a_run_of_its_own(arg, kind, first, rate):
    from cbs.configs import digits_ramps
    from cbs.engine import config as config_lib
    c = digits_ramps.get_config(arg)
    config_lib.validate(c, data_replicas=1)
    assert "sweep" not in c and "ramps" not in c
    assert c.batch.schedule.kind == kind and c.batch.micro_batch == 16
    assert c.batch.lr_coupling.base_batch_size == first and c.optim.learning_rate == rate
    assert (c.batch.schedule.get("rule") == "calibrated") == ("calibrated" in arg)
    shape = {"step": digits_ramps.STEP, "linear": digits_ramps.LINEAR,
             "adaptive": digits_ramps.ADAPTIVE}[kind]  # the study's ramp of the same shape
    assert {r["schedule"]["kind"] for r in digits_ramps.get_config("").ramps} >= {kind}
    for key, value in shape.items():
        assert c.batch.schedule[key] == (tuple(map(tuple, value)) if key == "steps" else value)


@pytest.mark.parametrize("arg", ["llama3,deepseek", "llama3,calibrated", "calibrated"])
def test_digits_ramps_refuses_two_ramps_or_calibrated_without_adaptive(arg):
    from cbs.configs import digits_ramps
    with pytest.raises(ValueError, match="at most one ramp"):
        digits_ramps.get_config(arg)


@pytest.mark.parametrize("preset", ["cnn", "cnn_sweep"])
def test_a_cnn_preset_refuses_two_datasets(preset):
    """One dataset per config (two would pick one by the order of a set)."""
    import importlib
    module = importlib.import_module(f"cbs.configs.{preset}")
    with pytest.raises(ValueError, match="names 2 datasets .*: name one of"):
        module.get_config("mnist,cifar10")
    assert module.get_config("cifar10,tiny").data.name == "cifar10"
