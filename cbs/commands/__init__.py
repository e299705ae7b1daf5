"""The command-line programs, installed as console scripts, one module each: `train`
(cbs-train), `sweep` (cbs-sweep), `analyze` (cbs-analyze), `branch` (cbs-branch), `ramps`
(cbs-ramps) and `compare` (cbs-compare); `python -m experiments.<name>` runs the same code
from a checkout. Each module defines its absl flags and a `run()` entry function; the top
layer, so it may import every package below it."""

from __future__ import annotations

import pathlib
import sys

__all__ = [
    "analyze", "branch", "compare", "make_configs_importable", "ramps", "sweep", "train",
]


def make_configs_importable(argv: list[str] | None = None) -> None:
    """Lets a config file given by path import its siblings (`from experiments.configs import
    base`) under a console script as under `python -m`: puts the checkout holding the
    `--config` file (the first ancestor with `experiments/__init__.py`), else the current
    directory, at the front of sys.path."""
    argv = sys.argv if argv is None else argv
    roots = [pathlib.Path.cwd()]
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = pathlib.Path(arg.split("=", 1)[1].split(":")[0]).resolve()
            roots = [p for p in path.parents if (p / "experiments" / "__init__.py").is_file()
                     ][:1] + roots
    for root in reversed(roots):
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
