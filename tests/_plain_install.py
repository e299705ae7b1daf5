"""A plain install (`pip install -e .`, no extras), simulated: a new Python whose import of
every optional extra's package fails as if it were not installed (`sys.modules[name] = None`
before the command starts). The core dependencies are those of a plain install."""

from __future__ import annotations

import pathlib
import subprocess

import _warm
from conftest import SUBPROCESS_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXTRAS = ("tensorboardX", "wandb", "mnist1d", "tensorflow_datasets", "tensorflow", "gcsfs")
SHIM = _warm.shim(EXTRAS)


def run(target: str, *args: str, timeout: float = 300, devices: int = 1
        ) -> subprocess.CompletedProcess:
    """`python -m target args` (or `python target.py args`) from the repository root with the
    extras blocked, on `devices` CPU devices (in a warm process: tests/_warm.py)."""
    env = _warm.base_env() | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
                                           f"{SUBPROCESS_XLA_FLAGS}"}
    env.pop("CBS_VERBOSE", None)
    argv = [target] if target.endswith(".py") else ["-m", target]
    return _warm.python([*argv, *args], env=env, timeout=timeout, block=EXTRAS)
