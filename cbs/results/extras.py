"""The command that installs an optional extra (`cbs-jax[tfds]`, `[gcs]`, ...), which every
missing-extra error names."""

from __future__ import annotations

import os

__all__ = ["install_command"]


def install_command(extra: str) -> str:
    """`pip install -e ".[extra]"` when cbs runs from a source checkout (a pyproject.toml of
    cbs-jax beside the package), else `pip install "cbs-jax[extra]"`."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../cbs
    root = os.path.dirname(package)
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            checkout = 'name = "cbs-jax"' in f.read()
    except OSError:
        checkout = False
    return f'pip install -e ".[{extra}]"' if checkout else f'pip install "cbs-jax[{extra}]"'
