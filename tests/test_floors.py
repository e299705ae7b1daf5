"""The declared floors are true: a fresh virtual environment with every direct dependency at
exactly its lowest declared version (pyproject.toml's `>=`) installs and satisfies cbs-jax's
metadata (`pip check`); there one `nnx.jit` step of the NNX drop-in and a tiny sweep run
(the default suite, so CI checks the floors on every change), and a tiny `cbs-train` run
(slow).

The one test module of the default suite that downloads: pip fetches the floor versions from
the package index (a few hundred MB the first time; pip's cache serves later runs).
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


_NNX_JIT_STEP = """
import jax, jax.numpy as jnp, optax
from flax import nnx
from cbs import noise

class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)
    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))

def loss(model, batch):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]),
                                                                    batch["y"]))

batch = {"x": jax.random.normal(jax.random.key(1), (32, 8)), "y": jnp.arange(32) % 3}
value, grads, stats = nnx.jit(noise.nnx_value_grad_and_stats(loss))(MLP(nnx.Rngs(0)), batch)
assert jnp.isfinite(value) and jnp.isfinite(stats.trace_sigma), (value, stats)
print("nnx.jit step", jax.__version__)
"""


@pytest.fixture(scope="module")
def floors(tmp_path_factory):
    """(python, env) of a venv with every direct dependency at its floor and cbs-jax from a
    copy of this checkout (so the checkout gets no build/ or egg-info directories)."""
    root = tmp_path_factory.mktemp("floors")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "JAX_COMPILATION_CACHE_DIR")}
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one device, as a user's run
    _run([python, "-m", "pip", "install", "-q", "--only-binary=:all:", *floor_pins()],
         env=env, timeout=1800)
    src = root / "src"
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
    return python, env, venv


def test_lowest_declared_versions_run_an_nnx_jit_step_and_a_tiny_sweep(floors, tmp_path):
    """The floors' fast check: flax 0.12.1 with jax 0.9.2 failed the first (`nnx.jit`
    passed `abstracted_axes` to a jax.jit that has none)."""
    python, env, venv = floors
    step = _run([python, "-c", _NNX_JIT_STEP], env=env, cwd=tmp_path, timeout=600)
    assert "nnx.jit step 0.9.2" in step.stdout
    configs = ROOT / "experiments" / "configs" / "digits_sweep.py"
    sweep = _run([str(venv / "bin" / "cbs-sweep"), f"--config={configs}:tiny",
                  "--sweep_dir=sweep"], env=env, cwd=tmp_path, timeout=1200)
    assert "report:" in sweep.stdout and (tmp_path / "sweep" / "report.md").exists()


@pytest.mark.slow
def test_lowest_declared_versions_run_a_tiny_run(floors, tmp_path):
    python, env, venv = floors
    proc = _run([str(venv / "bin" / "cbs-train"), "--config=digits_mlp:tiny",
                 "--workdir=run"], cwd=tmp_path, env=env, timeout=1200)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["status"] == "finished" and summary["step"] == 20, summary
