"""The newest releases: JAX, jaxlib, flax, optax and orbax as the package index serves them
today, in a fresh virtual environment, run the tests of everything that reads jaxprs (ghost
norms, the coupling check, the drop-in, the nested primitives, the LM and its live estimate)
against their brute-force references.

JAX 0.11 dropped Python 3.11, so the newest releases need Python >= 3.12: the job takes
$CBS_NEWEST_PYTHON, else the newest `python3.1N` (N >= 2) on PATH or under pyenv. Marked
`newest` and run as its own job beside the default suite (README's test command, .ci/run):

    python -m pytest -m newest

Downloads (the one job that does, besides the slow floors check): pip fetches the newest
wheels (about 400 MB the first time; pip's cache serves later runs).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEWEST = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint"]
# the rest of cbs's requirements and the test tools these tests use, unpinned
OTHERS = ["etils[epath]", "ml_collections", "absl-py", "numpy", "scipy", "scikit-learn",
          "matplotlib", "tqdm", "pytest", "pytest-xdist", "packaging", "equinox", "dm-haiku"]
TESTS = ["tests/test_nested.py", "tests/test_ghost.py", "tests/test_ghost_fused.py",
         "tests/test_ghost_libraries.py", "tests/test_ghost_stats.py", "tests/test_ghost_tied.py",
         "tests/test_dropin.py", "tests/test_lm.py", "tests/test_live_noise.py"]

pytestmark = pytest.mark.newest


def newest_python() -> str | None:
    """A working Python >= 3.12 to install the newest releases into, or None (a pyenv shim
    whose version is not selected answers with an error: each candidate is run once)."""
    if os.environ.get("CBS_NEWEST_PYTHON"):
        return os.environ["CBS_NEWEST_PYTHON"]
    pyenv = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))
    found = sorted(glob.glob(f"{pyenv}/versions/3.1[2-9]*/bin/python"),
                   key=lambda p: Version(re.search(r"versions/([0-9.]+)", p)[1]), reverse=True)
    found += [shutil.which(f"python3.{minor}") for minor in range(20, 11, -1)]
    for candidate in filter(None, found):
        check = subprocess.run([candidate, "-c", "import sys, venv; "
                                "assert sys.version_info >= (3, 12)"], capture_output=True)
        if check.returncode == 0:
            return candidate
    return None


def _pinned(name: str) -> Version:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return Version(next(line.split("==")[1] for line in lines if line.startswith(f"{name}==")))


def _run(args, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, args[:6]))}:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


def test_walkers_on_the_newest_releases(tmp_path):
    python = newest_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("no Python >= 3.12 for the newest-releases job (set CBS_NEWEST_PYTHON)")
        pytest.skip("no Python >= 3.12 here (set CBS_NEWEST_PYTHON)")
    venv = tmp_path / "venv"
    _run([python, "-m", "venv", str(venv)], timeout=300)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    _run([py, "-m", "pip", "install", "-q", "--upgrade", "--only-binary=:all:", *NEWEST,
          *OTHERS], env=env, timeout=1800)
    listed = json.loads(_run([py, "-m", "pip", "list", "--format=json"], env=env,
                             timeout=300).stdout)
    versions = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    print("newest releases:", {n: versions[n] for n in NEWEST})
    # the job is worth its time only where the index serves something the tested set lacks
    assert Version(versions["jax"]) >= _pinned("jax")
    env["PYTHONPATH"] = str(ROOT)  # cbs from this source tree, with no other install
    proc = _run([py, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o",
                 "addopts=-m 'not slow and not newest' --strict-markers", *TESTS], env=env,
                cwd=ROOT, timeout=3000)
    tail = proc.stdout.strip().splitlines()[-1]
    print(f"jax {versions['jax']}, flax {versions['flax']}: {tail}")
    assert re.search(r"\d+ passed", tail) and "failed" not in tail and "error" not in tail, tail
