"""The command-line programs, installed as console scripts, one module each: `train`
(cbs-train), `sweep` (cbs-sweep), `analyze` (cbs-analyze), `branch` (cbs-branch), `ramps`
(cbs-ramps), `compare` (cbs-compare) and `advise` (cbs-advise); `python -m
experiments.<name>` runs the same code from a checkout. Each module defines its absl flags and
a `run()` entry function; the top layer, so it may import every package below it."""

from __future__ import annotations

import pathlib
import sys

from cbs import configs
from cbs.runtime import cli

__all__ = [
    "advise", "analyze", "branch", "compare", "make_configs_importable", "ramps", "sweep", "train",
]


def make_configs_importable(argv: list[str] | None = None) -> None:
    """Resolves a packaged preset named by `--config` (`cbs.configs.resolve`) to its file, in
    `argv` itself, and puts the checkout holding a `--config` file (the first ancestor with
    `experiments/__init__.py`), else the current directory, at the front of sys.path, so a
    config file imports its siblings under a console script as under `python -m`. An unknown
    name is one line on stderr and exit status 2."""
    argv = sys.argv if argv is None else argv
    try:  # `--config=VALUE` and `--config VALUE`, in place, as `--config=PATH[:arg]`
        for i in range(len(argv) - 1, 0, -1):
            if argv[i].startswith("--config="):
                argv[i] = "--config=" + configs.resolve(argv[i].split("=", 1)[1])
            elif argv[i] == "--config" and i + 1 < len(argv):
                argv[i:i + 2] = ["--config=" + configs.resolve(argv[i + 1])]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(cli.USER_ERROR_EXIT)
    roots = [pathlib.Path.cwd()]
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = pathlib.Path(arg.split("=", 1)[1].split(":")[0]).resolve()
            roots = [p for p in path.parents if (p / "experiments" / "__init__.py").is_file()
                     ][:1] + roots
    for root in reversed(roots):
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
