"""Bad sweep, ramp, branch and compare input is refused before anything is written: the type
and range of every field, in one line naming the dotted field (or flag) and what to change,
and the target directory is left as it was (no sweep.json, branch.json, locks or records).

Most cases call the library in process (validation fails before any training, so each takes
milliseconds); one case per command runs the command line, for the one-line error, exit
status 2 and the order of validation and the first write.
"""

from __future__ import annotations

import os
import pathlib

import _warm
import jax
import ml_collections
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.results import files, records
from cbs.runtime import cli
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.fields import ConfigError
from cbs.sweeps import branches, launch, ramps
from experiments.configs import digits_branch, digits_ramps, digits_sweep

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"


def _untyped(section: ml_collections.ConfigDict, **changes) -> ml_collections.ConfigDict:
    """`section` with `changes`, any type allowed (a config file may write anything)."""
    return ml_collections.ConfigDict(dict(section.to_dict(), **changes), type_safe=False)


def _left_alone(d: pathlib.Path) -> None:
    """The directory holds nothing a study writes (it may not exist at all)."""
    assert not d.exists() or sorted(os.listdir(d)) == ["kept.txt"], sorted(os.listdir(d))


def _one_device():
    return mesh_lib.make_mesh(data=1, model=1, devices=jax.devices()[:1])


def _existing(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "study"
    d.mkdir()
    (d / "kept.txt").write_text("a file of the user's")
    return d


# ---------------------------------------------------------------------------- in process

@pytest.mark.parametrize("field,value,says", [
    ("targets", ("abc",), "list of numbers > 0"),
    ("targets", (-1.0,), "never below 0"),
    ("targets", (float("nan"),), "list of numbers > 0"),
    ("targets", 0.5, "list of numbers > 0"),
    ("batch_sizes", (8, "a"), "list of integers > 0"),
    ("batch_sizes", (True, 8), "list of integers > 0"),
    ("seeds", (-1,), "integers >= 0"),
    ("learning_rates", ("x",), "list of numbers > 0"),
    ("base_lr", float("inf"), "finite number"),
    ("max_steps", 1.5, "integer >= 0"),
    ("max_examples", -1, "integer >= 0"),
    ("evals_per_trial", "many", "integer >= 2"),
    ("loss_ema_decay", 1.0, "[0, 1)"),
    ("divergence_factor", float("nan"), "finite number"),
    ("vmap_trials", "yes", "True or False"),
    ("noise_reference_evals", 1, "integer >= 2"),
    ("checkpoint_every_evals", 0, "integer >= 1"),
])
def test_a_bad_sweep_field_is_refused_before_anything_is_written(tmp_path, field, value, says):
    c = digits_sweep.get_config("tiny")
    c.sweep = _untyped(c.sweep, **{field: value})
    d = _existing(tmp_path)
    with pytest.raises(ConfigError, match=rf"^config\.sweep\.{field}: ") as err:
        launch.run_sweep(c, str(d), log=lambda _: None)
    assert says in str(err.value) and "\n" not in str(err.value)
    _left_alone(d)


@pytest.mark.parametrize("change,field,says", [
    ({"learning_rate": "best@abc"}, "[0].learning_rate", "'best@B'"),
    ({"learning_rate": "best@7"}, "[0].learning_rate", "does not train"),
    ({"learning_rate": -1.0}, "[0].learning_rate", "> 0"),
    ({"label": ""}, "[0].label", "non-empty string"),
    ({"seed": -1}, "[0].seed", "integer >= 0"),
    ({"eval_every": 1.5}, "[0].eval_every", "integer >= 1"),
    ({"lr": 0.1}, "[0]", "unknown fields ['lr']"),
    ({"schedule": {"kind": "zigzag"}}, "[0].schedule", "zigzag"),
    ({"lr_coupling": {"rule": "cube"}}, "[0].lr_coupling.rule", "cube"),
    ({"micro_batch": 7}, "[0]", "not a positive multiple of micro_batch"),
])
def test_a_bad_ramp_is_refused_before_anything_is_written(tmp_path, change, field, says):
    c = digits_ramps.get_config("tiny")
    c.ramps = [dict(c.ramps[0], **change), *c.ramps[1:]]
    d = _existing(tmp_path)
    with pytest.raises(ConfigError) as err:
        ramps.run_ramps(c, str(d), log=lambda _: None, mesh=_one_device())
    assert str(err.value).startswith(f"config.ramps{field}: ") and says in str(err.value)
    _left_alone(d)


@pytest.mark.parametrize("field,value,says", [
    ("ks", (1, "2"), "list of integers >= 1"),
    ("points_examples", (-5,), "integers >= 0"),
    ("points_losses", (0.0,), "numbers > 0"),
    ("seeds", (1.5,), "integers >= 0"),
    ("window_examples", -128, "integer >= 0"),
    ("epsilon", "small", "finite number"),
    ("vmap", 1, "True or False"),
    ("noise_deviations", 16, "moved to config.branch.noise.deviations"),
])
def test_a_bad_branch_field_is_refused_before_anything_is_written(tmp_path, field, value,
                                                                     says):
    c = digits_branch.get_config("tiny")
    c.branch = _untyped(c.branch, **{field: value})
    d = tmp_path / "branch"
    with pytest.raises(ConfigError, match=rf"^config\.branch\.{field}: ") as err:
        branches.run_branches(c, str(d), log=lambda _: None)
    assert says in str(err.value)
    assert not d.exists()


def test_a_branch_study_checks_its_shard_and_reference_run_before_writing(tmp_path):
    d = tmp_path / "branch"
    with pytest.raises(ValueError, match="--shard=3/2"):
        branches.run_branches(digits_branch.get_config("tiny"), str(d), shard="3/2")
    c = digits_branch.get_config("tiny")
    c.optim.learning_rate = -1.0  # the reference run's own config, as the engine checks it
    with pytest.raises(ConfigError, match=r"^config\.optim\.learning_rate"):
        branches.run_branches(c, str(d), log=lambda _: None)
    assert not d.exists()


def test_valid_ramps_and_sweeps_of_every_preset_pass(tmp_path):
    """The checks refuse nothing the committed studies use."""
    from cbs.configs import digits_payoff, shakespeare_payoff

    for module in (digits_ramps, digits_payoff, shakespeare_payoff):
        for arg in ("", "tiny"):
            ramps.validate_ramps(module.get_config(arg), replicas=1)
    launch.check_config(digits_sweep.get_config("tiny"))


# ---------------------------------------------------------------------------- command line

def _cli(module: str, *args: str) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != cli.VERBOSE_ENV}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    proc = _warm.python(["-m", f"experiments.{module}", *args], env=env, timeout=180)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


