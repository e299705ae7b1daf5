"""Fit a finished sweep and write its report: python -m experiments.analyze --sweep_dir=DIR.

The command lives in `cbs.commands.analyze` (installed as the `cbs-analyze` console script); this
module keeps `python -m experiments.analyze` working from a checkout.
"""

from cbs.commands.analyze import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
