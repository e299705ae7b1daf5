"""The optional extras of the distribution (`cbs-jax[tfds]`, `[gcs]`, `[tensorboard]`, ...):
the command that installs one for this copy of cbs, which every missing-extra error names
(the data sources, gs:// paths and the metric writers)."""

from __future__ import annotations

import os

__all__ = ["install_command"]


def install_command(extra: str) -> str:
    """The command that installs the optional extra `extra` (e.g. "tfds") for this copy of cbs:
    `pip install -e ".[tfds]"` when cbs runs from a source checkout (an editable install or
    the checkout on sys.path: a pyproject.toml of cbs-jax beside the package), else
    `pip install "cbs-jax[tfds]"` (an install from a wheel). Missing-extra errors name it."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../cbs
    root = os.path.dirname(package)
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            checkout = 'name = "cbs-jax"' in f.read()
    except OSError:
        checkout = False
    return f'pip install -e ".[{extra}]"' if checkout else f'pip install "cbs-jax[{extra}]"'
