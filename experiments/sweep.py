"""Run a batch-size sweep, then (by default) fit it and write the report.

The command lives in `cbs.commands.sweep` (installed as the `cbs-sweep` console script); this
module keeps `python -m experiments.sweep` working from a checkout.
"""

from cbs.commands.sweep import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
