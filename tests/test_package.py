"""The distribution: the wheel holds the `cbs` package only (no top-level `experiments`), its
data files, the license and the console scripts; the console scripts' functions exist; the
experiments/ entry points are thin wrappers of `cbs.commands`.

The wheel is built offline from a copy of the sources (`pip wheel --no-deps
--no-build-isolation`, with the setuptools and wheel of the test environment), so the
checkout gets no build/ or egg-info directories.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = {"cbs-train": "cbs.commands.train:run", "cbs-sweep": "cbs.commands.sweep:run",
           "cbs-analyze": "cbs.commands.analyze:run", "cbs-branch": "cbs.commands.branch:run",
           "cbs-ramps": "cbs.commands.ramps:run", "cbs-compare": "cbs.commands.compare:run"}


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
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_the_library_its_data_and_license_only(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"cbs"}, top
    assert [d.split("-")[0] for d in dist_info] == ["cbs_jax"]
    assert any(n.startswith("cbs/data/files/") and n.endswith(".xz") for n in names)
    assert "cbs/commands/train.py" in names
    assert any(n.endswith(".dist-info/LICENSE") for n in names)
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert "Name: cbs-jax\n" in text and f"Version: {version}\n" in text
    for extra in ("tfds", "mnist1d", "tensorboard", "gcs", "all", "test"):
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
                             ("compare", "compare")]:
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
