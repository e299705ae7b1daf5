"""The declared floors are true: a fresh virtual environment with every direct dependency at
exactly its lowest declared version (pyproject.toml's `>=`) installs, satisfies cbs-jax's
metadata (`pip check`), and runs a tiny run with `cbs-train`.

Slow, and the one test that downloads: pip fetches the floor versions from the package index
(a few hundred MB the first time; pip's cache serves later runs). Run it with
`python -m pytest -m slow tests/test_floors.py` after changing a floor or a use of a newer API.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import SUBPROCESS_XLA_FLAGS
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
_FLOOR = re.compile(r"^([A-Za-z0-9_.\-]+(?:\[[^\]]+\])?)>=([0-9][0-9a-z.]*)$")


def floor_pins() -> list[str]:
    """`name[extras]==floor` for every direct dependency of the package."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = []
    for dep in deps:
        match = _FLOOR.match(dep.replace(" ", ""))
        assert match, f"{dep!r}: every direct dependency declares one floor (name>=version)"
        pins.append(f"{match[1]}=={match[2]}")
    return pins


def test_every_direct_dependency_has_a_floor():
    pins = floor_pins()
    assert len(pins) == len(tomllib.loads((ROOT / "pyproject.toml").read_text())
                            ["project"]["dependencies"])
    assert any(p.startswith("jax==") for p in pins) and any(p.startswith("flax==") for p in pins)


def test_constraints_pin_every_direct_dependency_at_or_above_its_floor():
    """constraints.txt (the tested set) satisfies the declared requirements."""
    from packaging.requirements import Requirement

    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pinned = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pinned and req.specifier.contains(pinned[name]), (dep, pinned.get(name))


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(args[:4])}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_lowest_declared_versions_run_a_tiny_run(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one device, as a user's run
    _run([python, "-m", "pip", "install", "-q", "--only-binary=:all:", *floor_pins()],
         env=env, timeout=1800)
    src = tmp_path / "src"  # a copy, so the checkout gets no build/ or egg-info directories
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "cbs", src / "cbs", ignore=shutil.ignore_patterns("__pycache__"))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", str(src)], env=env, timeout=900)
    _run([python, "-m", "pip", "check"], env=env, timeout=300)
    freeze = _run([python, "-m", "pip", "list", "--format=json"], env=env, timeout=300).stdout
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(freeze)}
    for pin in floor_pins():
        name, version = re.sub(r"\[.*\]", "", pin).split("==")
        assert Version(installed[name.lower().replace("_", "-")]) == Version(version), name
    away = tmp_path / "elsewhere"
    away.mkdir()
    proc = _run([str(venv / "bin" / "cbs-train"), "--config=digits_mlp:tiny",
                 "--workdir=run"], cwd=away, env=env, timeout=1200)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["status"] == "finished" and summary["step"] == 20, summary
