"""A plain install (`pip install -e .`, no extras), simulated: a fresh Python whose import of
every optional extra's package fails as if it were not installed (`sys.modules[name] = None`
before the command starts). The core dependencies are those of a plain install."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from conftest import SUBPROCESS_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXTRAS = ("tensorboardX", "wandb", "mnist1d", "tensorflow_datasets", "tensorflow", "gcsfs")
SHIM = f"""
import runpy, sys
for name in {EXTRAS!r}:
    sys.modules[name] = None
target = sys.argv[1]
sys.argv = sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def run(target: str, *args: str, timeout: float = 300, devices: int = 1
        ) -> subprocess.CompletedProcess:
    """`python -m target args` (or `python target.py args`) from the repository root with the
    extras blocked, on `devices` CPU devices."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         f"{SUBPROCESS_XLA_FLAGS}")
    env.pop("CBS_VERBOSE", None)
    return subprocess.run([sys.executable, "-c", SHIM, target, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