def test_each_command_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path):
    d = _existing(tmp_path)
    bad_ramp = tmp_path / "bad_ramp.py"
    bad_ramp.write_text("from experiments.configs import digits_ramps\n\n\n"
                        "def get_config(arg=''):\n"
                        "    c = digits_ramps.get_config(arg)\n"
                        "    c.ramps = [dict(c.ramps[0], learning_rate='best@7')]\n"
                        "    return c\n")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    records.write_json_atomic(sweep / files.SWEEP_FILE, {"config": {}})
    cases = {
        "sweep": (["--config=digits_sweep:tiny", f"--sweep_dir={d}",
                   "--config.sweep.targets=-1.0"], "config.sweep.targets: "),
        "ramps": ([f"--config={bad_ramp}:tiny", f"--sweep_dir={d}"],
                  "config.ramps[0].learning_rate: 'best@7'"),
        "branch": ([f"--config={CONFIGS / 'digits_branch.py'}:tiny", f"--workdir={d}",
                    "--config.branch.noise.deviations=0"], "config.branch.noise.deviations: "),
        "compare": ([str(sweep), str(tmp_path / "nowhere"), f"--out={d}"],
                    "is not a sweep directory"),
    }
    for module, (args, expect) in cases.items():
        rc, lines = _cli(module, *args)
        assert rc == cli.USER_ERROR_EXIT, (module, lines)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], (
            module, lines)
        _left_alone(d)
