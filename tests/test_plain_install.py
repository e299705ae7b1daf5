"""README's commands on the plain install (`pip install -e .`, no extras).

A plain install is simulated, not built (`tests/_plain_install.py`): each command runs in a
new Python process (started warm: `tests/_warm.py`) whose import of every optional extra's
package (tensorboardX, wandb, mnist1d, tensorflow_datasets, tensorflow, gcsfs) fails as if it
were not installed. Commands that need
no extra must succeed; a command that needs one must stop with one line on stderr naming it,
exit status 2, and leave no directory behind. Tiny config variants keep them short; the
complete runs are marked slow. The guides' quick commands run on the same simulated plain
install (tests/test_guide_commands.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import _plain_install
import pytest

ROOT = _plain_install.ROOT
EXTRAS, _SHIM = _plain_install.EXTRAS, _plain_install.SHIM


def _plain(target: str, *args: str, timeout: float = 300):
    """Runs `target args` on the simulated plain install; returns (exit status, stdout,
    non-empty stderr lines)."""
    proc = _plain_install.run(target, *args, timeout=timeout)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, proc.stdout, errors


def _config(name: str) -> str:
    return f"--config={ROOT / 'experiments' / 'configs' / name}"


def test_the_shim_blocks_every_extra():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    check = _SHIM.split("target =")[0] + (
        "import importlib\n"
        f"for name in {EXTRAS!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except ImportError:\n        continue\n"
        "    raise SystemExit(name + ' imported')\n")
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # fast form: the training guide's quick command, the same command on the
#                   same simulated plain install (tests/test_guide_commands.py)
def test_training_command_runs_without_tensorboard(tmp_path):
    """README's Training command: TensorBoard is off by default, so no extra is needed."""
    code, out, errors = _plain("experiments.main", _config("digits_mlp.py:tiny"),
                               f"--workdir={tmp_path / 'mlp'}")
    assert code == 0, "\n".join(errors[-20:])
    assert '"status": "finished"' in out
    assert not (tmp_path / "mlp" / "tensorboard").exists()


@pytest.mark.parametrize("target,args,extra", [
    ("experiments.main", ("digits_mlp.py:tiny", "--config.train.tensorboard=True"),
     "tensorboard"),
    ("experiments.main", ("digits_mlp.py:tiny", "--config.train.wandb=cbs"), "wandb"),
    ("experiments.main", ("mnist1d_mlp.py:tiny",), "mnist1d"),
    ("experiments.main", ("cnn.py",), "tfds"),
    ("experiments.sweep", ("cnn_sweep.py:mnist",), "tfds"),
    ("experiments.branch", ("digits_branch.py:tiny",), "gcs"),
    ("experiments.sweep", ("digits_sweep.py:tiny",), "gcs"),
    ("experiments.main", ("digits_mlp.py:tiny",), "gcs"),
])
def test_a_missing_extra_is_one_line_and_exit_2(tmp_path, target, args, extra):
    config, *rest = args
    out_flag = "--sweep_dir" if target == "experiments.sweep" else "--workdir"
    out_dir = "gs://cbs-test-bucket/run" if extra == "gcs" else str(tmp_path / "new" / "run")
    code, _, errors = _plain(target, _config(config), *rest, f"{out_flag}={out_dir}")
    assert code == 2, "\n".join(errors[-20:])
    assert len(errors) == 1 and errors[0].startswith("error: "), errors
    assert f'pip install -e ".[{extra}]"' in errors[0]
    assert not (tmp_path / "new").exists()  # no half-made directory


def test_data_throughput_benchmark_names_the_missing_extra():
    code, _, errors = _plain("benchmarks/data_throughput.py", "--quick", "--datasets=mnist1d")
    assert code == 2, "\n".join(errors[-20:])
    assert len(errors) == 1 and '".[mnist1d]"' in errors[0], errors


def test_data_throughput_skips_a_dataset_whose_extra_is_missing(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import data_throughput
    finally:
        sys.path.remove(str(ROOT))
    # Its import fails, as in a plain install: the package and any submodule an earlier test
    # of this process imported (`from mnist1d.data import ...` would otherwise find it).
    for name in [n for n in sys.modules if n == "mnist1d" or n.startswith("mnist1d.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    plan = data_throughput._plan([], quick=True)
    assert [p[0] for p in plan] == ["digits", "shakespeare_char"]
    assert "mnist1d skipped" in capsys.readouterr().err


@pytest.mark.slow
def test_main_job_lm_and_branch_commands_run(tmp_path):
    """The sweep + analyze, LM, branch and ramp-payoff commands of README, tiny, end to end."""
    sweep = tmp_path / "digits"
    for target, args in [
        ("experiments.sweep", (_config("digits_sweep.py:tiny"), f"--sweep_dir={sweep}")),
        ("experiments.analyze", (f"--sweep_dir={sweep}",)),
        ("experiments.main", (_config("shakespeare_transformer.py:tiny"),
                              f"--workdir={tmp_path / 'lm'}",
                              "--config.batch.schedule.batch_size=16")),
        ("experiments.branch", (_config("digits_branch.py:tiny"),
                                f"--workdir={tmp_path / 'branch'}", f"--sweep_dir={sweep}")),
        ("experiments.ramps", (_config("digits_payoff.py:tiny"), f"--sweep_dir={sweep}",
                               f"--out_dir={tmp_path / 'payoff'}")),
    ]:
        code, out, errors = _plain(target, *args, timeout=600)
        assert code == 0, f"{target}: " + "\n".join(errors[-20:])
    assert (sweep / "report.md").exists() and (tmp_path / "branch" / "local_cbs.png").exists()
    assert (tmp_path / "payoff" / "payoff.md").exists()
