"""The distribution: the wheel holds the `cbs` package only (no top-level `experiments`), its
data files, the license and the console scripts; the console scripts' functions exist; the
experiments/ entry points are thin wrappers of `cbs.commands`.

The wheel is built offline from a copy of the sources (`pip wheel --no-deps
--no-build-isolation`, with the setuptools and wheel of the test environment), so the
checkout gets no build/ or egg-info directories.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from conftest import SUBPROCESS_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = {"cbs-train": "cbs.commands.train:run", "cbs-sweep": "cbs.commands.sweep:run",
           "cbs-analyze": "cbs.commands.analyze:run", "cbs-branch": "cbs.commands.branch:run",
           "cbs-ramps": "cbs.commands.ramps:run", "cbs-compare": "cbs.commands.compare:run",
           "cbs-advise": "cbs.commands.advise:run"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "cbs", src / "cbs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "experiments", src / "experiments",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (  # the SPDX license needs setuptools>=77 (the test extra)
        f"setuptools {importlib.metadata.version('setuptools')}: {proc.stderr[-3000:]}")
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_the_library_its_data_and_license_only(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"cbs"}, top
    assert [d.split("-")[0] for d in dist_info] == ["cbs_jax"]
    assert any(n.startswith("cbs/data/files/") and n.endswith(".xz") for n in names)
    assert "cbs/results/shipped/calibration.json" in names  # cbs.results.calibration.shipped
    assert "cbs/commands/train.py" in names
    assert "cbs/py.typed" in names  # PEP 561: type checkers read cbs's own annotations
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    assert "License-Expression: Apache-2.0\n" in text and "License-File: LICENSE\n" in text
    assert "Classifier: License ::" not in text  # superseded by the SPDX expression
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert "Name: cbs-jax\n" in text and f"Version: {version}\n" in text
    for extra in ("tfds", "mnist1d", "tensorboard", "wandb", "gcs", "all", "test"):
        assert f"Provides-Extra: {extra}\n" in text


def test_wheel_lists_the_console_scripts(wheel):
    (entry,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(entry).decode().splitlines()
    found = dict(line.replace(" ", "").split("=") for line in lines if "=" in line)
    assert found == SCRIPTS


def test_console_script_functions_exist_and_experiments_wrap_them():
    """Parsed, not imported: each command module defines its own absl flags, and several in
    one process would define some twice."""
    for target in SCRIPTS.values():
        module, function = target.split(":")
        path = ROOT / (module.replace(".", "/") + ".py")
        defined = {n.name for n in ast.parse(path.read_text()).body
                   if isinstance(n, ast.FunctionDef)}
        assert {function, "main"} <= defined, path
    for wrapper, command in [("main", "train"), ("sweep", "sweep"), ("analyze", "analyze"),
                             ("branch", "branch"), ("ramps", "ramps"),
                             ("compare", "compare"), ("advise", "advise")]:
        text = (ROOT / "experiments" / f"{wrapper}.py").read_text()
        assert f"from cbs.commands.{command} import main, run" in text


def test_version_and_changelog_agree():
    import cbs

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cbs.__version__ == version
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_console_script_finds_a_checkout_config(tmp_path, monkeypatch):
    """`cbs-train --config=experiments/configs/...` run outside the checkout: the config's
    own `from experiments.configs import base` resolves."""
    from cbs import commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    commands.make_configs_importable(
        ["cbs-train", f"--config={ROOT / 'experiments' / 'configs' / 'digits_mlp.py'}:tiny"])
    assert sys.path[0] == str(ROOT)


def test_wheel_ships_every_preset_without_the_checkout(wheel):
    """The presets are in the wheel (selectable by name without a checkout), and no file of
    the wheel imports the repository-only `experiments` package."""
    from cbs import configs

    names = set(wheel.namelist())
    assert {f"cbs/configs/{n}.py" for n in configs.names()} <= names
    assert {"cbs/configs/__init__.py", "cbs/configs/base.py"} <= names
    for name in sorted(n for n in names if n.endswith(".py")):
        for node in ast.walk(ast.parse(wheel.read(name).decode(), name)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""])
                assert not any(m.split(".")[0] == "experiments" for m in modules), name


def test_install_command_follows_how_cbs_was_installed(tmp_path, monkeypatch):
    from cbs.results import extras

    assert extras.install_command("tfds") == 'pip install -e ".[tfds]"'  # this checkout
    site = tmp_path / "site-packages"
    (site / "cbs" / "results").mkdir(parents=True)
    monkeypatch.setattr(extras, "__file__", str(site / "cbs" / "results" / "extras.py"))
    assert extras.install_command("tfds") == 'pip install "cbs-jax[tfds]"'  # from a wheel
    (site / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert extras.install_command("gcs") == 'pip install "cbs-jax[gcs]"'


def _wheel_venv(wheel: zipfile.ZipFile, where: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """A fresh virtual environment over this one's packages with only the wheel installed
    into it (no dependencies fetched), and an environment that does not see the checkout."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(where)],
                   check=True, timeout=300)
    python = where / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--ignore-installed", str(wheel.filename)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one device, as a user's run
    return python, env


@pytest.mark.slow
def test_wheel_alone_runs_the_tiny_main_job_outside_the_checkout(wheel, tmp_path):
    """Installed from the wheel, in a directory outside the checkout: cbs comes from the
    wheel, the missing-extra hint names the wheel's install line, and `cbs-sweep` runs the
    packaged tiny preset by name (about 3 min on 2 shared CPU cores)."""
    python, env = _wheel_venv(wheel, tmp_path / "venv")
    away = tmp_path / "elsewhere"
    away.mkdir()
    probe = subprocess.run([str(python), "-c", "import cbs; print(cbs.__file__); "
                            "from cbs.results.extras import install_command; "
                            "print(install_command('tfds'))"], cwd=away, env=env,
                           capture_output=True, text=True, timeout=300)
    where, hint = probe.stdout.splitlines()
    assert where.startswith(str(tmp_path / "venv")), where
    assert hint == 'pip install "cbs-jax[tfds]"'
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "cbs-sweep"),
                           "--config=digits_sweep:tiny", "--sweep_dir=sweep"], cwd=away,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = (away / "sweep" / "trials.jsonl").read_text().splitlines()
    assert len(trials) >= 3 and (away / "sweep" / "report.md").is_file()  # trained, fit, reported


def test_readme_and_changelog_list_every_console_script():
    """README's list of console scripts (with their `python -m experiments.*` twins) and the
    CHANGELOG's name every script of pyproject.toml, no more and no fewer."""
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    assert scripts == set(SCRIPTS)
    readme = " ".join((ROOT / "README.md").read_text().split())
    listed = readme.split("installs the commands as console scripts,")[1].split("the same")[0]
    assert set(re.findall(r"`(cbs-[a-z]+)`", listed)) == scripts
    twins = re.search(r"`python -m experiments\.([a-z|]+)`", readme.split(listed)[1]).group(1)
    assert len(twins.split("|")) == len(scripts)
    assert all((ROOT / "experiments" / f"{m}.py").is_file() for m in twins.split("|"))
    changelog = " ".join((ROOT / "CHANGELOG.md").read_text().split())
    bullet = changelog.split("- Console scripts ")[1].split(";")[0]
    assert set(re.findall(r"`(cbs-[a-z]+)`", bullet)) == scripts
